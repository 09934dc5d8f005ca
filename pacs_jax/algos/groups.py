"""Group baselines shared by PACS and GRPO: rows of one prompt are contiguous, n (`group_size`) per group.

Shapes: B responses = U prompts × n samples (`group_size`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GRPO_EPS = 1e-6


def split_groups(values: jax.Array, group_size: int) -> jax.Array:
  """[B] -> [U, n]; rows of one prompt are contiguous."""
  if values.shape[0] % group_size:
    raise ValueError(f"{values.shape[0]} responses do not split into groups of {group_size}")
  return values.reshape(-1, group_size)


def unbiased_std(groups: jax.Array) -> jax.Array:
  """std with ddof=1 along the last axis, [U, n] -> [U, 1]; zero spread gets zero gradient (as torch.std)
  instead of NaN (d sqrt(v)/dv is infinite at v = 0, and all-equal r̂ happens: r̂ = 0 when π_θ = π_ref)."""
  n = groups.shape[-1]
  centred = groups - jnp.mean(groups, axis=-1, keepdims=True)
  var = jnp.sum(centred * centred, axis=-1, keepdims=True) / (n - 1)
  positive = var > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)


def rloo(groups: jax.Array) -> jax.Array:
  """x_i − mean_{j≠i} x_j = (n·x_i − Σ_j x_j) / (n − 1), along the last axis ([U, n] -> [U, n])."""
  n = groups.shape[-1]
  if n < 2:
    raise ValueError("rloo needs at least 2 responses per prompt")
  return (n * groups - jnp.sum(groups, axis=-1, keepdims=True)) / (n - 1)


def mean_std_normalise(groups: jax.Array, norm_by_std: bool = True, eps: float = GRPO_EPS) -> jax.Array:
  """(x_i − mean x) / (std x + eps) (std unbiased, ddof=1), or x_i − mean x without std; [U, n] -> [U, n]."""
  if groups.shape[-1] < 2:
    raise ValueError("group normalisation needs at least 2 responses per prompt")
  centred = groups - jnp.mean(groups, axis=-1, keepdims=True)
  if not norm_by_std:
    return centred
  return centred / (unbiased_std(groups) + eps)
