"""Rotary position embedding, transformers' variants: the default RoPE and Llama 3's frequency scaling
(`rope_type: "llama3"`), read from and written to a Hugging Face config.json.

Shapes (docs/shapes.md): B batch rows, T query positions, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  """Llama 3.1's RoPE scaling: wavelengths longer than the original context / low_freq_factor are stretched by
  `factor`, those shorter than original / high_freq_factor kept, the ones between interpolated."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


def from_hf(cfg: dict, default_theta: float = 10000.0) -> tuple[float, Llama3Scaling | None]:
  """(theta, scaling) of a transformers config dict, in transformers 4's (`rope_theta`, `rope_scaling`) or 5's
  (`rope_parameters`) layout. Other RoPE types are refused: the model would silently be a different one."""
  rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  theta = float(cfg.get("rope_theta", rope.get("rope_theta", default_theta)))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type in (None, "default"):
    return theta, None
  if rope_type == "llama3":
    fields = [f.name for f in dataclasses.fields(Llama3Scaling)]
    missing = [f for f in fields if f not in rope]
    if missing:
      raise ValueError(f"rope_type 'llama3' needs {missing}")
    return theta, Llama3Scaling(**{f: rope[f] for f in fields})
  raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")


def to_hf(theta: float, scaling: Llama3Scaling | None) -> dict:
  """The config.json fields of (theta, scaling), readable by transformers 4 and 5."""
  if scaling is None:
    return dict(rope_theta=theta, rope_parameters={"rope_type": "default", "rope_theta": theta})
  params = {"rope_type": "llama3", **dataclasses.asdict(scaling)}
  return dict(rope_theta=theta, rope_scaling=params, rope_parameters={**params, "rope_theta": theta})


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3Scaling | None = None) -> jax.Array:
  """[H/2] fp32 rotation frequencies (transformers' `_compute_default_rope_parameters` and
  `_compute_llama3_parameters`, in the same fp32 operations)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [H/2]
  if scaling is None:
    return inv_freq
  s = scaling
  old = s.original_max_position_embeddings
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor, inv_freq)
  smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < old / s.high_freq_factor) & ~(wavelen > old / s.low_freq_factor)
  return jnp.where(medium, smoothed, scaled)


def cos_sin(positions: jax.Array, head_dim: int, theta: float, scaling: Llama3Scaling | None = None):
  """cos, sin of shape [B, T, H] for integer positions [B, T]."""
  inv_freq = inverse_frequencies(head_dim, theta, scaling)  # [H/2]
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, H]
  return jnp.cos(emb), jnp.sin(emb)


def apply(x, cos, sin):
  """x: [B, T, N, H]; rotate-half convention of transformers (not interleaved).

  rotate_half(x) = [-x2, x1] is written as a roll by H/2 times a sign: the same numbers, and on TPU a
  much cheaper program to compile than a split and a concatenate along the lanes.
  """
  H = x.shape[-1]
  dt = x.dtype
  sign = jnp.where(jnp.arange(H) < H // 2, -1.0, 1.0).astype(dt)  # [H]
  rotated = jnp.roll(x, H // 2, axis=-1) * sign
  return x * cos[:, :, None, :].astype(dt) + rotated * sin[:, :, None, :].astype(dt)
