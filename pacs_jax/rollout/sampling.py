"""Sampling methods as small frozen (hashable, jit-static) dataclasses, and the sampled tokens' log-probs.

The log-prob returned with every token is `log_softmax(logits / temperature)` of the *untruncated*
distribution (top-k / top-p only choose the support): the quantity the trainer recomputes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pacs_jax.models.token_logprobs import token_logprobs

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
  """Sample among the k largest logits, renormalised, at `temperature`."""
  k: int
  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature)
    if self.k < 1:
      raise ValueError(f"top-k needs k >= 1, got {self.k}")

  def _sample(self, logits, key):
    k = min(self.k, logits.shape[-1])
    top_logits, top_index = jax.lax.top_k(logits, k)  # [B, k]
    choice = jax.random.categorical(key, top_logits / self.temperature, axis=-1)  # [B]
    return jnp.take_along_axis(top_index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopP(SamplingMethod):
  """Nucleus sampling at `temperature`: the smallest set of most likely tokens whose probability
  reaches p (the token that crosses p is kept, as in transformers / vLLM; among equal logits the lower id
  comes first, as a stable sort orders them). Drawn without sorting the vocabulary (`nucleus_argmax`)."""
  p: float
  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature)
    if not 0 < self.p <= 1:
      raise ValueError(f"top-p needs 0 < p <= 1, got {self.p}")

  def sample(self, logits, key):
    scaled = logits.astype(jnp.float32) / self.temperature
    if self.p >= 1.0:  # the full distribution (no float round-off in the masses)
      return Temperature(1.0).sample(scaled, key)
    B, V = scaled.shape
    if _is_key_batch(key):
      noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(key)
    else:
      noise = jax.random.gumbel(key, (B, V))
    return nucleus_argmax(scaled, scaled + noise, self.p)


def nucleus_argmax(scaled: jax.Array, z: jax.Array, p: float) -> jax.Array:
  """argmax of `z` [B, V] over each row's top-p support of logits `scaled` [B, V] (what a stable sort by
  descending logit keeps while the probability before a token is < p), without sorting (O(V log V) per row,
  more than the model's decode step at V = 151,936) or finding the support: with z = scaled + Gumbel noise, a
  draw from the nucleus renormalised (Gumbel-max).

  The argmax over the tokens not yet ruled out is in the nucleus iff the probability of the tokens before it
  (higher logit, or equal and lower id) is < p: one masked sum. If not, it and every token after it are ruled
  out and the next argmax is tried. The first token is always in the nucleus, so this ends; the argmax falls
  outside with probability about 1 - p per round (a batch of 128 rows: about 3 rounds of 2 passes over the
  vocabulary, against a sort's O(V log V) per row)."""
  probs = jax.nn.softmax(scaled, axis=-1)
  ids = jnp.arange(scaled.shape[-1])

  def before(logit, token):  # [B, V]: the tokens ordered before (logit, token) [B] by (logit desc, id asc)
    return (scaled > logit[:, None]) | ((scaled == logit[:, None]) & (ids < token[:, None]))

  def round_(state):
    floor, floor_id, token, done = state  # candidates: the tokens before (floor, floor_id)
    j = jnp.argmax(jnp.where(before(floor, floor_id), z, -jnp.inf), axis=-1).astype(jnp.int32)
    logit = jnp.take_along_axis(scaled, j[:, None], axis=-1)[:, 0]
    inside = jnp.sum(jnp.where(before(logit, j), probs, 0.0), axis=-1) < p
    token = jnp.where(done, token, j)
    floor, floor_id = jnp.where(done | inside, floor, logit), jnp.where(done | inside, floor_id, j)
    return floor, floor_id, token, done | inside

  B, V = scaled.shape
  start = (jnp.full((B,), -jnp.inf), jnp.full((B,), V, jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool))
  return lax.while_loop(lambda s: ~jnp.all(s[3]), round_, start)[2]


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
