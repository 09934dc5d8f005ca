"""Sums and means over masked positions (a response mask, a loss mask): the losses' reductions."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_sum(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Σ mask·values. Uses `where`, so non-finite values at masked positions neither leak nor give NaN grads."""
  return jnp.sum(jnp.where(mask > 0, values, 0.0), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Σ mask·values / max(Σ mask, 1): an all-masked row gives 0, not NaN."""
  count = jnp.sum((mask > 0).astype(jnp.float32), axis=axis)
  return masked_sum(values, mask, axis) / jnp.maximum(count, 1.0)
