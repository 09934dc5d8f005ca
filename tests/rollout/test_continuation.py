"""Continuing a paused slot (issue 43's KV continuation): a conversation's log-probs equal one uncached forward over
it (1e-5, fp32) and its KV rows are the whole conversation's in order; the prefix is never run again; the other slots
decode bitwise as without the continuation; a continuation across pages takes them, and one past the slot's rows or
its pool's free pages is refused with its slot left as it was."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax.models import families as registry
from pacs_jax.rollout import continuation, decode, sampling, scheduler
from pacs_jax.rollout import engine as engine_lib
from tests import uncached_forward

PREFILL, DECODE, PAGE = 16, 32, 8  # 48 cache rows a slot: 6 pages of 8
ROWS = PREFILL + DECODE
GREEDY = sampling.Greedy()
PROMPTS = [list(range(3, 10)), [5, 77, 200], list(range(30, 42))]


@pytest.fixture(scope="module")
def model():
  """The tiny preset, fp32, its weights x3: a peaky random model whose greedy tokens vary (at the preset's 0.02
  init every token is near-uniform and greedy repeats one id)."""
  base = registry.causal_lm(registry.preset("tiny", dtype=jnp.float32, param_dtype=jnp.float32), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(base)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x * 3.0, state))


def make_engine(model, slots=4, kv_pages=0):
  return engine_lib.Engine(model, max_concurrent_decodes=slots, max_prefill_length=PREFILL, max_decode_length=DECODE,
                           steps_per_call=8, min_prefill_bucket=8, page_size=PAGE, kv_pages=kv_pages)


@pytest.fixture(scope="module")
def engine(model):
  return make_engine(model)


@pytest.fixture(scope="module")
def params(engine, model):
  return engine.load_params(model)


@pytest.fixture(scope="module")
def uncached(engine):
  return uncached_forward.log_probs(engine, ROWS)


@pytest.fixture(scope="module")
def reference(engine, params):
  """Greedy tokens of PROMPTS without pauses."""
  return [c.tokens for c in scheduler.generate(engine, params, PROMPTS, max_new_tokens=DECODE - 8)]


def pause_token(reference, slot: int, at_least: int) -> tuple[int, int]:
  """(k, id): the first k >= at_least such that the k-th token of `slot`'s response is in no other response nor
  earlier in its own, so slot `slot` alone pauses, after k tokens."""
  others = {t for s, toks in enumerate(reference) if s != slot for t in toks}
  own = reference[slot]
  k = next(k for k in range(at_least, len(own) + 1) if own[k - 1] not in others | set(own[:k - 1]))
  return k, own[k - 1]


def insert(engine, params, prompts, budgets, sampling_method=GREEDY, pause=None):
  """Prompts into slots 0.. of a fresh state (request keys as `scheduler.generate`'s): (state, first tokens, their
  log-probs) per slot."""
  n = len(prompts)
  state, firsts = scheduler.prefill_insert(engine, params, engine.init_decode_state(), prompts, range(n), range(n),
                                           range(n), [0] * n, budgets, 0, sampling_method, (),
                                           pause_ids=() if pause is None else (pause,))
  tokens, logprobs = [[] for _ in prompts], [[] for _ in prompts]
  for first in firsts:
    for r, t, l in zip(first.requests, np.asarray(first.tokens).tolist(), np.asarray(first.logprobs).tolist()):
      tokens[r].append(t)
      logprobs[r].append(l)
  return state, tokens, logprobs


def decode_until_paused(engine, params, state, pause, tokens, logprobs, sampling_method=GREEDY):
  """Decode calls until slot 0 stops (its tokens appended to each slot's lists): (state, the last call's output)."""
  while True:
    state, out = engine.decode(params, state, len(tokens) + 1, sampling_method, (), pause_ids=(pause,))
    out = jax.device_get(out)
    for s in range(len(tokens)):
      tokens[s] += out.tokens[s, out.emitted[s]].tolist()
      logprobs[s] += out.logprobs[s, out.emitted[s]].tolist()
    if not out.active[0]:
      return state, out


def converse(engine, params, prompts, budgets, observations, pause, sampling_method=GREEDY, on_continue=None):
  """Slot i runs prompts[i]; each time it pauses it is continued with the next of observations[i], and ended once
  they run out. Returns (tokens, log-probs (nan on inserted tokens), loss masks) per slot. `on_continue(state)`
  sees the state before each continue call."""
  n = len(prompts)
  state, tokens, logprobs = insert(engine, params, prompts, budgets, sampling_method, pause)
  masks = [[1] for _ in prompts]
  queue = [list(obs) for obs in observations]
  done = [False] * n
  while not all(done):
    state, out = engine.decode(params, state, n + 1, sampling_method, (), pause_ids=(pause,))
    out = jax.device_get(out)
    for s in range(n):
      emitted = out.tokens[s, out.emitted[s]].tolist()
      tokens[s] += emitted
      logprobs[s] += out.logprobs[s, out.emitted[s]].tolist()
      masks[s] += [1] * len(emitted)
    paused = [s for s in range(n) if not done[s] and not out.active[s] and tokens[s][-1] == pause
              and out.lengths[s] < ROWS]
    done = [d or (not out.active[s] and s not in paused) for s, d in enumerate(done)]
    ended = [s for s in paused if not queue[s]]
    if ended:
      state = engine.release_slots(state, ended)
      done = [d or s in ended for s, d in enumerate(done)]
    going = [s for s in paused if queue[s]]
    if going:
      obs = [queue[s].pop(0) for s in going]
      on_continue and on_continue(state)
      state, first = engine.continue_slots(params, state, *continuation.pad_continuations(engine, going, obs),
                                           sampling_method, (), pause_ids=(pause,))
      first = jax.device_get(first)
      for q, (s, inserted) in enumerate(zip(going, obs)):
        assert first.continued[q]
        tokens[s] += inserted + [int(first.tokens[q])]
        logprobs[s] += [np.nan] * len(inserted) + [float(first.logprobs[q])]
        masks[s] += [0] * len(inserted) + [1]
  return tokens, logprobs, masks, state


def assert_uncached(uncached, params, prompt, tokens, logprobs, mask, temperature=1.0):
  """The model's tokens' recorded log-probs equal the uncached forward's over prompt + response, within 1e-5."""
  seq = list(prompt) + list(tokens)
  lp = uncached(params, seq, temperature)
  model_tokens = [i for i, m in enumerate(mask) if m]
  want = [lp[len(prompt) + i - 1, tokens[i]] for i in model_tokens]
  np.testing.assert_allclose([logprobs[i] for i in model_tokens], want, rtol=0, atol=1e-5)


