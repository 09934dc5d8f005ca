"""Prefill's dense KV cache: every layer's keys and values of a batch of prompts, stacked (any family). The rollout
copies its rows into the decode state's pages (`rollout/page_allocation.py`); decode itself reads pages only."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pacs_jax.models.model_config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer, stacked: [layers, B, K, S, H].

  Heads come before rows, so each (row, head) holds a contiguous [S, H] block: the minor dims tile well
  on TPU whatever the number of kv heads per chip. The cache is carried through the layer scan, each layer
  writing its rows in place.
  """
  k: jax.Array  # [layers, B, K, S, H]
  v: jax.Array  # [layers, B, K, S, H]

  @property
  def rows(self) -> int:
    return self.k.shape[3]


# Logical axes of `KVCache.k` / `.v` (see `pacs_jax.sharding`): rows over (data, fsdp), kv heads over tensor.
CACHE_AXES = ("layers", "batch", "kv_heads", None, None)


def init_cache(config: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
  """An all-zero cache of `length` rows for each of `batch` sequences, every layer."""
  shape = (config.num_hidden_layers, batch, config.num_key_value_heads, length, config.head_size)
  dtype = dtype or config.dtype
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
