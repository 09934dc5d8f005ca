"""Pure decode maths on a merged model: request keys, prefill (into a dense `KVCache` of the prompts), first-token
sampling, slot insertion into the paged cache, one decode step and a chunk of them in one `lax.while_loop`. The
`Engine` jits them with params as an argument.

Shapes: B slots (or prompts in a prefill), T prompt bucket length, Q requests, V vocab, L cache rows per slot,
Z batch shards, M pages per slot, ps page size.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.models import kv_cache, paged
from pacs_jax.models.decoder import CausalLM
from pacs_jax.models.kv_cache import KVCache
from pacs_jax.rollout import page_allocation as pages_lib
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout.decode_state import ChunkOutput, DecodeState, Prefix, StepOutput


def request_keys(seed: jax.Array, prompt_index: jax.Array, sample_index: jax.Array) -> jax.Array:
  """Key data [Q, *key] of requests (prompt_index [Q], sample_index [Q]): independent of slot and order."""
  base = jax.random.key(seed)
  one = lambda p, s: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(base, p), s))
  return jax.vmap(one)(prompt_index, sample_index)


def step_keys(key_data: jax.Array, steps: jax.Array) -> jax.Array:
  """Keys [Q] of token `steps` [Q] of requests with key data [Q, *key]."""
  return jax.vmap(lambda k, t: jax.random.fold_in(jax.random.wrap_key_data(k), t))(key_data, steps)


def eos_array(eos_ids: Sequence[int]) -> np.ndarray:
  """EOS ids as an int32 array padded with -1 to a multiple of 4: a traced argument, so changing the
  ids (up to 4 of them) does not recompile."""
  eos = sorted({int(e) for e in eos_ids})
  size = max(4, -(-len(eos) // 4) * 4)
  return np.array(eos + [-1] * (size - len(eos)), np.int32)


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  """tokens [Q] -> [Q] bool; the -1 padding of `eos_array` never matches a token."""
  return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)


def prefill_forward(model: CausalLM, tokens: jax.Array, true_lengths: jax.Array):
  """Right-padded prompts tokens [B, T] at positions 0..T-1 -> (cache [layers, B, K, T, H], logits
  [B, V] fp32 at each row's last real token). Pad rows hold junk that decode overwrites before use."""
  B, T = tokens.shape
  cache = kv_cache.init_cache(model.config, B, T)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  hidden, cache = model.model.forward_with_cache(tokens, positions, cache)
  last = jnp.clip(true_lengths - 1, 0, T - 1)
  last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
  # The vocab projection only at the last token: [B, V] instead of [B, T, V].
  return cache, model.logits(last_hidden)[:, 0].astype(jnp.float32)


def sample_first(logits: jax.Array, key_data: jax.Array, sampling: sampling_lib.SamplingMethod):
  """First response token (key step 0) of requests from their prompts' last logits [Q, V]:
  (tokens [Q] int32, log-probs [Q] fp32)."""
  keys = step_keys(key_data, jnp.zeros(key_data.shape[:1], jnp.int32))
  return sampling.sample_with_logprobs(logits, keys)


def prefix_of_requests(cache: KVCache, logits: jax.Array, true_lengths: jax.Array, rows: jax.Array,
                       key_data: jax.Array, sampling: sampling_lib.SamplingMethod) -> Prefix:
  """Q requests from B prefilled prompts (cache [layers, B, K, T, H], logits [B, V], true_lengths [B]):
  request r continues prompt `rows[r]` with its first token sampled from key data `key_data[r]`. The prefix
  keeps the prompts' cache ([layers, B, ...], not one copy per request): pass `rows` on to `insert_rows`, which
  reads each request's rows one layer at a time."""
  first, logprobs = sample_first(logits[rows], key_data, sampling)
  return Prefix(cache=cache, lengths=true_lengths[rows], tokens=first, logprobs=logprobs, keys=key_data,
                steps=jnp.ones_like(rows))


def insert_rows(state: DecodeState, prefix: Prefix, slots: jax.Array, budgets: jax.Array,
                eos_ids: jax.Array, cache_rows: jax.Array | None = None,
                pause_ids: jax.Array | None = None) -> DecodeState:
  """Writes prefix rows [Q] into decode slots [Q]; a slot index >= B is a padding row and is dropped.
  `cache_rows` [Q]: request r's rows are prefix.cache's row cache_rows[r] (see `prefix_of_requests`); None:
  row r.

  Each request gets the pages its prompt rows fill (a request its shard has no pages for is dropped; the
  scheduler checks first), and a request that is already done gives them back at once (one whose first token is
  a pause id stops there holding them, as in decode: `stops`).
  """
  L = cache_length(state)
  cache, slots = pages_lib.insert(state.cache, prefix.cache, prefix.lengths, slots, cache_rows)

  def put(buf, rows):  # buf [B, ...], rows [Q, ...]
    return buf.at[slots].set(rows.astype(buf.dtype), mode="drop")

  sampled = prefix.steps > 0
  if pause_ids is None:  # no pause ids: the program as compiled before slots could pause
    done = (sampled & is_eos(prefix.tokens, eos_ids)) | (prefix.steps >= budgets) | (prefix.lengths >= L)
    released = done
  else:
    stopped, paused = stops(prefix.tokens, prefix.steps, prefix.lengths, budgets, L, eos_ids, pause_ids)
    done = (sampled & stopped) | (prefix.steps >= budgets) | (prefix.lengths >= L)
    released = done & ~(sampled & paused)
  return DecodeState(cache=pages_lib.release(cache, put(jnp.zeros_like(state.active), released)),
                     lengths=put(state.lengths, prefix.lengths), tokens=put(state.tokens, prefix.tokens),
                     keys=put(state.keys, prefix.keys), steps=put(state.steps, prefix.steps),
                     budgets=put(state.budgets, budgets), active=put(state.active, ~done))


def cache_length(state: DecodeState) -> int:
  """L: cache rows a slot can hold."""
  return state.cache.page_table.shape[1] * state.cache.page_size


def _paged_forward(model: CausalLM, state: DecodeState, page_budget: int | None):
  """A page for each active slot whose pending token starts a new page (a slot its shard has none for waits:
  it does not step), then the forward. Returns (logits [B, 1, V], cache, stepped [B] bool)."""
  cache = state.cache
  B, M = cache.page_table.shape
  ps, Z = cache.page_size, cache.shards
  needs = state.active & (state.lengths % ps == 0)  # the slot holds ceil(lengths / ps) pages
  page, granted, free_count = pages_lib.take(cache, needs)
  table = cache.page_table.at[jnp.arange(B), jnp.where(granted, state.lengths // ps, M)].set(page, mode="drop")
  stepped = state.active & (~needs | granted)
  # Slots that do not step attend to one row of their shard's null page and write there.
  position = jnp.where(stepped, state.lengths, 0)  # [B]
  step = paged.PagedStep(pages=cache.pages, page_table=jnp.where(stepped[:, None], table, 0), positions=position,
                         kv_lens=position + 1, page_budget=(B // Z) * M if page_budget is None else page_budget,
                         shards=Z)
  logits, step = model.forward_with_cache(state.tokens[:, None], position[:, None], step)
  return logits, cache.replace(pages=step.pages, page_table=table, free_count=free_count), stepped


def stops(tokens: jax.Array, steps: jax.Array, lengths: jax.Array, budgets: jax.Array, L: int,
          eos_ids: jax.Array, pause_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Which slots stop after sampling `tokens` [B] (with `steps` generated and `lengths` filled rows [B]):
  (stopped [B], paused [B]) bool. A slot stops at an EOS or pause id, at its budget, or with its cache full; it
  pauses (keeps its pages, so `continuation` can feed it more tokens after its KV prefix) at a pause id while its
  cache still has a row for that token. A paused slot is stopped too; only stopped, unpaused slots give pages back.
  """
  paused = jnp.zeros_like(tokens, bool) if pause_ids is None else is_eos(tokens, pause_ids) & (lengths < L)
  stopped = paused | is_eos(tokens, eos_ids) | (steps >= budgets) | (lengths >= L)
  return stopped, paused


def decode_step(model: CausalLM, state: DecodeState, sampling: sampling_lib.SamplingMethod,
                eos_ids: jax.Array, page_budget: int | None = None,
                pause_ids: jax.Array | None = None) -> tuple[DecodeState, StepOutput]:
  """Feeds every slot's pending token and samples the next one; only active slots emit and advance.

  A slot stops at an EOS id, at its budget, or when its cache is full, and pauses at any of `pause_ids` (a
  tool-call stop: see `stops`). Attention reads `page_budget` live (slot, page) pairs per shard (default: every
  page; see `page_allocation.live_pages_needed`). An active slot that gets no page waits (emits nothing, does not
  advance), and a finished (not paused) slot's pages go back to its shard's pool in the same step.
  """
  L = cache_length(state)
  logits, cache, emitted = _paged_forward(model, state, page_budget)
  logits = logits[:, 0].astype(jnp.float32)  # [B, V]
  tokens, logprobs = sampling.sample_with_logprobs(logits, step_keys(state.keys, state.steps))
  steps = state.steps + emitted
  lengths = state.lengths + emitted
  stopped, paused = stops(tokens, steps, lengths, state.budgets, L, eos_ids, pause_ids)
  finished = emitted & stopped
  state = state.replace(cache=pages_lib.release(cache, finished & ~paused), lengths=lengths,
                        tokens=jnp.where(emitted, tokens, state.tokens), steps=steps, active=state.active & ~finished)
  return state, StepOutput(tokens=tokens, logprobs=logprobs, emitted=emitted, logits=logits)


def decode_chunk(model: CausalLM, state: DecodeState, num_steps: int, stop_after_finished: jax.Array,
                 sampling: sampling_lib.SamplingMethod, eos_ids: jax.Array,
                 page_budget: int | None = None,
                 pause_ids: jax.Array | None = None) -> tuple[DecodeState, ChunkOutput]:
  """Up to `num_steps` decode steps in one device call (`lax.while_loop`); slots pause at `pause_ids` (`stops`).

  Stops early when no slot is active or once `stop_after_finished` slots have finished, so the host can refill
  them. Each step reads `page_budget` live (slot, page) pairs per shard (default: every page): the loop stops
  before a step would need more (an early return, never a wrong token), and after a step in which every active
  slot waited for a page (no progress: the host sees it and reports the pool too small). The cache is carried
  through the loop: each step writes its new rows in place, nothing is copied.
  """
  B = state.tokens.shape[0]
  Z = state.cache.shards
  J = (B // Z) * state.cache.page_table.shape[1] if page_budget is None else page_budget
  out = (jnp.zeros((B, num_steps), jnp.int32), jnp.zeros((B, num_steps), jnp.float32),
         jnp.zeros((B, num_steps), bool))  # tokens, logprobs, emitted [B, num_steps]

  def cond(carry):
    i, state, _, finished, moved, _ = carry
    fits = jnp.all(pages_lib.live_pages_needed(state.lengths, state.active, state.cache.page_size, Z) <= J) & moved
    return (i < num_steps) & jnp.any(state.active) & (finished < stop_after_finished) & fits

  def body(carry):
    i, state, (out_tokens, out_logprobs, out_emitted), finished, _, fewest = carry
    new_state, step = decode_step(model, state, sampling, eos_ids, page_budget=J, pause_ids=pause_ids)
    fewest = jnp.minimum(fewest, new_state.cache.free_count)
    column = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x[:, None], i, axis=1)
    out = (column(out_tokens, step.tokens), column(out_logprobs, step.logprobs), column(out_emitted, step.emitted))
    finished = finished + jnp.sum(state.active & ~new_state.active)
    return i + 1, new_state, out, finished, jnp.any(step.emitted), fewest

  init = (jnp.int32(0), state, out, jnp.int32(0), jnp.bool_(True), state.cache.free_count)
  _, state, (tokens, logprobs, emitted), _, _, fewest = jax.lax.while_loop(cond, body, init)
  return state, ChunkOutput(tokens=tokens, logprobs=logprobs, emitted=emitted, active=state.active,
                            lengths=state.lengths, free_pages=state.cache.free_count, fewest_free_pages=fewest)
