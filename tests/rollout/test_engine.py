"""Rollout engine (paged KV cache): greedy equals transformers, cached == uncached logits, log-probs the trainer
recomputes, reproducible sampling, continuous batching, page budgets that change no token, weight swaps without
recompiling, 8-device sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Spec

from pacs_jax import sharding
from pacs_jax.models import families as registry, hf
from pacs_jax.rollout import decode, interface, sampling, scheduler
from pacs_jax.rollout import engine as engine_lib

# The slot ladder's and the page budgets' programs are compared bit for bit with the full ones: -O1 (conftest.py).
pytestmark = pytest.mark.xla_o1

VOCAB = 128
MAX_PREFILL, MAX_DECODE = 16, 40
PROMPT_LENGTHS = (3, 7, 12, 5, 9)  # two prefill buckets (8, 16)
FORWARD_BATCH = 8  # the uncached reference forward always runs at [8, MAX_PREFILL + MAX_DECODE]


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
  cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 rope_theta=10_000.0, tie_word_embeddings=False, initializer_range=0.1)
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  path = str(tmp_path_factory.mktemp("tiny_qwen2"))
  model.save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def torch_model(hf_model_dir):
  return transformers.Qwen2ForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(hf_model_dir):
  model, _ = hf.load_pretrained(hf_model_dir, dtype=jnp.float32)
  return model


def make_engine(model, page_size=8, **kw):
  return engine_lib.Engine(model, max_concurrent_decodes=4, max_prefill_length=MAX_PREFILL,
                           max_decode_length=MAX_DECODE, steps_per_call=8, min_prefill_bucket=8, page_size=page_size,
                           **kw)


@pytest.fixture(scope="module")
def engine(model):
  # Pages of 8 rows: 7 per slot, every test below reads live pages only.
  return make_engine(model)


@pytest.fixture(scope="module")
def params(engine, model):
  return engine.load_params(model)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(1, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def greedy_32(engine, params, prompts):
  return scheduler.generate(engine, params, prompts, max_new_tokens=32)


@pytest.fixture(scope="module")
def uncached_logits(engine):
  """Full-sequence forward without a cache (left padding): fp32 logits [8, L, V] for token lists."""
  width = MAX_PREFILL + MAX_DECODE

  @jax.jit
  def forward(params, ids, mask):
    return nnx.merge(engine.graphdef, params)(ids, mask).astype(jnp.float32)

  def run(params, sequences):
    assert len(sequences) <= FORWARD_BATCH
    ids = np.zeros((FORWARD_BATCH, width), np.int32)
    mask = np.zeros((FORWARD_BATCH, width), np.int32)
    for i, seq in enumerate(sequences):
      ids[i, width - len(seq):] = seq
      mask[i, width - len(seq):] = 1
    # Row i, position j of `seq` sits at column width - len(seq) + j.
    return np.asarray(forward(params, ids, mask))

  return run


def logits_at(all_logits, row, seq_len, position):
  return all_logits[row, MAX_PREFILL + MAX_DECODE - seq_len + position]


def hf_greedy(torch_model, prompts, max_new_tokens, eos_id=None):
  """transformers greedy generation, left-padded batch; rows cut after their first EOS."""
  width = max(map(len, prompts))
  pad = VOCAB - 1 if eos_id != VOCAB - 1 else VOCAB - 2
  ids = torch.full((len(prompts), width), pad)
  mask = torch.zeros((len(prompts), width), dtype=torch.long)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  with torch.no_grad():
    out = torch_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                               eos_token_id=eos_id, pad_token_id=pad)
  rows = []
  for row in out[:, width:].tolist():
    if eos_id is not None and eos_id in row:
      row = row[:row.index(eos_id) + 1]
    rows.append(row)
  return rows


# ----------------------------------------------------------------------------------------------
# 1. Greedy equals transformers


def test_greedy_matches_transformers(greedy_32, torch_model, prompts):
  expected = hf_greedy(torch_model, prompts, 32)
  assert [c.tokens for c in greedy_32] == expected
  assert all(c.finish_reason == "length" and len(c.tokens) == 32 for c in greedy_32)
  assert [(c.prompt_index, c.sample_index) for c in greedy_32] == [(i, 0) for i in range(len(prompts))]


def test_greedy_matches_transformers_when_slots_wait_for_pages(model, params, torch_model, prompts):
  # 19 usable pages of 8 rows for 4 slots whose rows grow to 35-44 rows (5-6 pages each): slots wait for pages
  # to grow, and the last request for a slot's pages to come back.
  small = make_engine(model, kv_pages=20)
  fewest = []
  decode = small.decode
  small.decode = lambda *a: (lambda r: fewest.append(int(np.asarray(r[1].fewest_free_pages).min())) or r)(decode(*a))
  out = scheduler.generate(small, params, prompts, max_new_tokens=32)
  assert [c.tokens for c in out] == hf_greedy(torch_model, prompts, 32)
  assert min(fewest) == 0  # the pool ran dry


def test_greedy_stops_at_eos_like_transformers(engine, params, greedy_32, torch_model, prompts):
  # An EOS id greedy really emits: prompt 1's token at the first step >= 10 not seen earlier in its row.
  row = greedy_32[1].tokens
  step = next(i for i in range(10, 32) if row[i] not in row[:i])
  eos = row[step]
  completions = scheduler.generate(engine, params, prompts, max_new_tokens=32, eos_ids=[eos])
  expected = hf_greedy(torch_model, prompts, 32, eos_id=eos)
  assert [c.tokens for c in completions] == expected
  assert completions[1].tokens == row[:step + 1] and completions[1].finish_reason == "eos"
  for c, full in zip(completions, greedy_32):
    assert c.finish_reason == ("eos" if eos in full.tokens else "length")
    np.testing.assert_allclose(c.logprobs, full.logprobs[:len(c.tokens)], atol=1e-6)


def test_eos_as_first_token_and_single_token_budget(engine, params, greedy_32, prompts):
  first = greedy_32[0].tokens[0]
  out = scheduler.generate(engine, params, prompts[:1], max_new_tokens=32, eos_ids=[first, VOCAB + 5])
  assert out[0].tokens == [first] and out[0].finish_reason == "eos"
  out = scheduler.generate(engine, params, prompts, max_new_tokens=1)
  assert [c.tokens for c in out] == [c.tokens[:1] for c in greedy_32]
  assert all(c.finish_reason == "length" for c in out)


def test_rejects_lengths_beyond_the_cache(engine, params, prompts):
  with pytest.raises(ValueError, match="max_prefill_length"):
    scheduler.generate(engine, params, [list(range(1, MAX_PREFILL + 2))], max_new_tokens=4)
  with pytest.raises(ValueError, match="max_decode_length"):
    scheduler.generate(engine, params, prompts, max_new_tokens=MAX_DECODE + 1)
  with pytest.raises(ValueError):
    scheduler.generate(engine, params, [[]], max_new_tokens=4)


# ----------------------------------------------------------------------------------------------
# 2. Cached logits equal the uncached forward at every step


@pytest.mark.parametrize("page_size", [8, 3], ids=["pages_of_8", "pages_of_3"])
def test_cached_logits_equal_uncached_forward(page_size, model, params, prompts, uncached_logits):
  # Pages of 3 rows: page boundaries fall inside every prefill bucket and at other steps than pages of 8.
  engine = make_engine(model, page_size=page_size)
  steps = 24
  batch = prompts[:4]
  state = engine.init_decode_state()
  state, firsts = scheduler.prefill_insert(engine, params, state, batch, [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3],
                                           [0] * 4, [steps + 1] * 4, 0, sampling.Greedy(), ())
  generated = [[] for _ in batch]
  for first in firsts:
    for r, t in zip(first.requests, np.asarray(first.tokens)):
      generated[r].append(int(t))
  step = jax.jit(lambda p, s, eos: decode.decode_step(nnx.merge(engine.graphdef, p), s, sampling.Greedy(), eos))
  cached = []
  for _ in range(steps):
    state, out = step(params, state, decode.eos_array(()))
    tokens, emitted, logits = out.tokens, out.emitted, out.logits
    assert np.asarray(emitted).all()
    cached.append(np.asarray(logits))
    for r, t in enumerate(np.asarray(tokens)):
      generated[r].append(int(t))
  # Prefill's last-token logits (which chose the first token), too.
  tokens = np.zeros((4, MAX_PREFILL), np.int32)
  for i, p in enumerate(batch):
    tokens[i, :len(p)] = p
  _, prefill_logits = engine.prefill_batch(params, tokens, np.array([len(p) for p in batch], np.int32))

  sequences = [p + g for p, g in zip(batch, generated)]
  full = uncached_logits(params, sequences)
  for r, (p, seq) in enumerate(zip(batch, sequences)):
    np.testing.assert_allclose(prefill_logits[r], logits_at(full, r, len(seq), len(p) - 1), atol=1e-4)
    for s in range(steps):
      # Decode step s fed generated token s, which sits at position len(p) + s.
      np.testing.assert_allclose(cached[s][r], logits_at(full, r, len(seq), len(p) + s), atol=1e-4,
                                 err_msg=f"slot {r} step {s}")
    assert generated[r] == [int(t) for t in np.argmax(full[r, -len(seq) + len(p) - 1:-1], axis=-1)]


# ----------------------------------------------------------------------------------------------
# 3. Returned log-probs equal log_softmax(forward(prompt + response) / T)


def test_logprobs_match_full_forward(engine, params, prompts, uncached_logits):
  method = sampling.TopP(p=0.9, temperature=0.7)
  completions = scheduler.generate(engine, params, prompts[:4], n=2, max_new_tokens=20, sampling=method, seed=3,
                                    eos_ids=[5, 6])
  sequences = [prompts[c.prompt_index] + c.tokens for c in completions]
  full = uncached_logits(params, sequences)
  for r, (c, seq) in enumerate(zip(completions, sequences)):
    P = len(prompts[c.prompt_index])
    rows = np.stack([logits_at(full, r, len(seq), P - 1 + j) for j in range(len(c.tokens))])
    expected = jax.nn.log_softmax(rows / method.temperature, axis=-1)[np.arange(len(c.tokens)), c.tokens]
    assert c.logprobs.dtype == np.float32 and c.logprobs.shape == (len(c.tokens),)
    np.testing.assert_allclose(c.logprobs, expected, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# 5. n samples differ and are reproducible; 6. more requests than slots, independent of order


def test_samples_differ_and_are_reproducible(engine, params, prompts):
  run = functools.partial(scheduler.generate, engine, params, prompts[:2], n=4, max_new_tokens=12,
                          sampling=sampling.Temperature(1.0))
  first, again, other_seed = run(seed=7), run(seed=7), run(seed=8)
  for p in range(2):
    samples = [tuple(c.tokens) for c in first if c.prompt_index == p]
    assert len(set(samples)) == 4, samples
  assert [c.tokens for c in first] == [c.tokens for c in again]
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert [c.tokens for c in first] != [c.tokens for c in other_seed]


class Recorder(interface.Progress):
  def __init__(self):
    self.events = []

  def __call__(self):
    self.events.append(("finish", 0))

  def begin(self, budget):
    self.events.append(("begin", budget))

  def tokens(self, count):
    self.events.append(("tokens", count))


def test_progress_moves_with_the_tokens_of_each_decode_call(engine, params, prompts):
  """A progress bar hears the token budget, then what each decode call (8 steps) generated: it moves before the
  first response (24 tokens) finishes, and ends at the budget whatever stops early."""
  for eos, budget in (([], 24), ([1, 2, 3, 4], 30)):
    recorder = Recorder()
    out = scheduler.generate(engine, params, prompts, n=3, max_new_tokens=budget, sampling=sampling.Temperature(1.0),
                             seed=11, eos_ids=eos, on_finish=recorder)
    events = recorder.events
    assert events[0] == ("begin", len(prompts) * 3 * budget)
    assert sum(c for kind, c in events if kind == "tokens") == len(prompts) * 3 * budget
    assert sum(kind == "finish" for kind, _ in events) == len(out)
    if not eos:  # 4 slots x (1 prefill token + 8 steps) per call, before any of the 24-token responses ends
      first_finish = [kind for kind, _ in events].index("finish")
      assert [c for kind, c in events[:first_finish] if kind == "tokens"] == [4 * 9, 4 * 8], events[:6]


def test_more_requests_than_slots_independent_of_order(engine, params, prompts):
  kw = dict(n=3, max_new_tokens=24, sampling=sampling.Temperature(1.0), seed=11, eos_ids=[1, 2, 3, 4])
  # 15 requests on 4 slots; the EOS ids make them finish at different steps.
  batch = scheduler.generate(engine, params, prompts, **kw)
  assert [(c.prompt_index, c.sample_index) for c in batch] == [(p, s) for p in range(5) for s in range(3)]
  lengths = {len(c.tokens) for c in batch}
  assert len(lengths) > 2 and any(c.finish_reason == "eos" for c in batch)
  # Reversed prompt order, keyed by the same prompt ids: the same completion for every request.
  order = [4, 2, 0, 3, 1]
  shuffled = scheduler.generate(engine, params, [prompts[i] for i in order], prompt_ids=order, **kw)
  by_request = {(order[c.prompt_index], c.sample_index): c for c in shuffled}
  # Each prompt alone (other slot assignments, other batch-mates).
  alone = {}
  for i in (0, 3):
    for c in scheduler.generate(engine, params, [prompts[i]], prompt_ids=[i], **kw):
      alone[(i, c.sample_index)] = c
  for c in batch:
    for other in [by_request[(c.prompt_index, c.sample_index)], alone.get((c.prompt_index, c.sample_index))]:
      if other is None:
        continue
      assert other.tokens == c.tokens and other.finish_reason == c.finish_reason
      np.testing.assert_allclose(other.logprobs, c.logprobs, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Page budgets: reading only the live pages changes no token and no log-prob


def test_page_budgets_equal_reading_every_page_and_the_uncached_forward(engine, params, prompts, uncached_logits,
                                                                        monkeypatch):
  """The scheduler's page budgets give the tokens and log-probs of a budget of every page, and log-probs equal
  to log_softmax(uncached forward / T) at every token."""
  assert engine.page_budgets == (4, 6, 8, 12, 16, 24, 28)  # 4 slots x 7 pages of 8 rows
  kw = dict(n=3, max_new_tokens=MAX_DECODE, sampling=sampling.Temperature(1.0), seed=5, eos_ids=[1, 2, 3])
  budgets = []
  decode = engine.decode
  monkeypatch.setattr(engine, "decode", lambda *a: budgets.append(a[-1]) or decode(*a))
  live = scheduler.generate(engine, params, prompts, **kw)
  assert {8, 16} <= set(budgets), budgets  # short rows read fewer pages
  monkeypatch.setattr(engine, "decode", lambda *a: decode(*a[:-1], engine.page_budgets[-1]))
  every = scheduler.generate(engine, params, prompts, **kw)
  assert len({len(c.tokens) for c in live}) > 2
  for a, b in zip(live, every):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  for start in range(0, len(live), FORWARD_BATCH):
    batch = live[start:start + FORWARD_BATCH]
    sequences = [prompts[c.prompt_index] + c.tokens for c in batch]
    full = uncached_logits(params, sequences)
    for r, (c, seq) in enumerate(zip(batch, sequences)):
      P = len(prompts[c.prompt_index])
      rows = np.stack([logits_at(full, r, len(seq), P - 1 + j) for j in range(len(c.tokens))])
      expected = jax.nn.log_softmax(rows, axis=-1)[np.arange(len(c.tokens)), c.tokens]
      np.testing.assert_allclose(c.logprobs, expected, atol=1e-4)


def test_a_page_budget_too_small_returns_early_and_loses_nothing(engine, params, prompts, greedy_32):
  state = engine.init_decode_state()
  state, firsts = scheduler.prefill_insert(engine, params, state, prompts[:2], [0, 1], [0, 1], [0, 1], [0, 0],
                                           [20, 20], 0, sampling.Greedy(), ())
  tokens = [[], []]
  for first in firsts:
    for r, t in zip(first.requests, np.asarray(first.tokens)):
      tokens[r].append(int(t))
  # Prompts of 3 and 7 tokens in pages of 8 rows: a budget of 4 live pages (a page each, busy or idle) lets slot
  # 1 take one step (row 7); then row 8 needs its second page.
  state, chunk = engine.decode(params, state, 5, sampling.Greedy(), (), 4)
  out, emitted, active, rows = chunk.tokens, chunk.emitted, chunk.active, chunk.lengths
  assert np.asarray(emitted)[:2].sum(axis=1).tolist() == [1, 1]
  assert np.asarray(rows)[:2].tolist() == [4, 8] and np.asarray(active)[:2].all()
  while True:
    for r in range(2):
      tokens[r].extend(np.asarray(out)[r, np.asarray(emitted)[r]].tolist())
    if not np.asarray(active).any():
      break
    state, chunk = engine.decode(params, state, 5, sampling.Greedy(), ())
    out, emitted, active, rows = chunk.tokens, chunk.emitted, chunk.active, chunk.lengths
  assert tokens == [c.tokens[:20] for c in greedy_32[:2]]


# ----------------------------------------------------------------------------------------------
# The slot ladder: the tail's decode calls over fewer slots change no token and no log-prob


def test_the_slot_ladder_changes_no_token_and_no_logprob(model, engine, params, prompts):
  kw = dict(n=3, max_new_tokens=24, sampling=sampling.Temperature(1.0), seed=11, eos_ids=[1, 2, 3, 4])
  every_slot = scheduler.generate(engine, params, prompts, **kw)
  laddered = make_engine(model, slot_rungs=3)
  assert laddered.slot_rungs == (1, 2, 4)
  rungs_run = []
  decode = laddered.decode
  laddered.decode = lambda *a, slots=None, **k: rungs_run.append(4 if slots is None else len(slots)) or decode(
      *a, slots=slots, **k)
  out = scheduler.generate(laddered, params, prompts, **kw)
  assert {1, 2} <= set(rungs_run), rungs_run  # the tail ran in both smaller rungs
  for a, b in zip(out, every_slot):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
  # Sharded (8 slots on 4 batch shards, tensor 2): a rung gathers each shard's busy slots within the shard.
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  sharded = engine_lib.Engine(model, max_concurrent_decodes=8, max_prefill_length=MAX_PREFILL,
                              max_decode_length=MAX_DECODE, steps_per_call=8, min_prefill_bucket=8, mesh=mesh,
                              page_size=8, slot_rungs=2)
  assert sharded.slot_rungs == (4, 8) and sharded.page_shards == 4
  rungs_run.clear()
  decode = sharded.decode
  sharded.decode = lambda *a, slots=None, **k: rungs_run.append(8 if slots is None else len(slots)) or decode(
      *a, slots=slots, **k)
  out = scheduler.generate(sharded, sharded.load_params(model), prompts, **kw)
  assert 4 in rungs_run, rungs_run
  for a, b in zip(out, every_slot):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# New weights without recompiling


def test_new_params_reuse_compiled_programs(engine, params, prompts, greedy_32, model):
  compiled = engine.compiled_count()
  other = registry.causal_lm(model.config, rngs=nnx.Rngs(123))
  new_params = engine.load_params(other)
  out = scheduler.generate(engine, new_params, prompts, max_new_tokens=32)
  assert engine.compiled_count() == compiled
  assert [c.tokens for c in out] != [c.tokens for c in greedy_32]
  again = scheduler.generate(engine, params, prompts, max_new_tokens=32)
  assert [c.tokens for c in again] == [c.tokens for c in greedy_32]
  assert engine.compiled_count() == compiled


# ----------------------------------------------------------------------------------------------
# 8. Sharded over 8 simulated devices (fsdp=4, tensor=2)


@pytest.mark.parametrize("slots", [4, 8], ids=["a_slot_a_shard", "two_slots_a_shard"])
def test_sharded_engine_matches_single_device(slots, model, prompts, greedy_32):
  assert jax.device_count() == 8
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  eng = engine_lib.Engine(model, max_concurrent_decodes=slots, max_prefill_length=MAX_PREFILL,
                          max_decode_length=MAX_DECODE, steps_per_call=8, min_prefill_bucket=8, mesh=mesh, page_size=8)
  params = eng.load_params(model)
  def laid_out(x, *spec):
    return x.sharding.is_equivalent_to(NamedSharding(mesh, Spec(*spec)), x.ndim)

  def cache_laid_out(state):
    # pages [layers, A, ps, 2K, H] and page tables [B, M]: a pool of pages per batch shard, beside its slots
    return (eng.page_shards == 4 and laid_out(state.cache.pages, None, ("data", "fsdp"), None, "tensor", None)
            and laid_out(state.cache.page_table, ("data", "fsdp"), None)
            and laid_out(state.cache.free_count, ("data", "fsdp")))

  assert laid_out(params["model"]["layers"]["self_attn"]["q_kernel"].get_value(), None, None, "tensor", None)
  state = eng.init_decode_state()
  assert cache_laid_out(state)
  assert laid_out(state.tokens, ("data", "fsdp"))
  out = scheduler.generate(eng, params, prompts, max_new_tokens=32)
  assert [c.tokens for c in out] == [c.tokens for c in greedy_32]
  # The constraints hold through prefill, insert and decode.
  state, _ = scheduler.prefill_insert(eng, params, state, prompts[:2], [0, 1], [0, 1], [0, 1], [0, 0], [8, 8], 0,
                                      sampling.Greedy(), ())
  state, *_ = eng.decode(params, state, 5, sampling.Greedy(), ())
  assert cache_laid_out(state)
  for a, b in zip(out, greedy_32):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
