"""Attention maths of the decoder: grouped-query softmax attention, and the KV cache's per-layer writes and
reads (rotary position embedding: `rope`).

Shapes: B batch, T query length, S key length, N query heads, K kv heads, G = N // K, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

# A large finite negative: fully masked rows (left padding) then give a uniform softmax instead of NaN,
# as transformers does with finfo.min.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
  """The mask of an uncached pass over packed rows (several sequences end to end in a row): token t may see token
  s iff s <= t and both carry the same segment id. ids [B, T] int32: 1, 2, ... per sequence, 0 on the row's
  padding (which sees the padding before it: never an empty row). Flash kernels take the ids as they are; the
  XLA path builds the [B, T, T] mask from them (`dense`)."""
  ids: jax.Array

  def dense(self) -> jax.Array:
    """[B, T, T] bool: causal & same segment."""
    T = self.ids.shape[-1]
    causal = jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]
    return causal & (self.ids[:, :, None] == self.ids[:, None, :])


def attend(q, k, v, mask):
  """Softmax attention. q: [B, T, K, G, H]; k, v: [B, K, S, H]; mask: [B, T, S] -> [B, T, K, G, H]."""
  H = q.shape[-1]
  acc = jnp.promote_types(q.dtype, jnp.float32)  # fp32; fp64 for fp64 inputs (the fp64 gradient checks)
  scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k, preferred_element_type=acc) / jnp.sqrt(H).astype(acc)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("BKGTS,BKSH->BTKGH", probs, v)


def attend_in_chunks(q, k, v, mask, chunk: int):
  """`attend` on blocks of `chunk` queries in a loop, each block rematerialised in the backward pass.

  Every query row sees all S keys, so each row's softmax is the one `attend` computes; only the peak
  memory changes, from [B, K, G, T, S] fp32 scores to [B, K, G, chunk, S].
  """
  B, T = q.shape[:2]
  num_blocks = -(-T // chunk)
  pad = num_blocks * chunk - T  # padded query rows see no key (a uniform softmax) and are dropped below
  q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
  mask = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)))
  blocks = (jnp.moveaxis(q.reshape(B, num_blocks, chunk, *q.shape[2:]), 1, 0),  # [num_blocks, B, chunk, K, G, H]
            jnp.moveaxis(mask.reshape(B, num_blocks, chunk, mask.shape[-1]), 1, 0))  # [num_blocks, B, chunk, S]
  out = jax.lax.map(jax.checkpoint(lambda block: attend(block[0], k, v, block[1])), blocks)
  return jnp.moveaxis(out, 0, 1).reshape(B, num_blocks * chunk, *q.shape[2:])[:, :T]


# Prefill's dense KV cache (`kv_cache.KVCache`: k, v [layers, B, K, S, H]) as attention writes and reads it.


def write_kv(cache, layer: jax.Array, k: jax.Array, v: jax.Array):
  """Writes one layer's keys and values k, v [B, T, K, H] to cache rows [0, T) of every sequence (one
  dynamic_update_slice per buffer: in place in a loop-carried cache)."""
  block = lambda new: jnp.swapaxes(new, 1, 2)[None]  # [1, B, K, T, H]
  write = lambda buf, new: lax.dynamic_update_slice(buf, block(new).astype(buf.dtype), (layer, 0, 0, 0, 0))
  return cache.replace(k=write(cache.k, k), v=write(cache.v, v))


def read_kv(cache, layer: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """One layer's first `rows` cache rows: k, v [B, K, rows, H]."""
  read = lambda buf: lax.dynamic_index_in_dim(buf, layer, axis=0, keepdims=False)[:, :, :rows]
  return read(cache.k), read(cache.v)
