"""Page allocation for the decode state's paged KV cache (`decode_state.PagedCache`), on device and vectorised (no
per-slot loops): take pages for slots that start a new page, return a finished slot's pages, place inserted prompts'
rows in fresh pages, and the live-page count a decode step reads. The attention over pages is `models/paged.py`'s
(the TPU kernel `models/paged_kernel.py`'s). Shapes: B slots, Z batch shards (B / Z slots each), M pages per slot,
Q requests, T prompt bucket length, ps page size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pacs_jax.models import paged
from pacs_jax.models.kv_cache import KVCache
from pacs_jax.rollout.decode_state import PagedCache


def init(config, slots: int, cache_length: int, page_size: int, shards: int, pages_per_shard: int,
         dtype=None) -> PagedCache:
  """Empty pages and tables; each shard's stack holds pages 1..A/Z - 1 (page 0 is the null page), taken
  lowest first."""
  c = config
  M = -(-cache_length // page_size)
  pages = jnp.zeros((c.num_hidden_layers, shards * pages_per_shard, page_size, 2 * c.num_key_value_heads,
                     c.head_size), dtype or c.dtype)
  stack = jnp.broadcast_to(jnp.arange(pages_per_shard - 1, -1, -1, dtype=jnp.int32), (shards, pages_per_shard))
  return PagedCache(pages=pages, page_table=jnp.zeros((slots, M), jnp.int32), free_pages=stack,
                    free_count=jnp.full((shards,), pages_per_shard - 1, jnp.int32))


def take(cache: PagedCache, needs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One page for each slot with needs [B] True, from its shard's stack while pages last (lower slots
  first): (page [B] shard-local, granted [B] bool, free_count [Z] afterwards)."""
  Z, Az = cache.free_pages.shape
  n = needs.reshape(Z, -1)  # [Z, B/Z]
  rank = jnp.cumsum(n, axis=1) - 1
  granted = n & (rank < cache.free_count[:, None])
  top = jnp.clip(cache.free_count[:, None] - 1 - rank, 0, Az - 1)
  page = jnp.take_along_axis(cache.free_pages, top, axis=1)
  return page.reshape(-1), granted.reshape(-1), cache.free_count - jnp.sum(granted, axis=1, dtype=jnp.int32)


def release(cache: PagedCache, slots: jax.Array) -> PagedCache:
  """Pushes every page held by the slots marked in slots [B] bool back on their shards' stacks and clears
  their table rows (one scatter)."""
  Z, Az = cache.free_pages.shape
  held = cache.page_table.reshape(Z, -1)  # [Z, B/Z * M]
  give = (held > 0) & jnp.repeat(slots.reshape(Z, -1), cache.page_table.shape[1], axis=1)
  at = cache.free_count[:, None] + jnp.cumsum(give, axis=1) - 1
  free_pages = cache.free_pages.at[jnp.arange(Z)[:, None], jnp.where(give, at, Az)].set(held, mode="drop")
  return cache.replace(page_table=jnp.where(slots[:, None], 0, cache.page_table), free_pages=free_pages,
                       free_count=cache.free_count + jnp.sum(give, axis=1, dtype=jnp.int32))


def insert(cache: PagedCache, prefix: KVCache, lengths: jax.Array, slots: jax.Array,
           cache_rows: jax.Array | None = None) -> tuple[PagedCache, jax.Array]:
  """Gives request r (lengths [Q]; its rows are prefix row cache_rows[r] of [layers, prompts, K, T, H], None:
  row r) ceil(lengths[r] / ps) fresh pages of slot slots[r]'s shard and copies its first rows there (slots
  >= B: padding, dropped); the slots' old pages are returned first. A request its shard has no pages for is
  dropped too (the scheduler checks free counts first). Returns (cache, slots [Q] with dropped requests set
  to B).

  The rows are written one layer at a time in a loop over the donated pages: the program holds one layer
  of the requests' rows at once, never a [layers, Q, T] copy (78 GB per chip for qwen3b_v5p's 2,048).
  """
  Z, Az = cache.free_pages.shape
  B, M = cache.page_table.shape
  ps = cache.page_size
  layers, _, K, T, H = prefix.k.shape
  Q = lengths.shape[0]
  n_t = -(-T // ps)
  cache = release(cache, jnp.zeros((B,), bool).at[slots].set(True, mode="drop"))
  shard = slots // (B // Z)  # [Q]; Z for padding requests
  count = jnp.where(slots < B, -(-lengths // ps), 0)  # [Q]
  onehot = jax.nn.one_hot(shard, Z, dtype=jnp.int32) * count[:, None]  # [Q, Z]
  before = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * jax.nn.one_hot(shard, Z, dtype=jnp.int32), axis=1)
  free = cache.free_count[jnp.minimum(shard, Z - 1)]
  ok = (slots < B) & (before + count <= free)  # [Q]; per shard, the granted requests are a prefix
  j = jnp.arange(n_t)[None, :]  # [1, n_t]
  top = jnp.clip(free[:, None] - 1 - before[:, None] - j, 0, Az - 1)
  page = jnp.take_along_axis(cache.free_pages[jnp.minimum(shard, Z - 1)], top, axis=1)  # [Q, n_t]
  has = ok[:, None] & (j < count[:, None])
  page = jnp.where(has, page, 0)
  slots = jnp.where(ok, slots, B)
  rows = jnp.zeros((Q, M), jnp.int32).at[:, :n_t].set(page[:, :M])
  table = cache.page_table.at[slots].set(rows, mode="drop")
  taken = jnp.zeros((Z,), jnp.int32).at[shard].add(jnp.where(ok, count, 0), mode="drop")

  def blocks(x):  # [Q, K, T, H] -> [Q, n_t, ps, K, H]
    x = jnp.pad(x, ((0, 0), (0, 0), (0, n_t * ps - T), (0, 0)))
    return jnp.moveaxis(x.reshape(Q, K, n_t, ps, H), 1, 3)

  A = cache.pages.shape[1]
  target = jnp.where(has, page + (jnp.minimum(shard, Z - 1) * Az)[:, None], A)  # global page ids; A = none
  of_requests = (lambda x: x) if cache_rows is None else (lambda x: x[cache_rows])

  def write_layer(layer, pages):  # one layer's [Q, n_t, ps, 2K, H] rows into their pages
    k, v = (of_requests(lax.dynamic_index_in_dim(x, layer, keepdims=False)) for x in (prefix.k, prefix.v))
    kv = paged.interleave_kv(blocks(k), blocks(v)).astype(pages.dtype)
    # Row by row ([2K, H] slices, the pages' own tiles): a scatter of whole pages re-lays the pool out.
    return pages.at[layer, target[:, :, None], jnp.arange(ps)[None, None, :]].set(kv, mode="drop")

  pages = lax.fori_loop(0, layers, write_layer, cache.pages)
  return cache.replace(pages=pages, page_table=table, free_count=cache.free_count - taken), slots


def live_pages_needed(lengths: jax.Array, active: jax.Array, page_size: int, shards: int) -> jax.Array:
  """Live (slot, page) pairs per shard [Z] of the next step: an active slot reads its rows up to and with
  its pending token, any other slot one null row."""
  pairs = jnp.where(active, -(-(lengths + 1) // page_size), 1)
  return jnp.sum(pairs.reshape(shards, -1), axis=1)
