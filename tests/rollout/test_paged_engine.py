"""The paged KV cache in the engine: pages come back when rows finish, a slot without a page waits (and loses
no token), a pool too small for the tokens in flight is a clear error, pools per batch shard on 8 devices,
and a long-tailed rollout reads at most half the rows a dense windowed cache would (computed from the calls)."""

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.models import families as registry
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import dense_figures, sampling, scheduler

PREFILL, DECODE, PAGE = 16, 16, 8  # 32 cache rows: 4 pages of 8 per slot


@pytest.fixture(scope="module")
def model():
  return registry.causal_lm(registry.preset("tiny"), rngs=nnx.Rngs(0))


def make_engine(model, slots=2, kv_pages=0, mesh=None, prefill=PREFILL, decode=DECODE):
  return engine_lib.Engine(model, max_concurrent_decodes=slots, max_prefill_length=prefill, max_decode_length=decode,
                           steps_per_call=8, min_prefill_bucket=8, page_size=PAGE, kv_pages=kv_pages, mesh=mesh)


def run_until_done(engine, params, prompts, budgets):
  """Inserts prompts into slots 0.. and decodes until all finish: (tokens per slot, chunk outputs, state)."""
  state = engine.init_decode_state()
  n = len(prompts)
  state, firsts = scheduler.prefill_insert(engine, params, state, prompts, list(range(n)), list(range(n)),
                                           list(range(n)), [0] * n, budgets, 0, sampling.Greedy(), ())
  tokens = [[] for _ in prompts]
  for first in firsts:
    for r, t in zip(first.requests, np.asarray(first.tokens)):
      tokens[r].append(int(t))
  chunks = []
  while True:
    state, out = engine.decode(params, state, len(prompts) + 1, sampling.Greedy(), ())
    out = jax.device_get(out)
    chunks.append(out)
    for r in range(n):
      tokens[r].extend(out.tokens[r, out.emitted[r]].tolist())
    if not out.active.any():
      return tokens, chunks, state


def test_out_of_pages_waits_then_finishes_and_pages_come_back(model):
  # 4 usable pages (and the null page). A holds 2 (9 prompt rows) and never needs a third; B holds 2 (15
  # rows) and needs its third for row 16 at its second step: it waits until A finishes and returns its pages.
  small = make_engine(model, kv_pages=5)
  roomy = make_engine(model)  # a page for every row: nobody waits
  params = small.load_params(model)
  prompts = [list(range(1, 10)), list(range(20, 35))]
  budgets = [6, 16]
  tokens, chunks, state = run_until_done(small, params, prompts, budgets)
  expected, _, roomy_state = run_until_done(roomy, params, prompts, budgets)
  assert tokens == expected and [len(t) for t in tokens] == budgets  # waiting lost and changed nothing
  first = chunks[0]
  assert first.emitted[0, :5].all() and not first.emitted[0, 5:].any()  # A: 5 steps, then done
  assert first.emitted[1, 0] and not first.emitted[1, 1:5].any() and first.emitted[1, 5]  # B waited 4 steps
  assert first.fewest_free_pages.tolist() == [0]
  # Every page is back in the pool and no table holds one.
  for engine, st in ((small, state), (roomy, roomy_state)):
    assert np.asarray(st.cache.free_count).tolist() == [engine.pages_per_shard - 1]
    assert not np.asarray(st.cache.page_table).any()
    assert sorted(np.asarray(st.cache.free_pages)[0].tolist()) == list(range(engine.pages_per_shard))
  # Through `generate` too: its last decode call reports a full pool.
  free = []
  decode = small.decode
  small.decode = lambda *a: (lambda r: free.append(np.asarray(r[1].free_pages).tolist()) or r)(decode(*a))
  try:
    out = scheduler.generate(small, params, prompts * 3, max_new_tokens=budgets * 3)
  finally:
    del small.decode
  assert [c.tokens for c in out] == expected * 3
  assert free[-1] == [small.pages_per_shard - 1] and min(f[0] for f in free) < small.pages_per_shard - 1
  # A request done when it is inserted (a budget of one token) returns its prompt's pages at once.
  free.clear()
  small.decode = lambda *a: (lambda r: free.append(np.asarray(r[1].free_pages).tolist()) or r)(decode(*a))
  try:
    out = scheduler.generate(small, params, prompts, max_new_tokens=1)
  finally:
    del small.decode
  assert [c.tokens for c in out] == [t[:1] for t in expected] and free and all(f == [small.pages_per_shard - 1] for f in free)


