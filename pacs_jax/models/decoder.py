"""The decoder of every family: token embeddings -> stacked layers -> final norm (`Backbone`), and the LM head
(`CausalLM`), numerically transformers' `*ForCausalLM` of the family. Build them through
`pacs_jax.models.families` (it picks the family's decoder layer).

Shapes: B batch, T query length, S key length (cache rows), D hidden, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import attention, layers, paged, rope
from pacs_jax.models.kv_cache import KVCache
from pacs_jax.models.model_config import ModelConfig


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Position ids [B, T] for left-padded rows: 0 at the first real token (pads get 0 too)."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


class Backbone(nnx.Module):
  """Token embeddings -> `layer` x num_hidden_layers -> final norm. Returns hidden states [B, T, D]."""

  def __init__(self, config: ModelConfig, layer: type[layers.DecoderLayer], *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed_tokens = layers.param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), c.param_dtype)
    self.layers = layers.stacked_layers(c, layer, rngs)
    self.norm = layer.norm_cls(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs)

  def __call__(self, input_ids, attention_mask=None, *, segment_ids=None, positions=None):
    """input_ids, attention_mask: [B, T] (1 = real token, 0 = padding; left padding expected). Packed rows
    (several sequences end to end) give `segment_ids` and `positions` [B, T] instead of the mask: each token
    attends within its segment (`attention.Segments`), at its position in its own sequence."""
    if segment_ids is not None:
      hidden, _ = self._layers(input_ids, positions, attention.Segments(segment_ids), None)
      return hidden
    B, T = input_ids.shape
    if attention_mask is None:
      attention_mask = jnp.ones((B, T), jnp.int32)
    positions = positions_from_mask(attention_mask)
    causal = jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]  # [1, T, S]
    mask = causal & (attention_mask[:, None, :] > 0)  # [B, T, S]
    hidden, _ = self._layers(input_ids, positions, mask, None)
    return hidden

  def forward_with_cache(self, input_ids, positions, cache: KVCache | paged.PagedStep):
    """Cached forward. input_ids, positions: [B, T].

    Prefill (a dense `KVCache` of S >= T rows a sequence): the new keys go to cache rows [0, T) and each query
    attends to every cache row whose index is <= its position (rows are filled contiguously from 0, without
    padding). A decode step (a `paged.PagedStep`, T = 1) carries its own positions and lengths.
    Returns (hidden [B, T, D], new cache).
    """
    if isinstance(cache, paged.PagedStep):
      return self._layers(input_ids, positions, None, cache)
    mask = jnp.arange(cache.rows)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    return self._layers(input_ids, positions, mask, cache)

  def _layers(self, input_ids, positions, mask, cache):
    c = self.config
    x = jnp.take(layers.saved_or_base(self, "embed_tokens")[...], input_ids, axis=0).astype(c.dtype)  # [B, T, D]
    x = sharding.constrain(x, ("batch", None, None))
    cos, sin = rope.cos_sin(positions, c.head_size, c.rope_theta, c.rope_scaling)
    x, cache = layers.scan_layers(self.layers, x, cos, sin, mask, cache, remat=c.remat and c.remat_policy,
                                  unroll=layers.decode_unroll(c, cache))
    return self.norm(x), cache


class CausalLM(nnx.Module):
  """The backbone (`.model`) and the LM head (the embedding matrix when tied)."""

  def __init__(self, config: ModelConfig, layer: type[layers.DecoderLayer], *, rngs: nnx.Rngs):
    self.config = config
    self.model = Backbone(config, layer, rngs=rngs)
    if not config.tie_word_embeddings:
      self.lm_head = layers.param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"),
                            config.param_dtype)

  def logits(self, hidden):
    """hidden [B, T, D] -> logits [B, T, V] in the compute dtype."""
    dt = self.config.dtype
    if self.config.tie_word_embeddings:
      w = sharding.matmul_weight(layers.saved_or_base(self.model, "embed_tokens")[...], ("vocab", "embed"), dt)
      out = jnp.einsum("BTD,VD->BTV", hidden.astype(dt), w)
    else:
      head = layers.saved_or_base(self, "lm_head")[...]
      out = jnp.einsum("BTD,DV->BTV", hidden.astype(dt), sharding.matmul_weight(head, ("embed", "vocab"), dt))
    return sharding.constrain(out, ("batch", None, "vocab"))

  def __call__(self, input_ids, attention_mask=None):
    """Logits [B, T, V]. Left-padded rows give the same logits on real tokens as unpadded ones."""
    return self.logits(self.model(input_ids, attention_mask))

  def forward_with_cache(self, input_ids, positions, cache: KVCache | paged.PagedStep):
    """Cached forward (see `Backbone.forward_with_cache`); returns (logits [B, T, V], new cache)."""
    hidden, cache = self.model.forward_with_cache(input_ids, positions, cache)
    return self.logits(hidden), cache


def count_params(model: nnx.Module) -> int:
  """Number of parameters; works on abstract (`nnx.eval_shape`) models too."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
