"""Rollout correction: truncated importance weights between the behaviour policy (the rollout engine's log-probs,
as sampled) and π_old (the trainer's log-prob pass before the step's updates), verl's TIS (`tis_imp_ratio_cap`,
compute_policy_loss_vanilla, verl b8dc5377c .. 21271aabb), and the weights' statistics for the metrics.

Shapes: B responses, R response positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax.algos.masked import masked_mean


def tis_weights(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, cap: float) -> jax.Array:
  """w [B, R] = min(exp(log π_old − log μ), C), no gradient; μ the behaviour (rollout) policy, C = `cap` > 0.

  verl multiplies each token's clipped policy loss by w before aggregating (its `pg_losses * tis_imp_ratio`): the
  gradient is reweighted towards π_old where the rollout engine sampled from a slightly different (or older)
  policy, and the cap bounds the variance a token μ found unlikely would add.
  """
  log_ratio = old_logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32)
  return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_ratio), cap))


def importance_stats(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, response_mask: jax.Array,
                     cap: float) -> dict[str, jax.Array]:
  """Over the response tokens of a mini-batch [..., R]: the mean and max of ρ = exp(log π_old − log μ) before
  truncation, and the fraction of tokens the cap truncates (ρ > C)."""
  ratio = jnp.exp(old_logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32))
  on = response_mask > 0
  return {"rollout_corr/is_weight_mean": masked_mean(ratio, response_mask),
          "rollout_corr/is_weight_max": jnp.max(jnp.where(on, ratio, -jnp.inf)),
          "rollout_corr/tis_truncated_frac": masked_mean((ratio > cap).astype(jnp.float32), response_mask)}