def test_a_pool_too_small_for_the_tokens_in_flight_is_a_clear_error(model):
  # Two prompts of 2 tokens enter together (a page each, a page of headroom each) and grow in step: at row 16
  # both need a third page with all 4 taken, and nobody can finish.
  engine = make_engine(model, kv_pages=5)
  params = engine.load_params(model)
  with pytest.raises(RuntimeError, match=r"waiting for a KV page.*rollout\.kv_pages=5.*rollout\.page_size=8"):
    scheduler.generate(engine, params, [[1, 2], [3, 4]], max_new_tokens=16)
  with pytest.raises(ValueError, match="rollout.kv_pages"):
    make_engine(model, kv_pages=4)  # not even one slot's pages and the null page


def test_page_pools_per_batch_shard_on_8_devices(model):
  assert jax.device_count() == 8
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  # 4 shards of 2 slots; 7 usable pages a shard for two slots of up to 4 pages: slots may wait, never both.
  engine = make_engine(model, slots=8, kv_pages=32, mesh=mesh)
  assert engine.page_shards == 4 and engine.pages_per_shard == 8
  params = engine.load_params(model)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 256, size=n).tolist() for n in (3, 16, 9, 12, 5, 14)]
  state = engine.init_decode_state()
  state, _ = scheduler.prefill_insert(engine, params, state, prompts[:2] * 4, list(range(8)), list(range(8)),
                                      list(range(8)), [0] * 8, [4] * 8, 0, sampling.Greedy(), ())
  table = np.asarray(state.cache.page_table)
  # Shard-local page indices: each shard hands out its own page 1 first; pools are used alike.
  assert table[[0, 2, 4, 6], 0].tolist() == [1] * 4 and table.max() < engine.pages_per_shard
  assert np.asarray(state.cache.free_count).tolist() == [7 - 1 - 2] * 4
  kw = dict(n=2, max_new_tokens=[16, 12, 16, 8, 16, 16], sampling=sampling.Temperature(1.0), seed=3, eos_ids=[5, 6])
  out = scheduler.generate(engine, params, prompts, **kw)
  # One pool on one device: the same completions.
  single = make_engine(model, slots=8)
  expected = scheduler.generate(single, single.load_params(model), prompts, **kw)
  assert len({len(c.tokens) for c in out}) > 2
  for a, b in zip(out, expected):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_long_tailed_rollout_reads_at_most_half_the_dense_windowed_rows(model):
  """Acceptance 4 on a small case (benchmarks/paged_kv.py is the full one): most responses short, one in
  eight at the maximum; rows read counted from the page budget each decode call ran at, against what a dense
  cache windowed to the busy rows (from one page up) would have read in the same calls (`dense_figures`)."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 256, size=n).tolist() for n in rng.integers(4, 17, size=32)]
  budgets = rng.integers(1, 17, size=32)
  budgets[::8] = 128
  kw = dict(max_new_tokens=budgets.tolist(), sampling=sampling.Temperature(1.0), seed=0)
  engine = make_engine(model, slots=8, decode=128)
  params = engine.load_params(model)
  stats = dense_figures.DenseFigures.of(engine, min_window=PAGE)
  out = scheduler.generate(engine, params, prompts, stats=stats, **kw)
  assert [len(c.tokens) for c in out] == budgets.tolist()
  assert stats.steps == sum(steps for *_, steps in stats.calls) > 128
  assert stats.rows_per_step <= 0.5 * stats.dense_rows_per_step, (stats.rows_per_step, stats.dense_rows_per_step)
  assert stats.peak_rows_held < 0.5 * stats.dense_rows_held
  # The same completions when every call reads every page.
  decode = engine.decode
  engine.decode = lambda *a: decode(*a[:-1], engine.page_budgets[-1])
  try:
    every = scheduler.generate(engine, params, prompts, **kw)
  finally:
    del engine.decode
  assert [c.tokens for c in out] == [c.tokens for c in every]


@pytest.mark.parametrize("field,value,message", [("kv_cache", "paged", "rollout.kv_cache: was removed"),
                                                 ("page_size", 0, "rollout.page_size"),
                                                 ("kv_pages", -1, "rollout.kv_pages")])
def test_config_names_a_bad_kv_cache_field(field, value, message):
  cfg = config_lib.default_config()
  cfg.rollout[field] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(cfg)


def test_jetstream_needs_a_pool_that_never_runs_out(model):
  jetstream = pytest.importorskip("pacs_jax.rollout.jetstream")  # the `jetstream` extra; the others need none
  engine = engine_lib.Engine(model, max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=16,
                             page_size=PAGE, kv_pages=5)
  with pytest.raises(ValueError, match="rollout.kv_pages must be 0"):
    jetstream.JetStreamEngine(engine)
