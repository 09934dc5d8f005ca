"""Paged-attention maths of one decode step (no allocation): writing a step's keys and values into pages and
attending over each slot's live pages (the XLA path); `rollout/page_allocation.py` hands pages out, `paged_kernel.py` is
the TPU kernel. Pages are [layers, A, ps, 2K, H] (k head i at 2i, v head i at 2i + 1, the layout of jax's Pallas
TPU ragged paged attention), addressed through per-slot page tables.

Shapes: B slots, A pages, ps page size, M pages per slot (table width), N query heads, K kv heads, G = N // K,
H head dim. Page indices in a page table are local to the slot's batch shard; page 0 of each shard is a null
page that is never handed out (idle slots point at it and their ignored writes land there).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pacs_jax.models import flash, paged_kernel
from pacs_jax.models.attention import _MASK_VALUE

# Logical axes (see `pacs_jax.sharding`): pages and page tables over the batch axes, kv heads over tensor.
PAGES_AXES = ("layers", "batch", None, "kv_heads", None)


@flax.struct.dataclass
class PagedStep:
  """What one decode step's attention needs from the paged cache (the model's `cache` argument)."""
  pages: jax.Array  # [layers, A, ps, 2K, H]
  page_table: jax.Array  # [B, M] int32, shard-local page indices; rows of slots that do not step are 0
  positions: jax.Array  # [B] int32: cache row each slot's new key/value is written to
  kv_lens: jax.Array  # [B] int32 >= 1: rows each slot attends to, the new one included
  page_budget: int = flax.struct.field(pytree_node=False)  # J: static budget of (slot, page) pairs per shard
  shards: int = flax.struct.field(pytree_node=False)  # Z batch shards: slot s uses shard s // (B / Z)'s pool


def decode_kernel(config, platform: str, tensor: int = 1) -> bool:
  """Whether paged decode attends with the TPU Pallas kernel (`paged_kernel`): on TPU where training uses
  splash, unless the kernel cannot take the shapes (then the XLA path, or an error if splash was asked
  for). Elsewhere (splash in interpret mode on CPU) decode takes the XLA path. `config`: a `ModelConfig`."""
  if flash.resolve(config.attention_impl, platform) != "splash" or platform != "tpu":
    return False
  K = config.num_key_value_heads
  local = K // tensor if K % tensor == 0 else K
  why = paged_kernel.kernel_unsupported(config.head_size, 2 * local, config.dtype)
  if why and config.attention_impl == "splash":
    raise ValueError(f"model.attention_impl='splash': the TPU paged decode kernel cannot run this model: {why}")
  return why is None


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
  """k, v [..., K, H] -> [..., 2K, H] with k head i at 2i and v head i at 2i + 1."""
  return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def write_pages(pages: jax.Array, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array,
                positions: jax.Array, layer: jax.Array | None = None) -> jax.Array:
  """Writes each slot's new key and value k_new, v_new [B, K, H] to cache row positions[s] of its pages.

  pages [A, ps, 2K, H] (or every layer's, [layers, A, ps, 2K, H], written at `layer`). One scatter over
  slots, no per-slot loop: the donated, loop-carried pages are updated in place.
  """
  B = k_new.shape[0]
  ps = pages.shape[-3]
  page = page_table[jnp.arange(B), positions // ps]  # [B]
  row = positions % ps  # [B]
  kv = interleave_kv(k_new, v_new).astype(pages.dtype)  # [B, 2K, H]
  if layer is None:
    return pages.at[page, row].set(kv)
  return pages.at[layer, page, row].set(kv)


def live_pairs(kv_lens: jax.Array, page_size: int, budget: int):
  """The (slot, page) pairs a step reads, padded to `budget`: slot [J], page number within the slot [J],
  valid [J] (J = budget). Slot s has ceil(kv_lens[s] / ps) live pages."""
  B = kv_lens.shape[0]
  count = -(-kv_lens // page_size)  # [B]
  end = jnp.cumsum(count)  # [B]
  j = jnp.arange(budget, dtype=jnp.int32)
  # The slot whose pages pair j falls in: slots ending at or before j (compared all at once, no search loop).
  slot = jnp.minimum(jnp.sum(end[None, :] <= j[:, None], axis=1, dtype=jnp.int32), B - 1)  # [J]
  page = j - (end[slot] - count[slot])
  return slot, page, j < end[-1]


def ragged_decode_attention(q: jax.Array, pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array,
                            page_budget: int, layer: jax.Array | None = None) -> jax.Array:
  """Decode attention over each slot's own live pages: q [B, N, H] -> [B, N, H].

  pages [A, ps, 2K, H] (or [layers, A, ps, 2K, H] read at `layer`); slot s attends to its first kv_lens[s]
  rows (>= 1). Only the live (slot, page) pairs are gathered, padded to the static `page_budget`; scores are
  taken per page and the softmax spans each slot's pages (segment max and sum), so a step reads the live
  rows rounded up to pages and to the budget, not B x the longest row. Query head n uses kv head n // G.
  """
  B, N, H = q.shape
  ps, K2 = pages.shape[-3], pages.shape[-2]
  K, M = K2 // 2, page_table.shape[1]
  slot, page, valid = live_pairs(kv_lens, ps, page_budget)  # [J]
  page_id = jnp.where(valid, page_table[slot, jnp.minimum(page, M - 1)], 0)  # [J]
  # Row by row ([2K, H] slices, the pages' own tiles on TPU): a gather of whole [ps, 2K, H] pages makes XLA
  # re-lay every page out first.
  rows = jnp.arange(ps)[None, :]
  kv = pages[page_id[:, None], rows] if layer is None else pages[layer, page_id[:, None], rows]  # [J, ps, 2K, H]
  k, v = kv[:, :, 0::2], kv[:, :, 1::2]  # [J, ps, K, H]
  qj = q[slot].reshape(page_budget, K, N // K, H)  # [J, K, G, H]
  scores = jnp.einsum("JKGH,JSKH->JKGS", qj, k.astype(q.dtype), preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(H).astype(jnp.float32)
  row = page[:, None] * ps + jnp.arange(ps)[None, :]  # [J, ps]
  live = valid[:, None] & (row < kv_lens[slot][:, None])  # [J, ps]
  scores = jnp.where(live[:, None, None, :], scores, _MASK_VALUE)
  segment = jnp.where(valid, slot, B)  # padding pairs go to a dropped segment B
  peak = jax.ops.segment_max(jnp.max(scores, axis=-1), segment, num_segments=B + 1)  # [B + 1, K, G]
  probs = jnp.where(live[:, None, None, :], jnp.exp(scores - peak[segment][..., None]), 0.0)  # [J, K, G, ps]
  total = jax.ops.segment_sum(jnp.sum(probs, axis=-1), segment, num_segments=B + 1)[:B]  # [B, K, G]
  out = jnp.einsum("JKGS,JSKH->JKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = jax.ops.segment_sum(out, segment, num_segments=B + 1)[:B] / total[..., None]  # [B, K, G, H]
  return out.reshape(B, N, H).astype(q.dtype)


def paged_layer(step: PagedStep, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                kernel: bool = False) -> tuple[jax.Array, PagedStep]:
  """One layer of a decode step on the paged cache: writes k, v [B, K, H] at `positions`, then attends
  q [B, N, H] over the live pages -> (out [B, N, H], step with the new pages).

  The single place decode touches pages. Under a mesh it runs per shard (`paged_kernel.on_shards`): each
  batch shard's slots, page pool and pool-local page tables, its kv heads; nothing crosses shards. The
  attention is the TPU Pallas kernel with `kernel`, else the XLA gather over live pages.
  """
  B, K = k.shape[:2]
  if step.shards > 1 and not paged_kernel.sharded():
    raise ValueError(f"{step.shards} page pools need the mesh they are split over (jax.set_mesh)")

  def per_shard(pages, table, positions, kv_lens, layer, q, k, v):
    pages = write_pages(pages, k, v, table, positions, layer)
    if kernel:  # every layer's pages as one pool [layers * A, ps, 2K, H] (a free reshape), layer l's at l * A
      n_layers, A = pages.shape[:2]
      out = paged_kernel.pallas_decode_attention(q, pages.reshape(n_layers * A, *pages.shape[2:]), table + layer * A,
                                                 kv_lens)
    else:
      out = ragged_decode_attention(q, pages, table, kv_lens, step.page_budget, layer)
    return out, pages

  slot, new_kv = paged_kernel.SLOT_AXES, paged_kernel.NEW_KV_AXES
  axes = (PAGES_AXES, slot + (None,), slot, slot, (), paged_kernel.QUERY_AXES, new_kv, new_kv)
  args = (step.pages, step.page_table, step.positions, step.kv_lens, layer, q, k, v)
  out, pages = paged_kernel.on_shards(per_shard, args, axes, (paged_kernel.QUERY_AXES, PAGES_AXES), slots=B,
                                      kv_heads=K)
  return out, step.replace(pages=pages)
