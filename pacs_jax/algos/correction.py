"""Rollout correction: truncated importance weights between the behaviour policy (the rollout engine's log-probs,
as sampled) and π_old (the trainer's log-prob pass before the step's updates), verl's TIS (`tis_imp_ratio_cap`,
compute_policy_loss_vanilla, verl b8dc5377c .. 21271aabb), and the weights' statistics for the metrics.

Two levels (`rollout.tis_level`, verl's `rollout_is`): "token", one weight per token for a per-token loss (GRPO,
PPO), and "sequence", one weight per response, the product of its tokens' ratios, for a loss whose terms are whole
responses (PACS's BCE on a score summed over the response). The sequence level is verl's
compute_rollout_correction_weights with rollout_is="sequence" and a single threshold (verl-project/verl 20c30bf8,
verl/trainer/ppo/rollout_corr_helper.py): exp of the masked sum of log π_old − log μ, clamped to ±20 (its
SAFETY_BOUND), then truncated at the cap.

Shapes: B responses, R response positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pacs_jax.algos.masked import masked_mean, masked_sum

LEVELS = ("token", "sequence")
SAFETY_BOUND = 20.0  # verl's: the summed log-ratio is clamped to ±20 before exp, so a weight is always finite


def tis_weights(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, cap: float) -> jax.Array:
  """w [B, R] = min(exp(log π_old − log μ), C), no gradient; μ the behaviour (rollout) policy, C = `cap` > 0.

  verl multiplies each token's clipped policy loss by w before aggregating (its `pg_losses * tis_imp_ratio`): the
  gradient is reweighted towards π_old where the rollout engine sampled from a slightly different (or older)
  policy, and the cap bounds the variance a token μ found unlikely would add.
  """
  log_ratio = old_logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32)
  return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_ratio), cap))


def sequence_ratio(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, response_mask: jax.Array) -> jax.Array:
  """[B] ρ = exp(clip(Σ_t mask_t · (log π_old − log μ), ±20)): a response's probability ratio π_old(y) / μ(y),
  before truncation."""
  log_ratio = masked_sum(old_logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32), response_mask,
                         axis=-1)
  return jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))


def sequence_tis_weights(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, response_mask: jax.Array,
                         cap: float) -> jax.Array:
  """w [B] = min(exp(clip(Σ_t (log π_old − log μ), ±20)), C), no gradient: one weight per response.

  The unbiased importance weight of a whole response, truncated (verl's sequence-level TIS). Where μ = π_old on
  every token the sum is exactly 0 and w exactly 1.
  """
  return jax.lax.stop_gradient(jnp.minimum(sequence_ratio(old_logprobs, behaviour_logprobs, response_mask), cap))


def importance_stats(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, response_mask: jax.Array,
                     cap: float, level: str = "token") -> dict[str, jax.Array]:
  """Over a mini-batch [..., R]: the mean and max of the importance ratio ρ before truncation and the fraction the
  cap truncates (ρ > C). "token": ρ = exp(log π_old − log μ) over the response tokens; "sequence": ρ = the
  response's ratio exp(clip(Σ_t (log π_old − log μ), ±20)) over the responses."""
  if level == "sequence":
    ratio = sequence_ratio(old_logprobs, behaviour_logprobs, response_mask)
    mask = jnp.any(response_mask > 0, axis=-1).astype(jnp.float32)  # responses with a token
  else:
    ratio = jnp.exp(old_logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32))
    mask = response_mask
  return {"rollout_corr/is_weight_mean": masked_mean(ratio, mask),
          "rollout_corr/is_weight_max": jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
          "rollout_corr/tis_truncated_frac": masked_mean((ratio > cap).astype(jnp.float32), mask)}
