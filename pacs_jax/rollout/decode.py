"""Pure decode maths on a merged model: request keys, prefill, first-token sampling, slot insertion,
one decode step and a chunk of them in one `lax.while_loop`, on a dense or a paged KV cache. The `Engine`
jits them with params as an argument. Shapes: S slots, L cache rows per slot, B prompts, T bucket length,
R requests, V vocab, D batch shards, M pages per slot."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.models import kv_cache, paged
from pacs_jax.models.decoder import CausalLM
from pacs_jax.models.kv_cache import KVCache
from pacs_jax.rollout import pages as pages_lib
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout.state import ChunkOutput, DecodeState, PagedCache, Prefix, StepOutput


def request_keys(seed: jax.Array, prompt_index: jax.Array, sample_index: jax.Array) -> jax.Array:
  """Key data [R, *key] of requests (prompt_index [R], sample_index [R]): independent of slot and order."""
  base = jax.random.key(seed)
  one = lambda p, s: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(base, p), s))
  return jax.vmap(one)(prompt_index, sample_index)


def step_keys(key_data: jax.Array, steps: jax.Array) -> jax.Array:
  """Keys [R] of token `steps` [R] of requests with key data [R, *key]."""
  return jax.vmap(lambda k, t: jax.random.fold_in(jax.random.wrap_key_data(k), t))(key_data, steps)


def eos_array(eos_ids: Sequence[int]) -> np.ndarray:
  """EOS ids as an int32 array padded with -1 to a multiple of 4: a traced argument, so changing the
  ids (up to 4 of them) does not recompile."""
  eos = sorted({int(e) for e in eos_ids})
  size = max(4, -(-len(eos) // 4) * 4)
  return np.array(eos + [-1] * (size - len(eos)), np.int32)


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  """tokens [R] -> [R] bool; the -1 padding of `eos_array` never matches a token."""
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
  """First response token (key step 0) of requests from their prompts' last logits [R, V]:
  (tokens [R] int32, log-probs [R] fp32)."""
  keys = step_keys(key_data, jnp.zeros(key_data.shape[:1], jnp.int32))
  return sampling.sample_with_logprobs(logits, keys)


def prefix_of_requests(cache: KVCache, logits: jax.Array, true_lengths: jax.Array, rows: jax.Array,
                       key_data: jax.Array, sampling: sampling_lib.SamplingMethod,
                       gather_cache: bool = True) -> Prefix:
  """R requests from B prefilled prompts (cache [layers, B, K, T, H], logits [B, V], true_lengths [B]):
  request r continues prompt `rows[r]` with its first token sampled from key data `key_data[r]`. Without
  `gather_cache` the prefix keeps the prompts' cache ([layers, B, ...], not one copy per request): pass
  `rows` on to `insert_rows`, which reads each request's rows one layer at a time."""
  first, logprobs = sample_first(logits[rows], key_data, sampling)
  if gather_cache:
    cache = KVCache(k=cache.k[:, rows], v=cache.v[:, rows])
  return Prefix(cache=cache, lengths=true_lengths[rows], tokens=first, logprobs=logprobs, keys=key_data,
                steps=jnp.ones_like(rows))


