"""Sampling methods as small frozen (hashable, jit-static) dataclasses, and the sampled tokens' log-probs.

The log-prob returned with every token is `log_softmax(logits / temperature)` of the *untruncated*
distribution (top-k / top-p only choose the support): the quantity the trainer recomputes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pacs_jax.models.token_logprobs import token_logprobs
from pacs_jax.rollout import truncation

# Logit given to tokens outside the top-k / top-p support; finite so a row never becomes all-NaN.
_EXCLUDED = -1e30


class SamplingMethod:
  """Base class. `sample(logits [B, V], key) -> tokens [B]`; `key` is one key (rows get independent
  draws) or one key per row `[B]` (each row's draw depends only on its own key and logits)."""

  temperature: float = 1.0

  def _sample(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    raise NotImplementedError

  def sample(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    if _is_key_batch(key):
      return jax.vmap(lambda row, k: self._sample(row[None], k)[0])(logits, key)
    return self._sample(logits, key)

  def sample_with_logprobs(self, logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [B] int32, log-probs [B] fp32 under `log_softmax(logits / temperature)`), the log-probs by
    the trainer's function (`models.token_logprobs`: no gather over a sharded vocab)."""
    tokens = self.sample(logits, key)
    return tokens, token_logprobs(logits.astype(jnp.float32), tokens, self.temperature)


def _is_key_batch(key: jax.Array) -> bool:
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.ndim == 2  # raw uint32 keys: [2] is one key, [B, 2] a batch


def _check_temperature(temperature: float) -> None:
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0 (use Greedy() for argmax), got {temperature}")


@dataclasses.dataclass(frozen=True)
class Greedy(SamplingMethod):
  """Argmax; log-probs are taken at temperature 1."""

  def _sample(self, logits, key):
    del key
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Temperature(SamplingMethod):
  """Sample from softmax(logits / temperature) over the whole vocabulary."""
  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature)

  def _sample(self, logits, key):
    return jax.random.categorical(key, logits / self.temperature, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopK(SamplingMethod):
  """Sample among the k largest logits, renormalised, at `temperature` (the lower id first among equal logits,
  as `lax.top_k` orders them; found without a `lax.top_k` over the whole vocabulary: `truncation.top_k`)."""
  k: int
  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature)
    if self.k < 1:
      raise ValueError(f"top-k needs k >= 1, got {self.k}")

  def sample(self, logits, key):
    logits = logits.astype(jnp.float32)
    top_logits, top_index = truncation.top_k(logits, min(self.k, logits.shape[-1]))  # [B, k]
    scaled = top_logits / self.temperature
    if _is_key_batch(key):  # each row's draw from its own key, as `SamplingMethod.sample` gives it
      choice = jax.vmap(lambda row, k: jax.random.categorical(k, row[None], axis=-1)[0])(scaled, key)
    else:
      choice = jax.random.categorical(key, scaled, axis=-1)  # [B]
    return jnp.take_along_axis(top_index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopP(SamplingMethod):
  """Nucleus sampling at `temperature`: the smallest set of most likely tokens whose probability
  reaches p (the token that crosses p is kept, as in transformers / vLLM; among equal logits the lower id
  comes first, as a stable sort orders them). Drawn without sorting the vocabulary (`truncation.nucleus`), its
  log-prob from the same normaliser."""
  p: float
  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature)
    if not 0 < self.p <= 1:
      raise ValueError(f"top-p needs 0 < p <= 1, got {self.p}")

  def sample(self, logits, key):
    if self.p >= 1.0:  # the full distribution (no float round-off in the masses)
      return Temperature(1.0).sample(logits.astype(jnp.float32) / self.temperature, key)
    return self.sample_with_logprobs(logits, key)[0]

  def sample_with_logprobs(self, logits, key):
    if self.p >= 1.0:
      return super().sample_with_logprobs(logits, key)
    scaled = logits.astype(jnp.float32) / self.temperature
    B, V = scaled.shape
    keys = key if _is_key_batch(key) else jax.random.split(key, B)  # a row's noise from its own key
    draw = lambda x, k: x + _gumbel_rows(k, V)  # noise for the rows drawn only
    token, logit, m, s = truncation.nucleus(scaled, keys, draw, self.p)
    return token, logit - (jnp.log(s) + m)  # `models.token_logprobs`'s ops, on the normaliser the draw used


def _gumbel_rows(keys: jax.Array, V: int) -> jax.Array:
  """Gumbel noise [..., V] from one key per row (keys [...], or raw uint32 keys [..., 2])."""
  lead = keys.shape if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys.shape[:-1]
  flat = keys.reshape(-1, *keys.shape[len(lead):])
  return jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(flat).reshape(*lead, V)


def nucleus_argmax(scaled: jax.Array, z: jax.Array, p: float, sizes: tuple[int, int] | None = None) -> jax.Array:
  """argmax of `z` [B, V] over each row's top-p support of logits `scaled` [B, V] (what a stable sort by
  descending logit keeps while the probability before a token is < p), without sorting (O(V log V) per row,
  more than the model's decode step at V = 151,936) or finding the support: with z = scaled + Gumbel noise, a
  draw from the nucleus renormalised (Gumbel-max). `truncation.nucleus` says how; `sizes` its (S1, S2)."""
  return truncation.nucleus(scaled, z, lambda x, z_rows: z_rows, p, sizes)[0]


def from_config(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingMethod:
  """The method for the usual knobs: temperature 0 -> greedy; top_k <= 0 and top_p >= 1 -> plain
  temperature sampling. Combining top-k with top-p is not supported (the paper's runs use neither)."""
  if temperature == 0:
    return Greedy()
  if top_k > 0 and top_p < 1.0:
    raise ValueError("choose either top_k or top_p, not both")
  if top_k > 0:
    return TopK(k=top_k, temperature=temperature)
  if top_p < 1.0:
    return TopP(p=top_p, temperature=temperature)
  return Temperature(temperature=temperature)
