"""The rollout engine's data: prefixes, the decode state (with a dense or a paged KV cache), step / chunk
results, completions, and the sharding each state field is declared with (logical axes, resolved on a mesh by
`field_shardings`)."""

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
  """A prefilled prompt (or a batch of them), ready to be inserted into decode slots."""
  cache: KVCache = _axes(kv_cache.CACHE_AXES)  # [layers, B, K, T, H]; rows >= lengths hold padding junk
  lengths: jax.Array = _axes(_PER_ROW)  # [B] int32: cache rows holding the prompt = position of `tokens`
  tokens: jax.Array = _axes(_PER_ROW)  # [B] int32: the next token to feed (first sampled, or last prompt token)
  logprobs: jax.Array = _axes(_PER_ROW)  # [B] fp32: log-prob of `tokens` (0 for a prompt token)
  keys: jax.Array = _axes(_KEY)  # [B, *key] uint32: each request's PRNG key data
  steps: jax.Array = _axes(_PER_ROW)  # [B] int32: tokens generated so far (`tokens` included when sampled)


@flax.struct.dataclass
class PagedCache:
  """The decode slots' KV cache in pages (see `models.paged`), with each batch shard's free-page stack.

  Slot s of S belongs to batch shard d = s // (S / D) and holds the pages its table row lists (shard-local
  indices; 0 = none: page 0 of a shard is its null page, never handed out). Shard d's free pages are
  free_pages[d, :free_count[d]], taken from the top.
  """
  pages: jax.Array = _axes(paged.PAGES_AXES)  # [layers, P, ps, 2K, H]
  page_table: jax.Array = _axes(("batch", None))  # [S, M] int32
  free_pages: jax.Array = _axes(("batch", None))  # [D, P / D] int32 stack of free shard-local pages
  free_count: jax.Array = _axes(_PER_ROW)  # [D] int32

  @property
  def page_size(self) -> int:
    return self.pages.shape[2]

  @property
  def shards(self) -> int:
    return self.free_count.shape[0]


@flax.struct.dataclass
class DecodeState:
  """Everything a decode step transforms, one row per slot."""
  # dense [layers, S, K, L, H], or paged (whose own fields declare their axes)
  cache: KVCache | PagedCache = _axes(kv_cache.CACHE_AXES)
  lengths: jax.Array = _axes(_PER_ROW)  # [S] int32: filled cache rows = position of the pending token
  tokens: jax.Array = _axes(_PER_ROW)  # [S] int32: pending token (last sampled), fed at the next step
  keys: jax.Array = _axes(_KEY)  # [S, *key] uint32: request keys; token t of a request uses fold_in(key, t)
  steps: jax.Array = _axes(_PER_ROW)  # [S] int32: tokens generated so far
  budgets: jax.Array = _axes(_PER_ROW)  # [S] int32: most tokens the slot's request may generate
  active: jax.Array = _axes(_PER_ROW)  # [S] bool: still generating


@flax.struct.dataclass
class StepOutput:
  """One decode step (`decode.decode_step`): every slot samples; only active slots emit."""
  tokens: jax.Array  # [S] int32 sampled
  logprobs: jax.Array  # [S] fp32 of `tokens`
  emitted: jax.Array  # [S] bool: the slot was active, so `tokens` belongs to its response
  logits: jax.Array  # [S, V] fp32 the step sampled from


@flax.struct.dataclass
class SlotTokens:
  """`Engine.step`'s host-readable result: each slot's newest token (what JetStream streams)."""
  tokens: jax.Array  # [S] int32
  valid: jax.Array  # [S] bool: the slot emitted `tokens`
  lengths: jax.Array  # [S] int32: tokens generated so far


@flax.struct.dataclass
class ChunkOutput:
  """Tokens of up to N decode steps in one call (`decode.decode_chunk`), and the slots afterwards."""
  tokens: jax.Array  # [S, N] int32
  logprobs: jax.Array  # [S, N] fp32
  emitted: jax.Array  # [S, N] bool: column n holds a response token of the slot
  active: jax.Array  # [S] bool: still generating after the call
  lengths: jax.Array  # [S] int32: filled cache rows after the call
  free_pages: jax.Array  # [D] int32: free pages of each batch shard's pool after the call ([0] if dense)
  fewest_free_pages: jax.Array  # [D] int32: the fewest after any step of the call ([0] if dense)


@flax.struct.dataclass
class FirstTokens:
  """First response tokens of requests inserted together (`Engine.insert_requests`)."""
  requests: tuple[int, ...] = flax.struct.field(pytree_node=False)  # the caller's request ids, one per token
  tokens: jax.Array  # [R] int32
  logprobs: jax.Array  # [R] fp32


@dataclasses.dataclass
class DecodeStats:
  """What a rollout's decode calls read and held (`scheduler.generate(stats=...)` adds to it)."""
  steps: int = 0  # decode steps (device loop iterations that emitted a token)
  rows_read: int = 0  # KV rows read, summed over steps and slots (per layer; the budget each call ran at)
  peak_rows_held: int = 0  # most KV rows held at once (paged: pages in use x page size; dense: every slot's)

  @property
  def rows_per_step(self) -> float:
    return self.rows_read / max(self.steps, 1)


@dataclasses.dataclass
class Completion:
  """One sampled response: its tokens (EOS included when it stopped there) and their log-probs."""
  prompt_index: int
  sample_index: int
  tokens: list[int]
  logprobs: np.ndarray  # [len(tokens)] fp32, log_softmax(logits / temperature) at each token
  finish_reason: str  # "eos" | "length"


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