def insert_rows(state: DecodeState, prefix: Prefix, slots: jax.Array, budgets: jax.Array,
                eos_ids: jax.Array, cache_rows: jax.Array | None = None) -> DecodeState:
  """Writes prefix rows [R] into decode slots [R]; a slot index >= S is a padding row and is dropped.
  `cache_rows` [R]: request r's rows are prefix.cache's row cache_rows[r] (a prefix of the prompts, see
  `prefix_of_requests`); None: row r.

  A paged cache gives each request the pages its prompt rows fill (a request its shard has no pages for
  is dropped; the scheduler checks first) and takes them back at once from a request that is already done.
  """
  L = cache_length(state)
  T = prefix.cache.rows
  if isinstance(state.cache, PagedCache):
    cache, slots = pages_lib.insert(state.cache, prefix.cache, prefix.lengths, slots, cache_rows)
  else:  # only the slots' first T rows of every layer are written (in place: the decode state is donated)
    rows_of = (lambda x: x) if cache_rows is None else (lambda x: x[:, cache_rows])
    put_rows = lambda buf, rows: buf.at[:, slots, :, :T].set(rows_of(rows).astype(buf.dtype), mode="drop")
    cache = KVCache(k=put_rows(state.cache.k, prefix.cache.k), v=put_rows(state.cache.v, prefix.cache.v))

  def put(buf, rows):  # buf [S, ...], rows [R, ...]
    return buf.at[slots].set(rows.astype(buf.dtype), mode="drop")

  sampled = prefix.steps > 0
  done = (sampled & is_eos(prefix.tokens, eos_ids)) | (prefix.steps >= budgets) | (prefix.lengths >= L)
  state = DecodeState(cache=cache, lengths=put(state.lengths, prefix.lengths), tokens=put(state.tokens, prefix.tokens),
                      keys=put(state.keys, prefix.keys), steps=put(state.steps, prefix.steps),
                      budgets=put(state.budgets, budgets), active=put(state.active, ~done))
  if isinstance(cache, PagedCache):
    state = state.replace(cache=pages_lib.release(cache, put(jnp.zeros_like(state.active), done)))
  return state


def cache_length(state: DecodeState) -> int:
  """L: cache rows a slot can hold."""
  if isinstance(state.cache, PagedCache):
    return state.cache.page_table.shape[1] * state.cache.page_size
  return state.cache.rows


