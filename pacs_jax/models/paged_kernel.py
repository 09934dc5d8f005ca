"""The TPU Pallas kernel for paged decode attention (jax's ragged paged attention), and the per-shard dispatch that
runs a paged-cache function on each batch / tensor shard under `jax.shard_map`; the XLA path and the page writes are
`paged.py`'s, page allocation `rollout/page_allocation.py`'s.

Shapes: B slots, N query heads, K kv heads, H head dim, A pages, ps page size, M pages per slot.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pacs_jax import sharding


def kernel_unsupported(head_dim: int, combined_kv_heads: int, dtype) -> str | None:
  """Why the TPU kernel cannot take these shapes (None: it can). `combined_kv_heads` is 2K per shard."""
  if head_dim % 128:
    return f"head_dim {head_dim} is not a multiple of 128 (the TPU lane width the kernel's tiles need)"
  packing = 4 // jnp.dtype(dtype).itemsize  # values per 32-bit word
  heads = combined_kv_heads // packing if combined_kv_heads % packing == 0 else 0
  if not (heads in (1, 2, 4, 8) or (heads and heads % 8 == 0)):
    return f"{combined_kv_heads // 2} kv heads per shard in {jnp.dtype(dtype).name} do not tile the kernel's blocks"
  return None


def pallas_decode_attention(q: jax.Array, pages: jax.Array, page_table: jax.Array, kv_lens: jax.Array, *,
                            num_kv_pages_per_block: int | None = None,
                            num_queries_per_block: int | None = None) -> jax.Array:
  """One query per slot over its own pages: q [B, N, H]; pages [A, ps, 2K, H] (k head i at 2i, v head i at
  2i + 1); page_table [B, M] int32; kv_lens [B] int32 >= 1 (rows each slot attends to, its new row
  included) -> [B, N, H]. Query head n reads kv head n // (N / K), as transformers' grouped attention.

  The kernel walks each slot's first ceil(kv_lens / ps) pages only: a step reads the rows in flight.
  Block sizes default to the kernel's tuned table on a TPU host; compiling ahead of time elsewhere (the
  table looks up the host's device), to 1,024 KV rows and 32 queries per block, which fit the default
  16 MiB of scoped VMEM (the kernel's untuned 128 pages do not at 64-row pages: 19 MiB for Qwen2.5-7B).
  """
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

  B, _, H = q.shape
  if jax.devices()[0].platform != "tpu":
    num_kv_pages_per_block = num_kv_pages_per_block or min(page_table.shape[1], max(1, 1024 // pages.shape[1]))
    num_queries_per_block = num_queries_per_block or min(B, 32)
  cu_q_lens = jnp.arange(B + 1, dtype=jnp.int32)  # one query token per slot
  num_seqs = jnp.array([B], jnp.int32)
  # 16-bit tiles: products are exact in the fp32 accumulator at any precision, and Mosaic refuses a
  # "highest" (fp32) contraction of bf16 operands, so a global "highest" setting is not passed on.
  precision = jax.default_matmul_precision("default") if q.dtype != jnp.float32 else contextlib.nullcontext()
  with precision:
    return rpa.ragged_paged_attention(q, pages, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
                                      cu_q_lens, num_seqs, sm_scale=H ** -0.5,
                                      num_kv_pages_per_block=num_kv_pages_per_block,
                                      num_queries_per_block=num_queries_per_block)


# Logical axes of the paged-cache arrays a per-shard function takes: slots and pages over the batch axes,
# heads over tensor (sharding.ACTIVATION_RULES).
SLOT_AXES = ("batch",)  # [B, ...]
QUERY_AXES = ("batch", "heads", None)  # q [B, N, H]
NEW_KV_AXES = ("batch", "kv_heads", None)  # new k or v [B, K, H]
PAGE_AXES = ("batch", None, "kv_heads", None)  # one layer's pages [A, ps, 2K, H]


def batch_shards(mesh_shape: dict[str, int], slots: int) -> int:
  """Z, the number of page pools: the mesh's batch shards when they divide the slots, else 1. Slot s
  takes pages from pool s // (B / Z) only; the pages array holds the Z pools one after another."""
  d = math.prod(mesh_shape.get(a, 1) for a in sharding.BATCH_AXES)
  return d if slots % d == 0 else 1


def shard_specs(mesh_shape: dict[str, int], *, slots: int, kv_heads: int,
                axes: Sequence[tuple[str | None, ...]]) -> tuple[PartitionSpec, ...]:
  """PartitionSpecs for arrays with logical `axes`: "batch" dimensions (slots, pages) over the batch axes
  when there are `batch_shards` > 1 pools, heads over tensor when it divides the kv heads; else replicated."""
  batch = tuple(a for a in sharding.BATCH_AXES if mesh_shape.get(a, 1) > 1)
  batch = batch if batch_shards(mesh_shape, slots) > 1 else ()
  tensor = "tensor" if mesh_shape.get("tensor", 1) > 1 and kv_heads % mesh_shape["tensor"] == 0 else None
  rule = {"batch": (batch[0] if len(batch) == 1 else batch) if batch else None, "heads": tensor,
          "kv_heads": tensor, "layers": None, None: None}
  return tuple(PartitionSpec(*(rule[a] for a in spec)) for spec in axes)


def sharded() -> bool:
  """Whether the current mesh (`jax.set_mesh`) has more than one device: `on_shards` then splits."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and math.prod(mesh.shape.values()) > 1


def on_shards(fn: Callable, args: Sequence[jax.Array], axes: Sequence[tuple[str | None, ...]],
              out_axes, *, slots: int, kv_heads: int):
  """`fn(*args)` on each shard of the current mesh (`jax.set_mesh`), or once without one.

  A paged-cache function sees one shard's slots, its page pool and page tables with pool-local indices,
  and its kv heads: what a kernel (`pallas_call` does not partition itself) and a gather over local pages
  need, with no cross-shard traffic. `out_axes`: the logical axes of fn's output (a pytree of tuples).
  """
  if not sharded():
    return fn(*args)
  mesh = jax.sharding.get_abstract_mesh()
  shape = dict(mesh.shape)
  spec = lambda a: shard_specs(shape, slots=slots, kv_heads=kv_heads, axes=[a])[0]
  in_specs = tuple(spec(a) for a in axes)
  is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
  out_specs = jax.tree.map(spec, out_axes, is_leaf=is_axes)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
