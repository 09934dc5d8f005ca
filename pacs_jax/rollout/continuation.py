"""Continuing a paused decode slot (a conversation's next turn): after a slot stops at a pause id (a tool-call
stop, `decode.stops`), the tokens inserted after it (an observation, template tokens) run through the model in one
chunk at the positions after the slot's KV prefix, attending to the prefix's pages (never running it again); their
keys and values go into the slot's pages and the slot samples on from the last one's logits. `Engine.continue_slots`
jits `continue_slots`; `pad_continuations` lays a call's requests out in its fixed shapes.

Shapes: B slots, Q requests one continue call puts into decode slots, T the bucket of inserted tokens (the forward's
query positions are T + 1: the pending token first), S key positions a query attends to (T + 1 + L), L cache rows
per slot, K kv heads, H head dim, A pages in the pool, M pages per slot, Z batch shards, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.models import paged
from pacs_jax.models.decoder import CausalLM
from pacs_jax.models.kv_cache import KVCache
from pacs_jax.rollout import decode as decode_lib
from pacs_jax.rollout import page_allocation as pages_lib
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout.budget import next_pow2
from pacs_jax.rollout.decode_state import ContinuedTokens, DecodeState, PagedCache


def grow_pages(cache: PagedCache, slots: jax.Array, held: jax.Array, extra: jax.Array
               ) -> tuple[PagedCache, jax.Array]:
  """Request q's slot slots[q] (< B; B: none), which holds held[q] pages, takes extra[q] more from its shard's
  stack into table columns held[q].., after the earlier requests on that shard. A request its shard has too few
  pages left for gets none (nor does any later one there that needs a page: the taken pages stay the top of the
  stack). Returns (cache, granted [Q] bool); a request that needs no page is granted."""
  Z, Az = cache.free_pages.shape
  B, M = cache.page_table.shape
  Q = slots.shape[0]
  shard = jnp.minimum(slots // (B // Z), Z - 1)  # [Q]
  q = jnp.arange(Q)
  earlier = (shard[:, None] == shard[None, :]) & (q[None, :] < q[:, None])  # [Q, Q]: request p before q, same shard
  before = jnp.sum(jnp.where(earlier, extra[None, :], 0), axis=1)  # [Q]
  free = cache.free_count[shard]  # [Q]
  granted = (before + extra <= free) | (extra == 0)
  j = jnp.arange(M)[None, :]  # [1, M]
  has = granted[:, None] & (j < extra[:, None]) & (slots[:, None] < B)  # [Q, M]
  top = jnp.clip(free[:, None] - 1 - before[:, None] - j, 0, Az - 1)
  page = jnp.take_along_axis(cache.free_pages[shard], top, axis=1)  # [Q, M]
  table = cache.page_table.at[jnp.where(has, slots[:, None], B), held[:, None] + j].set(page, mode="drop")
  taken = jnp.zeros((Z,), jnp.int32).at[shard].add(jnp.sum(has, axis=1, dtype=jnp.int32))
  return cache.replace(page_table=table, free_count=cache.free_count - taken), granted


def prefix_rows(cache: PagedCache, slots: jax.Array) -> KVCache:
  """Every cache row of slots [Q] (< B), read from their pages (rows past a slot's length hold junk), as a dense
  cache: k, v [layers, Q, K, L, H]."""
  Z, Az = cache.free_pages.shape
  B, M = cache.page_table.shape
  ids = cache.page_table[slots] + (slots // (B // Z) * Az)[:, None]  # [Q, M] pool-wide page ids
  kv = cache.pages[:, ids]  # [layers, Q, M, ps, 2K, H]
  kv = kv.reshape(kv.shape[0], slots.shape[0], M * cache.page_size, *kv.shape[-2:])  # [layers, Q, L, 2K, H]
  heads_first = lambda x: jnp.moveaxis(x, 3, 2)  # [layers, Q, L, K, H] -> [layers, Q, K, L, H]
  return KVCache(k=heads_first(kv[:, :, :, 0::2]), v=heads_first(kv[:, :, :, 1::2]))


def chunk_mask(rows: jax.Array, width: int, L: int) -> jax.Array:
  """The continuation's attention mask [Q, T + 1, S] over the dense rows [chunk (T + 1), prefix (L)]: chunk token i
  sees chunk tokens up to itself and the first rows[q] rows of its slot's prefix. width = T + 1."""
  i = jnp.arange(width)
  causal = jnp.broadcast_to(i[None, :, None] >= i[None, None, :], (rows.shape[0], width, width))
  prefix = jnp.broadcast_to(jnp.arange(L)[None, None, :] < rows[:, None, None], (rows.shape[0], width, L))
  return jnp.concatenate([causal, prefix], axis=2)


def chunk_forward(model: CausalLM, prefix: KVCache, rows: jax.Array, chunk: jax.Array, last: jax.Array
                  ) -> tuple[jax.Array, KVCache]:
  """The model over chunk [Q, T + 1] at positions rows[q].. after each slot's prefix (k, v [layers, Q, K, L, H]):
  (logits [Q, V] fp32 at chunk index last[q], the chunk's keys and values k, v [layers, Q, K, T + 1, H])."""
  Q, width = chunk.shape
  fresh = jnp.zeros(prefix.k.shape[:3] + (width,) + prefix.k.shape[4:], prefix.k.dtype)
  dense = KVCache(k=jnp.concatenate([fresh, prefix.k], axis=3), v=jnp.concatenate([fresh, prefix.v], axis=3))
  positions = rows[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [Q, T + 1]
  # `forward_with_cache` masks a dense cache by position (rows filled from 0); here the chunk's rows come first
  # (the layers write them at rows [0, T + 1)) and the prefix after, so the same layers get this mask instead.
  mask = chunk_mask(rows, width, prefix.rows)  # [Q, T + 1, S]
  hidden, dense = model.model._layers(chunk, positions, mask, dense)  # pylint: disable=protected-access
  at_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [Q, 1, D]
  own = KVCache(k=dense.k[:, :, :, :width], v=dense.v[:, :, :, :width])
  return model.logits(at_last)[:, 0].astype(jnp.float32), own


def write_chunk(cache: PagedCache, slots: jax.Array, rows: jax.Array, new: KVCache, write: jax.Array) -> jax.Array:
  """The pages with chunk row i of request q (new k, v [layers, Q, K, T + 1, H]) at cache row rows[q] + i of slot
  slots[q], where write [Q, T + 1] is True (one row-by-row scatter, like `page_allocation.insert`)."""
  Z, Az = cache.free_pages.shape
  B, M = cache.page_table.shape
  ps = cache.page_size
  position = rows[:, None] + jnp.arange(new.k.shape[3])[None, :]  # [Q, T + 1]
  page = cache.page_table[slots[:, None], jnp.minimum(position // ps, M - 1)] + (slots // (B // Z) * Az)[:, None]
  target = jnp.where(write, page, cache.pages.shape[1])  # [Q, T + 1]; A: dropped
  rows_last = lambda x: jnp.moveaxis(x, 2, 3)  # [layers, Q, K, T + 1, H] -> [layers, Q, T + 1, K, H]
  kv = paged.interleave_kv(rows_last(new.k), rows_last(new.v)).astype(cache.pages.dtype)  # [layers, Q, T + 1, 2K, H]
  return cache.pages.at[:, target, position % ps].set(kv, mode="drop")


def continue_slots(model: CausalLM, state: DecodeState, slots: jax.Array, tokens: jax.Array, lengths: jax.Array,
                   budgets: jax.Array, sampling: sampling_lib.SamplingMethod, eos_ids: jax.Array,
                   pause_ids: jax.Array) -> tuple[DecodeState, ContinuedTokens]:
  """Continues paused slots [Q] (distinct; >= B: padding) with inserted tokens [Q, T] (the first lengths[q] of
  row q) and samples each one's next token.

  Slot s's pending token (the pause id it stopped at, never fed) and its inserted tokens are fed at cache rows
  lengths_s.. (one chunk, `chunk_forward`); the slot takes the pages they need, its budget becomes budgets[q]
  (< 0: unchanged; counted in sampled tokens, like `steps`) and it samples with its own key at its step count, so
  its log-probs are those of one forward over the whole conversation. The new token stops or pauses the slot as in
  decode (`decode.stops`). A request is refused, its slot left exactly as it was (paused, holding its pages), when
  the slot is not paused (active, or its pages are gone), when the pending and inserted tokens do not fit in its
  L rows, or when its shard has too few free pages: `continued` says which went ahead. Other slots are untouched.
  """
  B, M = state.cache.page_table.shape
  ps = state.cache.page_size
  L = M * ps
  at = jnp.minimum(slots, B - 1)
  rows = state.lengths[at]  # [Q]: the pending token's row
  fed = lengths + 1  # [Q]: the pending token and the inserted ones
  held = -(-rows // ps)
  paused = (slots < B) & ~state.active[at] & (state.cache.page_table[at, 0] > 0)
  wanted = paused & (rows + fed <= L)
  cache, granted = grow_pages(state.cache, jnp.where(wanted, slots, B), held,
                              jnp.where(wanted, -(-(rows + fed) // ps) - held, 0))
  ok = wanted & granted
  chunk = jnp.concatenate([state.tokens[at][:, None], tokens], axis=1)  # [Q, T + 1]
  logits, new = chunk_forward(model, prefix_rows(state.cache, at), rows, chunk, lengths)
  write = ok[:, None] & (jnp.arange(chunk.shape[1])[None, :] < fed[:, None])  # [Q, T + 1]
  cache = cache.replace(pages=write_chunk(cache, at, rows, new, write))

  sampled, logprobs = sampling.sample_with_logprobs(logits, decode_lib.step_keys(state.keys[at], state.steps[at]))
  steps, filled = state.steps[at] + 1, rows + fed
  budgets = jnp.where(budgets < 0, state.budgets[at], budgets)
  stopped, pauses = decode_lib.stops(sampled, steps, filled, budgets, L, eos_ids, pause_ids)
  into = jnp.where(ok, slots, B)

  def put(buf, x):  # buf [B], x [Q]: the continued slots' new values
    return buf.at[into].set(x.astype(buf.dtype), mode="drop")

  state = state.replace(cache=pages_lib.release(cache, put(jnp.zeros_like(state.active), stopped & ~pauses)),
                        lengths=put(state.lengths, filled), tokens=put(state.tokens, sampled),
                        steps=put(state.steps, steps), budgets=put(state.budgets, budgets),
                        active=put(state.active, ~stopped))
  return state, ContinuedTokens(tokens=sampled, logprobs=logprobs, continued=ok, active=ok & ~stopped,
                                paused=ok & pauses, lengths=jnp.where(ok, filled, rows),
                                free_pages=state.cache.free_count)


def pad_continuations(engine, slots: Sequence[int], inserted: Sequence[Sequence[int]],
                      budgets: Sequence[int] | None = None):
  """One continue call's arguments for `engine` (an `Engine`): requests padded to a power of two (padding targets
  slot B), inserted tokens right-padded to the bucket of the longest. Returns (slots [Q], tokens [Q, T],
  lengths [Q], budgets [Q]) int32 arrays; budgets None: every slot keeps its own (-1)."""
  if len(inserted) != len(slots):
    raise ValueError(f"{len(inserted)} inserted token lists for {len(slots)} slots")
  Q = next_pow2(max(len(slots), 1))
  T = engine.continue_bucket_length(max((len(t) for t in inserted), default=0))
  column = lambda values, fill: np.array(list(values) + [fill] * (Q - len(slots)), np.int32)
  tokens = np.zeros((Q, T), np.int32)
  for q, row in enumerate(inserted):
    tokens[q, :len(row)] = row
  budgets = [-1] * len(slots) if budgets is None else budgets
  return (column(slots, engine.max_concurrent_decodes), tokens, column(map(len, inserted), 0),
          column(budgets, -1))
