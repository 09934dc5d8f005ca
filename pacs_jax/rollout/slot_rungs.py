"""The slot ladder of paged decode: decode programs over fewer slots than the engine has, for continuous
batching's tail. Once the queue is empty the busy slots thin out, yet a decode step over all B slots still pays the
whole batch's matmuls and sampling outside the attention kernel; a rung of b < B slots gathers the busy ones (and
idle ones to fill it) into a decode state of b rows, decodes it, and scatters it back. Pages stay where they are:
only the slots' small per-row fields (page-table rows, lengths, tokens, keys) move.

Shapes: B slots, Z batch shards (B / Z slots each), b slots of a rung (b / Z per shard), M pages per slot.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pacs_jax.rollout.decode_state import ChunkOutput, DecodeState


def ladder(slots: int, shards: int, rungs: int) -> tuple[int, ...]:
  """The slot counts decode programs are compiled for, ascending: B, B/2, B/4, ... (`rungs` of them at most), each
  a multiple of the Z shards (at least one slot a shard). rungs=1: B alone (no ladder)."""
  out, b = [], slots
  while len(out) < max(1, rungs) and b >= shards and b % shards == 0:
    out.append(b)
    if b % 2 or (b // 2) % shards:
      break
    b //= 2
  return tuple(sorted(out))


def per_shard_busy(busy: np.ndarray, shards: int) -> int:
  """The most busy slots on any batch shard (busy [B] bool)."""
  return int(np.asarray(busy, bool).reshape(shards, -1).sum(axis=1).max())


def choose(busy: np.ndarray, shards: int, rungs: tuple[int, ...]) -> int:
  """The smallest rung whose slots per shard hold every shard's busy slots (busy [B] bool)."""
  need = per_shard_busy(busy, shards)
  return next((b for b in rungs if b // shards >= need), rungs[-1])


def slot_index(busy: np.ndarray, shards: int, rung: int) -> np.ndarray:
  """index [b] int32: the slots of a rung of b, shard by shard (rung row r is slot index[r], on shard r // (b/Z),
  the shard that slot lives on): each shard's busy slots in order, then its first idle ones to fill the rung."""
  busy = np.asarray(busy, bool).reshape(shards, -1)
  per_shard, width = busy.shape[1], rung // shards
  rows = []
  for z in range(shards):
    order = np.concatenate([np.flatnonzero(busy[z]), np.flatnonzero(~busy[z])])[:width]
    if busy[z].sum() > width:
      raise ValueError(f"shard {z} has {int(busy[z].sum())} busy slots, more than the rung's {width} a shard")
    rows.append(z * per_shard + order)
  return np.concatenate(rows).astype(np.int32)


def gather(state: DecodeState, index) -> DecodeState:
  """The decode state of the rung's slots index [b] (their per-slot rows; the page pool and free lists shared)."""
  return state.replace(cache=state.cache.replace(page_table=state.cache.page_table[index]),
                       lengths=state.lengths[index], tokens=state.tokens[index], keys=state.keys[index],
                       steps=state.steps[index], budgets=state.budgets[index], active=state.active[index])


def scatter(state: DecodeState, rung_state: DecodeState, index) -> DecodeState:
  """`state` with the rung's rows written back to slots index [b] (and the rung's pages and free lists)."""
  put = lambda full, rows: full.at[index].set(rows)
  cache = rung_state.cache.replace(page_table=put(state.cache.page_table, rung_state.cache.page_table))
  return state.replace(cache=cache, lengths=put(state.lengths, rung_state.lengths),
                       tokens=put(state.tokens, rung_state.tokens), keys=put(state.keys, rung_state.keys),
                       steps=put(state.steps, rung_state.steps), budgets=put(state.budgets, rung_state.budgets),
                       active=put(state.active, rung_state.active))


def widen(out: ChunkOutput, state: DecodeState, index) -> ChunkOutput:
  """The rung's chunk output [b, steps] as the engine's [B, steps]: slots outside the rung emitted nothing; `state`
  is the whole decode state after the call (`scatter`'s)."""
  B = state.tokens.shape[0]
  put = lambda rows: jnp.zeros((B,) + rows.shape[1:], rows.dtype).at[index].set(rows)
  return out.replace(tokens=put(out.tokens), logprobs=put(out.logprobs), emitted=put(out.emitted),
                     active=state.active, lengths=state.lengths)