def slot_rows(state, slot, count):
  """The first `count` KV rows of `slot`, read from its pages: k, v [layers, K, count, H]."""
  rows = continuation.prefix_rows(state.cache, jnp.array([slot]))
  return np.asarray(rows.k[:, 0, :, :count]), np.asarray(rows.v[:, 0, :, :count])


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [GREEDY, sampling.Temperature(0.7)], ids=["greedy", "temperature"])
def test_two_turns_equal_one_uncached_forward(engine, params, model, uncached, method):
  # Slot 0: prompt -> k tokens up to the pause id -> 5 inserted tokens -> more tokens; slot 1 decodes beside it.
  prompts, inserted = PROMPTS[:2], [250, 251, 17, 18, 19]
  reference = [c.tokens for c in scheduler.generate(engine, params, prompts, max_new_tokens=24, sampling=method)]
  k, pause = pause_token(reference, 0, 4)
  state, tokens, logprobs = insert(engine, params, prompts, [30, 30], method)
  state, out = decode_until_paused(engine, params, state, pause, tokens, logprobs, method)
  assert tokens[0] == reference[0][:k] and out.active[1]
  rows = int(out.lengths[0])
  assert rows == len(prompts[0]) + len(tokens[0]) - 1  # the pause id is pending, not in the cache
  state, first = engine.continue_slots(params, state, *continuation.pad_continuations(engine, [0], [inserted]),
                                       method, (), pause_ids=(pause,))
  first = jax.device_get(first)
  assert first.continued[0] and first.active[0] and first.lengths[0] == rows + 1 + len(inserted)
  mask = [1] * len(tokens[0]) + [0] * len(inserted) + [1]
  tokens[0] += inserted + [int(first.tokens[0])]
  logprobs[0] += [np.nan] * len(inserted) + [float(first.logprobs[0])]
  state, out = engine.decode(params, state, 3, method, ())
  out = jax.device_get(out)
  assert out.active[0] and out.emitted[0].all()  # still generating: its pages hold the whole conversation
  for s in range(2):
    tokens[s] += out.tokens[s, out.emitted[s]].tolist()
    logprobs[s] += out.logprobs[s, out.emitted[s]].tolist()
  mask += [1] * int(out.emitted[0].sum())
  temperature = getattr(method, "temperature", 1.0)
  assert_uncached(uncached, params, prompts[0], tokens[0], logprobs[0], mask, temperature)
  assert_uncached(uncached, params, prompts[1], tokens[1], logprobs[1], [1] * len(tokens[1]), temperature)
  # The slot's KV rows are those of a dense prefill of the conversation (inserted tokens in place, in order).
  seq = prompts[0] + tokens[0]
  filled = int(out.lengths[0])
  assert filled == len(seq) - 1
  dense, _ = decode.prefill_forward(model, jnp.array([seq[:filled]]), jnp.array([filled]))
  k_rows, v_rows = slot_rows(state, 0, filled)
  np.testing.assert_allclose(k_rows, np.asarray(dense.k[:, 0]), rtol=0, atol=1e-5)
  np.testing.assert_allclose(v_rows, np.asarray(dense.v[:, 0]), rtol=0, atol=1e-5)