def _paged_forward(model: CausalLM, state: DecodeState, live_pages: int | None):
  """The paged cache's step: a page for each active slot whose pending token starts a new page (a slot
  its shard has none for waits: it does not step), then the forward. Returns (logits [S, 1, V], cache,
  stepped [S] bool)."""
  cache = state.cache
  S, M = cache.page_table.shape
  ps, D = cache.page_size, cache.shards
  needs = state.active & (state.lengths % ps == 0)  # the slot holds ceil(lengths / ps) pages
  page, granted, free_count = pages_lib.take(cache, needs)
  table = cache.page_table.at[jnp.arange(S), jnp.where(granted, state.lengths // ps, M)].set(page, mode="drop")
  stepped = state.active & (~needs | granted)
  # Slots that do not step attend to one row of their shard's null page and write there.
  position = jnp.where(stepped, state.lengths, 0)  # [S]
  step = paged.PagedStep(pages=cache.pages, page_table=jnp.where(stepped[:, None], table, 0), positions=position,
                         kv_lens=position + 1, live_pages=(S // D) * M if live_pages is None else live_pages,
                         shards=D)
  logits, step = model.forward_with_cache(state.tokens[:, None], position[:, None], step)
  return logits, cache.replace(pages=step.pages, page_table=table, free_count=free_count), stepped


def decode_step(model: CausalLM, state: DecodeState, sampling: sampling_lib.SamplingMethod,
                eos_ids: jax.Array, window: int | None = None) -> tuple[DecodeState, StepOutput]:
  """Feeds every slot's pending token and samples the next one; only active slots emit and advance.

  A slot stops at an EOS id, at its budget, or when its cache is full. On a dense cache attention reads
  the first `window` cache rows (default: all); every active slot's position must be below it. On a paged
  cache `window` is the live-page budget per shard (default: every page; see `pages.live_pages_needed`),
  an active slot that gets no page waits (emits nothing, does not advance), and a finished slot's pages
  go back to its shard's pool in the same step.
  """
  L = cache_length(state)
  if isinstance(state.cache, PagedCache):
    logits, cache, emitted = _paged_forward(model, state, window)
  else:
    W = L if window is None else window
    # Finished slots may sit at L; clamp so their (ignored) write stays inside the window.
    position = jnp.minimum(state.lengths, W - 1)  # [S]
    logits, cache = model.forward_with_cache(state.tokens[:, None], position[:, None], state.cache, position, W)
    emitted = state.active
  logits = logits[:, 0].astype(jnp.float32)  # [S, V]
  tokens, logprobs = sampling.sample_with_logprobs(logits, step_keys(state.keys, state.steps))
  steps = state.steps + emitted
  lengths = state.lengths + emitted
  finished = emitted & (is_eos(tokens, eos_ids) | (steps >= state.budgets) | (lengths >= L))
  if isinstance(cache, PagedCache):
    cache = pages_lib.release(cache, finished)
  state = state.replace(cache=cache, lengths=lengths, tokens=jnp.where(emitted, tokens, state.tokens),
                        steps=steps, active=state.active & ~finished)
  return state, StepOutput(tokens=tokens, logprobs=logprobs, emitted=emitted, logits=logits)


def decode_chunk(model: CausalLM, state: DecodeState, num_steps: int, stop_after_finished: jax.Array,
                 sampling: sampling_lib.SamplingMethod, eos_ids: jax.Array,
                 window: int | None = None) -> tuple[DecodeState, ChunkOutput]:
  """Up to `num_steps` decode steps in one device call (`lax.while_loop`).

  Stops early when no slot is active or once `stop_after_finished` slots have finished, so the host
  can refill them. With a `window` W < L, the steps attend over (and write) only the first W cache rows:
  each step reads W rows per slot instead of L. The loop then also stops before any active slot would
  need row W, so a window chosen too small costs an early return, never a wrong token. The cache stays
  whole and is carried through the loop: each step writes its new rows in place, nothing is copied.
  On a paged cache `window` is the live-page budget per shard: the loop stops before a step would need
  more (an early return, never a wrong token), and after a step in which every active slot waited for a
  page (no progress: the host sees it and reports the pool too small).
  """
  S = state.tokens.shape[0]
  L = cache_length(state)
  is_paged = isinstance(state.cache, PagedCache)
  if is_paged:
    D = state.cache.shards
    W = (S // D) * state.cache.page_table.shape[1] if window is None else window
  else:
    W = L if window is None else min(window, L)
  out = (jnp.zeros((S, num_steps), jnp.int32), jnp.zeros((S, num_steps), jnp.float32),
         jnp.zeros((S, num_steps), bool))  # tokens, logprobs, emitted [S, num_steps]

  def cond(carry):
    i, state, _, finished, moved, _ = carry
    if is_paged:
      fits = jnp.all(pages_lib.live_pages_needed(state.lengths, state.active, state.cache.page_size, D) <= W) & moved
    else:
      fits = jnp.all(~state.active | (state.lengths < W))  # always true when W == L
    return (i < num_steps) & jnp.any(state.active) & (finished < stop_after_finished) & fits

  def body(carry):
    i, state, (out_tokens, out_logprobs, out_emitted), finished, _, fewest = carry
    new_state, step = decode_step(model, state, sampling, eos_ids, window=W)
    if is_paged:
      fewest = jnp.minimum(fewest, new_state.cache.free_count)
    column = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x[:, None], i, axis=1)
    out = (column(out_tokens, step.tokens), column(out_logprobs, step.logprobs), column(out_emitted, step.emitted))
    finished = finished + jnp.sum(state.active & ~new_state.active)
    return i + 1, new_state, out, finished, jnp.any(step.emitted), fewest

  free = state.cache.free_count if is_paged else jnp.zeros((0,), jnp.int32)
  init = (jnp.int32(0), state, out, jnp.int32(0), jnp.bool_(True), free)
  _, state, (tokens, logprobs, emitted), _, _, fewest = jax.lax.while_loop(cond, body, init)
  free = state.cache.free_count if is_paged else free
  return state, ChunkOutput(tokens=tokens, logprobs=logprobs, emitted=emitted, active=state.active,
                            lengths=state.lengths, free_pages=free, fewest_free_pages=fewest)
