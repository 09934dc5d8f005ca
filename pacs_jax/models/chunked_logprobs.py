"""Per-token log-probs and entropies from logits (or hidden states + lm head), in sequence chunks, so no
fp32 `[B, T, V]` log-softmax (several times the bf16 logits at V = 151,936) is ever materialised: the trainer's
log-prob passes and loss (`train.step.response_logprobs`), each chunk by the sampler's maths
(`models.token_logprobs.token_stats`).

Shapes: B rows, T query positions read (the trainer reads the R response positions), C positions per chunk,
D model width, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from pacs_jax.models.token_logprobs import token_stats, token_stats_and_normaliser

# 128 positions per chunk: one fp32 chunk is 256/T of the bf16 logits (1/16 at T = 4096, 1/2 at T = 512).
DEFAULT_CHUNK_SIZE = 128


def _chunk_stats(logits_chunk: jax.Array, tokens_chunk: jax.Array, temperature: float, with_entropy: bool):
  """logits_chunk [B, C, V], tokens_chunk [B, C] -> (logp [B, C],) or (logp, entropy): the sampler's own maths."""
  return token_stats(logits_chunk, tokens_chunk, temperature, with_entropy)


def _scan_chunks(chunk_fn: Callable, batch: int, length: int, chunk_size: int, n_out: int, carried=None,
                 dtype=jnp.float32):
  """Runs `chunk_fn(carried, start, size) -> n_out arrays [B, size]` over [0, length); returns n_out [B, length].

  The last chunk is shifted back to end at `length`: it overlaps the one before and rewrites equal values, so
  every chunk has one static size and no input is padded (a copy). `carried` (optional, the logits) travels
  through the loop state behind an optimization barrier, so XLA cannot treat it as loop-invariant and hoist a
  whole-array op out of the loop (the CPU backend's bf16 -> fp32 convert: a full fp32 copy). Not for
  reverse mode: a loop-carried array is saved once per iteration.
  """
  size = min(chunk_size, length)
  num_chunks = -(-length // size)

  def body(i, state):
    outs, carried = state
    if carried is not None:
      carried = lax.optimization_barrier(carried)
    start = jnp.minimum(i * size, length - size)
    values = chunk_fn(carried, start, size)
    outs = tuple(lax.dynamic_update_slice_in_dim(o, v, start, axis=1) for o, v in zip(outs, values))
    return outs, carried

  init = tuple(jnp.zeros((batch, length), dtype) for _ in range(n_out))
  if num_chunks == 1:
    return body(0, (init, carried))[0]
  return lax.fori_loop(0, num_chunks, body, (init, carried))[0]


def _logits_stats_differentiable(logits, tokens, temperature, chunk_size, with_entropy):
  """Chunked stats for reverse mode: each chunk is rematerialised, so the backward keeps no [B, C, V] per chunk."""
  B, T, _ = logits.shape

  @functools.partial(jax.checkpoint, static_argnums=(2,))
  def chunk_fn(_, start, size):
    # The barrier keeps the bf16 -> fp32 convert on the slice (XLA would otherwise convert the whole logits).
    chunk = lax.optimization_barrier(lax.dynamic_slice_in_dim(logits, start, size, axis=1))  # [B, C, V]
    return _chunk_stats(chunk, lax.dynamic_slice_in_dim(tokens, start, size, axis=1), temperature, with_entropy)

  return _scan_chunks(chunk_fn, B, T, chunk_size, 2 if with_entropy else 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _logits_stats(logits, tokens, temperature, chunk_size, with_entropy):
  # Forward: logits ride in the loop state (see `_scan_chunks`); the backward uses the remat formulation.
  B, T, _ = logits.shape

  def chunk_fn(carried_logits, start, size):
    chunk = lax.dynamic_slice_in_dim(carried_logits, start, size, axis=1)  # [B, C, V]
    return _chunk_stats(chunk, lax.dynamic_slice_in_dim(tokens, start, size, axis=1), temperature, with_entropy)

  return _scan_chunks(chunk_fn, B, T, chunk_size, 2 if with_entropy else 1, carried=logits)


def _logits_stats_fwd(logits, tokens, temperature, chunk_size, with_entropy):
  return _logits_stats(logits, tokens, temperature, chunk_size, with_entropy), (logits, tokens)


def _logits_stats_bwd(temperature, chunk_size, with_entropy, residuals, cotangents):
  logits, tokens = residuals
  _, vjp = jax.vjp(lambda lg: _logits_stats_differentiable(lg, tokens, temperature, chunk_size, with_entropy),
                   logits)
  return vjp(cotangents)[0], None


_logits_stats.defvjp(_logits_stats_fwd, _logits_stats_bwd)


def token_logprobs_and_entropy(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0,
                               chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[jax.Array, jax.Array]:
  """(log p(tokens[b, t]), entropy H[b, t]) of softmax(logits[b, t] / temperature), both [B, T] fp32.

  logits: [B, T, V] (bf16 or fp32); tokens: [B, T] int; temperature: a Python float. `tokens[b, t]` is read
  from `logits[b, t]`: callers shift (logits at position t predict token t + 1). Masking is the caller's
  (`algos.masked`). Differentiable w.r.t. `logits`.
  """
  return tuple(_logits_stats(logits, tokens, float(temperature), int(chunk_size), True))


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
  """log p(tokens[b, t] | softmax(logits[b, t] / temperature)): [B, T] fp32 (see `token_logprobs_and_entropy`)."""
  return _logits_stats(logits, tokens, float(temperature), int(chunk_size), False)[0]


def _as_head(lm_head) -> Callable[[jax.Array], jax.Array]:
  if callable(lm_head):
    return lm_head
  weight = lm_head  # [D, V]
  return lambda h: jnp.einsum("BCD,DV->BCV", h, weight.astype(h.dtype))


# `jax.checkpoint` names of a chunk's logits and of its per-row statistics (max, sum of exp, entropy), saved for
# the backward pass with `keep_logits`.
CHUNK_LOGITS = "chunk_logits"
CHUNK_STATS = "chunk_stats"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _kept_chunk_stats(logits, tokens, temperature: float, with_entropy: bool):
  """`_chunk_stats` whose backward reads the forward's per-row max, sum of exp (and entropy) instead of
  recomputing them.

  With the logits kept, autodiff's backward would redo logsumexp's max and sum over V (two passes over
  [B, C, V]); here it is one elementwise pass, fused into the head's transposed matmul. x = logits / temperature,
  p = softmax(x) = exp(x − m) / s, lse = m + log s and H as in `token_stats`:
    d logp / dx_v = [v = token] − p_v,     d H / dx_v = p_v · (lse − x_v − H).
  """
  return _chunk_stats(logits, tokens, temperature, with_entropy)


def _kept_chunk_stats_fwd(logits, tokens, temperature, with_entropy):
  outs, (m, s) = token_stats_and_normaliser(logits, tokens, temperature, with_entropy)  # m, s: [B, C]
  saved = checkpoint_name((m, s, outs[1] if with_entropy else None), CHUNK_STATS)
  return outs, (logits, tokens, saved)


def _kept_chunk_stats_bwd(temperature, with_entropy, residuals, cotangents):
  logits, tokens, (m, s, entropy) = residuals
  x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32)) / temperature  # [B, C, V]
  p = jnp.exp(x - m[..., None]) / s[..., None]
  vocab_ids = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  picked = (vocab_ids == tokens[..., None].astype(jnp.int32)).astype(x.dtype)
  dx = cotangents[0][..., None] * (picked - p)
  if with_entropy:
    neg_logp_all = (jnp.log(s) + m)[..., None] - x  # lse − x
    dx = dx + cotangents[1][..., None] * p * (neg_logp_all - entropy[..., None])
  return (dx / temperature).astype(logits.dtype), None


_kept_chunk_stats.defvjp(_kept_chunk_stats_fwd, _kept_chunk_stats_bwd)


def token_logprobs_from_hidden(hidden: jax.Array, lm_head, tokens: jax.Array, temperature: float = 1.0,
                               chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                               keep_logits: bool = False):
  """Log-probs (and entropies) from hidden states, never building the full fp32 `[B, T, V]` logits.

  hidden: [B, T, D]; tokens: [B, T]; lm_head: a weight [D, V] or a callable `[B, C, D] -> [B, C, V]`
  (e.g. `decoder.CausalLM.logits`, which handles tied embeddings). By default each chunk's logits are
  recomputed in the backward pass, so neither pass holds more than `[B, C, V]` of them. `keep_logits` saves
  each chunk's logits (the head's dtype: [B, T, V] in all) for the backward pass instead: no head matmul
  re-run, at that memory.
  Returns logp [B, T] fp32, or (logp, entropy) when `with_entropy`.
  """
  B, T, _ = hidden.shape
  head = _as_head(lm_head)
  policy = jax.checkpoint_policies.save_only_these_names(CHUNK_LOGITS, CHUNK_STATS) if keep_logits else None
  stats = _kept_chunk_stats if keep_logits else _chunk_stats

  @functools.partial(jax.checkpoint, static_argnums=(2,), policy=policy)
  def chunk_fn(_, start, size):
    h = lax.dynamic_slice_in_dim(hidden, start, size, axis=1)  # [B, C, D]
    logits = checkpoint_name(head(h), CHUNK_LOGITS)  # [B, C, V]
    return stats(logits, lax.dynamic_slice_in_dim(tokens, start, size, axis=1), temperature, with_entropy)

  outs = _scan_chunks(chunk_fn, B, T, chunk_size, 2 if with_entropy else 1,
                      dtype=jnp.promote_types(hidden.dtype, jnp.float32))
  return tuple(outs) if with_entropy else outs[0]