def test_prefix_is_never_run_again(engine, params, uncached, reference):
  # Three turns of a 12-token prompt: the prefix grows to 30 rows, yet each continuation runs its bucket of 8
  # inserted tokens and the pending one: 9 positions, one compiled program whatever the prefix length.
  k, pause = pause_token(reference, 2, 3)
  engine.positions_run.clear()
  compiled = engine._continue_jit._cache_size()  # pylint: disable=protected-access
  prefixes = []
  tokens, logprobs, masks, _ = converse(engine, params, [PROMPTS[2]], [30], [[[1, 2, 3], [4, 5, 6, 7]]], pause,
                                        on_continue=lambda st: prefixes.append(int(np.asarray(st.lengths)[0])))
  assert_uncached(uncached, params, PROMPTS[2], tokens[0], logprobs[0], masks[0])
  turns = len(prefixes)
  assert turns >= 1 and prefixes[0] == len(PROMPTS[2]) + k - 1
  assert engine.positions_run == {"prefill": 16, "continue": 9 * turns}  # the prompt's bucket, then 9 a turn
  assert 9 < prefixes[0] + 1  # ...fewer than the prefix it attends to
  assert engine._continue_jit._cache_size() <= compiled + 1  # pylint: disable=protected-access
  # The program's token input is the bucket of inserted tokens, lowered from abstract weights and state (the hook
  # `--compile_only` would use).
  lowered = engine.lower_continue(engine.abstract_params(), engine.abstract_decode_state(), 2, 8)
  assert lowered.args_info[0][3].shape == (2, 8)


def test_other_slots_are_bitwise_unaffected(engine, params, reference):
  # Slot 0 pauses and is continued (or, in the baseline, ended there); slots 1 and 2 decode the same either way.
  k, pause = pause_token(reference, 0, 3)
  budgets = [24, 24, 24]
  tokens, logprobs, _, _ = converse(engine, params, PROMPTS, budgets, [[[9, 8, 7, 6]], [], []], pause)
  base_tokens, base_logprobs, _, _ = converse(engine, params, PROMPTS, budgets, [[], [], []], pause)
  assert base_tokens[0] == reference[0][:k] and len(tokens[0]) > k + 4  # the baseline ends slot 0 at its pause
  for s in (1, 2):
    assert tokens[s] == base_tokens[s] == reference[s][:budgets[s]]
    np.testing.assert_array_equal(np.asarray(logprobs[s], np.float32), np.asarray(base_logprobs[s], np.float32))


def test_continue_call_leaves_other_slots_state_alone(engine, params, reference):
  k, pause = pause_token(reference, 0, 3)
  state, tokens, logprobs = insert(engine, params, PROMPTS, [24] * 3)
  state, _ = decode_until_paused(engine, params, state, pause, tokens, logprobs)
  old = jax.device_get(state)
  state, first = engine.continue_slots(params, state, *continuation.pad_continuations(engine, [0], [[1, 2]]), GREEDY,
                                       (), pause_ids=(pause,))
  assert bool(first.continued[0])
  new = jax.device_get(state)
  for field in ("lengths", "tokens", "keys", "steps", "budgets", "active"):
    np.testing.assert_array_equal(getattr(new, field)[1:], getattr(old, field)[1:])
  np.testing.assert_array_equal(new.cache.page_table[1:], old.cache.page_table[1:])
  other_pages = np.unique(old.cache.page_table[1:])
  np.testing.assert_array_equal(new.cache.pages[:, other_pages], old.cache.pages[:, other_pages])


