"""Log-probs (and entropies) of chosen tokens under softmax(logits / temperature), shared by the sampler and
the trainer: a select + sum over the vocab, so logits sharded over it stay sharded (no gather)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def token_stats(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0, with_entropy: bool = False):
  """logits [..., V] (any float dtype), tokens [...] -> (logp [...],) or (logp, entropy), at least fp32.

    x = logits / temperature,  lse = log Σ_v exp x_v,
    log p(token) = x_token − lse,  H = Σ_v p_v · (lse − x_v),  p = softmax(x)
  """
  return token_stats_and_normaliser(logits, tokens, temperature, with_entropy)[0]


def token_stats_and_normaliser(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0,
                               with_entropy: bool = False):
  """(`token_stats`'s outputs, (m, s)): lse = m + log s with m = max_v x_v and s = Σ_v exp(x_v − m), for a
  backward pass that reuses them (p = exp(x − m) / s, as `jax.nn.logsumexp`'s own gradient computes it)."""
  # At least fp32 (bf16 logits are upcast); fp64 stays fp64 under jax_enable_x64 (exactness tests).
  x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32)) / temperature  # [..., V]
  # jax.nn.logsumexp's own steps, with its intermediate max and sum kept.
  m = lax.stop_gradient(jnp.max(x, axis=-1))
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # [...]
  s = jnp.sum(jnp.exp(x - m[..., None]), axis=-1)  # [...]
  lse = jnp.log(s) + m
  # A select + sum instead of take_along_axis: with the vocab sharded over devices a gather along it makes
  # XLA all-gather the logits, while the select + sum stays sharded (one all-reduce of [...]).
  vocab_ids = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  picked = jnp.sum(jnp.where(vocab_ids == tokens[..., None].astype(jnp.int32), x, 0.0), axis=-1)
  logp = picked - lse
  if not with_entropy:
    return (logp,), (m, s)
  neg_logp_all = lse[..., None] - x  # [..., V], >= 0
  # Σ p·(lse − x) rather than lse − Σ p·x: no cancellation between two large numbers.
  return (logp, jnp.sum(jnp.exp(-neg_logp_all) * neg_logp_all, axis=-1)), (m, s)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
  """log_softmax(logits / temperature)[tokens]: logits [..., V], tokens [...] -> [...] (at least fp32)."""
  return token_stats(logits, tokens, temperature)[0]
