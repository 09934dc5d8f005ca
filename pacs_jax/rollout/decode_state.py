"""The rollout engine's data: prefixes (a prefill's dense `KVCache` of the prompts), the decode state (its paged
KV cache), step / chunk results, and the sharding each state field is declared with (logical axes,
resolved on a mesh by `field_shardings`).

Shapes: B slots (in a `Prefix`: prompts), Q requests, T prompt bucket length, K kv heads, H head dim, A pages in
the pool, ps page size, M pages per slot, Z batch shards, V vocab.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np
from jax.sharding import NamedSharding

from pacs_jax import sharding
from pacs_jax.models import kv_cache, paged
from pacs_jax.models.kv_cache import KVCache

# Logical axes of each field (sharding.ACTIVATION_RULES maps them to mesh axes): rows (prompts, slots)
# over the batch axes (data, fsdp), the cache's kv heads over tensor. A dimension the mesh does not
# divide stays replicated.
_PER_ROW = ("batch",)
_KEY = ("batch", None)  # [rows, *key]


def _axes(axes: tuple[str | None, ...]):
  return flax.struct.field(metadata={"axes": axes})


@flax.struct.dataclass
class Prefix:
  """Prefilled prompts (B of them) as Q requests, ready to be inserted into decode slots (Q = B, request r on
  prompt r, unless `insert_rows` is told each request's prompt row)."""
  cache: KVCache = _axes(kv_cache.CACHE_AXES)  # [layers, B, K, T, H]; rows >= lengths hold padding junk
  lengths: jax.Array = _axes(_PER_ROW)  # [Q] int32: cache rows holding the prompt = position of `tokens`
  tokens: jax.Array = _axes(_PER_ROW)  # [Q] int32: the next token to feed (first sampled, or last prompt token)
  logprobs: jax.Array = _axes(_PER_ROW)  # [Q] fp32: log-prob of `tokens` (0 for a prompt token)
  keys: jax.Array = _axes(_KEY)  # [Q, *key] uint32: each request's PRNG key data
  steps: jax.Array = _axes(_PER_ROW)  # [Q] int32: tokens generated so far (`tokens` included when sampled)


@flax.struct.dataclass
class PagedCache:
  """The decode slots' KV cache in pages (see `models.paged`), with each batch shard's free-page stack.

  Slot b of B belongs to batch shard z = b // (B / Z) and holds the pages its table row lists (shard-local
  indices; 0 = none: page 0 of a shard is its null page, never handed out). Shard z's free pages are
  free_pages[z, :free_count[z]], taken from the top.
  """
  pages: jax.Array = _axes(paged.PAGES_AXES)  # [layers, A, ps, 2K, H]
  page_table: jax.Array = _axes(("batch", None))  # [B, M] int32
  free_pages: jax.Array = _axes(("batch", None))  # [Z, A / Z] int32 stack of free shard-local pages
  free_count: jax.Array = _axes(_PER_ROW)  # [Z] int32

  @property
  def page_size(self) -> int:
    return self.pages.shape[2]

  @property
  def shards(self) -> int:
    return self.free_count.shape[0]


@flax.struct.dataclass
class DecodeState:
  """Everything a decode step transforms, one row per slot."""
  cache: PagedCache  # its own fields declare their axes
  lengths: jax.Array = _axes(_PER_ROW)  # [B] int32: filled cache rows = position of the pending token
  tokens: jax.Array = _axes(_PER_ROW)  # [B] int32: pending token (last sampled), fed at the next step
  keys: jax.Array = _axes(_KEY)  # [B, *key] uint32: request keys; token t of a request uses fold_in(key, t)
  steps: jax.Array = _axes(_PER_ROW)  # [B] int32: tokens generated so far
  budgets: jax.Array = _axes(_PER_ROW)  # [B] int32: most tokens the slot's request may generate
  active: jax.Array = _axes(_PER_ROW)  # [B] bool: still generating


@flax.struct.dataclass
class StepOutput:
  """One decode step (`decode.decode_step`): every slot samples; only active slots emit."""
  tokens: jax.Array  # [B] int32 sampled
  logprobs: jax.Array  # [B] fp32 of `tokens`
  emitted: jax.Array  # [B] bool: the slot was active, so `tokens` belongs to its response
  logits: jax.Array  # [B, V] fp32 the step sampled from


@flax.struct.dataclass
class SlotTokens:
  """`single.SingleRequest.step`'s host-readable result: each slot's newest token (what JetStream streams)."""
  tokens: jax.Array  # [B] int32
  valid: jax.Array  # [B] bool: the slot emitted `tokens`
  lengths: jax.Array  # [B] int32: tokens generated so far


@flax.struct.dataclass
class ChunkOutput:
  """Tokens of up to `steps` decode steps in one call (`decode.decode_chunk`), and the slots afterwards."""
  tokens: jax.Array  # [B, steps] int32
  logprobs: jax.Array  # [B, steps] fp32
  emitted: jax.Array  # [B, steps] bool: column i holds a response token of the slot
  active: jax.Array  # [B] bool: still generating after the call
  lengths: jax.Array  # [B] int32: filled cache rows after the call
  free_pages: jax.Array  # [Z] int32: free pages of each batch shard's pool after the call
  fewest_free_pages: jax.Array  # [Z] int32: the fewest after any step of the call


@flax.struct.dataclass
class FirstTokens:
  """First response tokens of requests inserted together (`Engine.insert_requests`)."""
  requests: tuple[int, ...] = flax.struct.field(pytree_node=False)  # the caller's request ids, one per token
  tokens: jax.Array  # [Q] int32
  logprobs: jax.Array  # [Q] fp32


@flax.struct.dataclass
class ContinuedTokens:
  """Continued slots' first tokens and the slots afterwards (`Engine.continue_slots`), one row per request."""
  tokens: jax.Array  # [Q] int32 sampled from the last inserted token's logits
  logprobs: jax.Array  # [Q] fp32 of `tokens`
  continued: jax.Array  # [Q] bool: False for a refused request (its slot is as it was) and for padding
  active: jax.Array  # [Q] bool: the slot goes on generating (decode feeds `tokens` next)
  paused: jax.Array  # [Q] bool: `tokens` is a pause id: the slot may be continued again
  lengths: jax.Array  # [Q] int32: the slot's filled cache rows afterwards
  free_pages: jax.Array  # [Z] int32: free pages of each batch shard's pool afterwards


@dataclasses.dataclass
class DecodeStats:
  """What a rollout's decode calls read and held (`scheduler.generate(stats=...)` adds to it)."""
  steps: int = 0  # decode steps (device loop iterations that emitted a token)
  rows_read: int = 0  # KV rows read, summed over steps and slots (per layer; the page budget each call ran at)
  peak_rows_held: int = 0  # most KV rows held at once (pages in use x page size)

  def add_call(self, rows: np.ndarray, busy: np.ndarray, steps: int, rows_per_step: int, rows_held: int) -> None:
    """Adds one decode call: it started with `rows` [B] filled rows in its slots (`busy` [B] bool), ran `steps`
    steps that read `rows_per_step` KV rows each, and held at most `rows_held` rows."""
    self.steps += steps
    self.rows_read += steps * rows_per_step
    self.peak_rows_held = max(self.peak_rows_held, rows_held)

  @property
  def rows_per_step(self) -> float:
    return self.rows_read / max(self.steps, 1)


def _named(mesh: jax.sharding.Mesh, axes, shape) -> NamedSharding:
  return NamedSharding(mesh, sharding.spec_for(axes, sharding.ACTIVATION_RULES, dict(mesh.shape), shape))


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh) -> KVCache:
  """Shardings of a KV cache [layers, B, K, rows, H] (arrays or shapes): rows of the batch over the
  batch axes, kv heads over tensor."""
  return jax.tree.map(lambda x: _named(mesh, kv_cache.CACHE_AXES, x.shape), cache)


def field_shardings(tree: Prefix | DecodeState | PagedCache, mesh: jax.sharding.Mesh):
  """The same dataclass with a NamedSharding per array, from each field's declared logical axes."""
  def of(field: dataclasses.Field):
    if isinstance(getattr(tree, field.name), PagedCache):  # its own fields declare their axes
      return field_shardings(getattr(tree, field.name), mesh)
    axes = field.metadata["axes"]
    return jax.tree.map(lambda x: _named(mesh, axes, x.shape), getattr(tree, field.name))

  return tree.replace(**{f.name: of(f) for f in dataclasses.fields(tree)})