def test_continuation_across_pages(engine, params, uncached, reference):
  # 20 inserted tokens after a 9-row prefix (2 pages): rows 9..29 fill 4 pages, 2 taken by the continuation.
  k, pause = pause_token(reference, 0, 3)
  state, tokens, logprobs = insert(engine, params, PROMPTS[:1], [30])
  state, out = decode_until_paused(engine, params, state, pause, tokens, logprobs)
  rows, free = int(out.lengths[0]), int(out.free_pages[0])
  inserted = list(range(100, 120))
  held, after = -(-rows // PAGE), -(-(rows + 1 + len(inserted)) // PAGE)
  assert after - held >= 2
  state, first = engine.continue_slots(params, state, *continuation.pad_continuations(engine, [0], [inserted]),
                                       GREEDY, (), pause_ids=(pause,))
  first = jax.device_get(first)
  assert first.continued[0] and int(first.free_pages[0]) == free - (after - held)
  assert (np.asarray(state.cache.page_table)[0] > 0).sum() == after
  mask = [1] * len(tokens[0]) + [0] * len(inserted) + [1]
  tokens[0] += inserted + [int(first.tokens[0])]
  logprobs[0] += [np.nan] * len(inserted) + [float(first.logprobs[0])]
  state, out = engine.decode(params, state, 2, GREEDY, ())
  out = jax.device_get(out)
  tokens[0] += out.tokens[0, out.emitted[0]].tolist()
  logprobs[0] += out.logprobs[0, out.emitted[0]].tolist()
  mask += [1] * int(out.emitted[0].sum())
  assert_uncached(uncached, params, PROMPTS[0], tokens[0], logprobs[0], mask)


def _assert_same_state(a, b):
  for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
    np.testing.assert_array_equal(x, y)


def test_continuation_past_the_slot_rows_is_refused(engine, params, reference):
  k, pause = pause_token(reference, 0, 3)
  state, tokens, logprobs = insert(engine, params, PROMPTS[:1], [30])
  state, out = decode_until_paused(engine, params, state, pause, tokens, logprobs)
  rows = int(out.lengths[0])
  too_many = ROWS - rows  # the pending token and these need one row more than the slot has
  assert engine.continuation_fits(rows, too_many - 1) and not engine.continuation_fits(rows, too_many)
  old = jax.device_get(state)
  state, first = engine.continue_slots(params, state, *continuation.pad_continuations(engine, [0], [[7] * too_many]),
                                       GREEDY, (), pause_ids=(pause,))
  assert not bool(first.continued[0]) and int(first.lengths[0]) == rows
  _assert_same_state(state, old)  # refused: the slot is as it was, still paused with its pages
  with pytest.raises(ValueError, match="inserted tokens"):
    engine.continue_bucket_length(ROWS)
  # It still takes the most that fits; the cache is then full, so the slot ends there with its pages back.
  state, first = engine.continue_slots(params, state,
                                       *continuation.pad_continuations(engine, [0], [[7] * (too_many - 1)]),
                                       GREEDY, (), pause_ids=(pause,))
  assert bool(first.continued[0]) and not bool(first.active[0]) and int(first.lengths[0]) == ROWS
  assert int(first.free_pages[0]) == engine.pages_per_shard - 1


def test_continuation_without_free_pages_is_refused_then_released(model, params, reference):
  # 7 usable pages; two 12-token prompts hold 2 each; slot 0 pauses and asks for 4 more than it holds.
  small = make_engine(model, slots=2, kv_pages=8)
  k, pause = pause_token(reference, 0, 3)
  prompts = [PROMPTS[0], PROMPTS[2]]
  state, tokens, logprobs = insert(small, params, prompts, [30, 30])
  state, out = decode_until_paused(small, params, state, pause, tokens, logprobs)
  rows, free = int(out.lengths[0]), int(out.free_pages[0])
  held = -(-rows // PAGE)
  inserted = [7] * (min(ROWS - 1, held * PAGE + (free + 1) * PAGE) - rows - 1)
  assert small.continuation_fits(rows, len(inserted)) and -(-(rows + 1 + len(inserted)) // PAGE) - held > free
  old = jax.device_get(state)
  state, first = small.continue_slots(params, state, *continuation.pad_continuations(small, [0], [inserted]),
                                      GREEDY, (), pause_ids=(pause,))
  assert not bool(first.continued[0])
  _assert_same_state(state, old)
  state = small.release_slots(state, [0])  # the conversation ends: its pages come back
  assert int(np.asarray(state.cache.free_count)[0]) == free + held
  assert not np.asarray(state.cache.page_table)[0].any() and bool(np.asarray(state.active)[1])


def test_a_first_token_pause_holds_the_prompt_pages(engine, params, uncached, reference):
  # The prefill's own token is the pause id: the slot stops at insertion with its prompt's pages, then goes on.
  pause = reference[0][0]
  state, _, _ = insert(engine, params, PROMPTS[:1], [20], pause=pause)
  assert not bool(np.asarray(state.active)[0]) and (np.asarray(state.cache.page_table)[0] > 0).sum() == 1
  tokens, logprobs, masks, _ = converse(engine, params, PROMPTS[:1], [20], [[[1, 2, 3]]], pause)
  assert tokens[0][:4] == [pause, 1, 2, 3] and masks[0][:5] == [1, 0, 0, 0, 1] and len(tokens[0]) > 5
  assert_uncached(uncached, params, PROMPTS[0], tokens[0], logprobs[0], masks[0])
