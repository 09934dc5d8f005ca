"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), as verl's `gspo` policy loss (GSPO-token): one
importance ratio per sequence, the geometric mean of its tokens' ratios, clipped in a narrow range (3e-4 / 4e-4),
on GRPO's group advantages; the loss is a mean over sequences of each one's token mean.

Shapes: B responses = U prompts × n samples (`group_size`), contiguous rows; R response positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pacs_jax.algos import algorithms
from pacs_jax.algos.grpo import ClipSettings, GrpoFamily, agg_loss, entropy_bonus, group_advantages
from pacs_jax.algos.masked import masked_mean, masked_sum
from pacs_jax.algos.settings import setting

LOSS_AGG_MODE = "seq-mean-token-mean"  # verl's gspo loss aggregates so whatever the actor's loss_agg_mode
LOG_RATIO_MAX = 10.0  # verl clamps log s_i,t from above for numerical stability


def sequence_ratio_loss(old_logprobs: jax.Array, logprobs: jax.Array, advantages: jax.Array,
                        response_mask: jax.Array, *, clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GSPO-token policy loss (verl's compute_policy_loss_gspo); inputs [B, R], `advantages` [B] or [B, R].

    log s_i   = (1/|o_i|) Σ_t m_t (log π_θ − log π_old)              one ratio per sequence (no gradient)
    log s_i,t = min(log π_θ,t − sg(log π_θ,t) + sg(log s_i), 10)     value s_i, gradient s_i ∇log π_θ,t
    ℓ_t = max(−A·s_i,t, −A·clip(s_i,t, 1 − ε_low, 1 + ε_high))       no dual clip
    loss = mean_i (Σ_t m_t ℓ_t / Σ_t m_t)
  """
  sg = jax.lax.stop_gradient
  advantages = sg(advantages.astype(jnp.float32))
  if advantages.ndim == 1:
    advantages = jnp.broadcast_to(advantages[:, None], logprobs.shape)
  logprobs = logprobs.astype(jnp.float32)
  log_ratio = logprobs - sg(old_logprobs.astype(jnp.float32))  # [B, R]
  lengths = jnp.maximum(jnp.sum((response_mask > 0).astype(jnp.float32), axis=-1), 1.0)  # [B]
  seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / lengths  # [B]
  log_seq_ratio = jnp.minimum(logprobs - sg(logprobs) + sg(seq_log_ratio)[:, None], LOG_RATIO_MAX)  # [B, R]
  ratio = jnp.exp(log_seq_ratio)
  losses1 = -advantages * ratio
  losses2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
  loss = agg_loss(jnp.maximum(losses1, losses2), response_mask, LOSS_AGG_MODE)
  metrics = {
      "actor/pg_loss": sg(loss),
      "actor/pg_clipfrac": masked_mean((losses2 > losses1).astype(jnp.float32), response_mask),
      "actor/ppo_kl": sg(masked_mean(-log_ratio, response_mask)),
      "actor/seq_ratio_mean": sg(jnp.mean(jnp.exp(jnp.minimum(seq_log_ratio, LOG_RATIO_MAX)))),
  }
  return loss, metrics


def gspo_loss(logprobs: jax.Array, old_logprobs: jax.Array, response_mask: jax.Array, rewards: jax.Array, *,
              group_size: int, clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4,
              entropy: jax.Array | None = None, entropy_coeff: float = 0.0, adv_estimator: str = "grpo"
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GSPO actor loss: sequence_ratio_loss(A = group_advantages(R), std-normalised) − ent_coef · agg(H).

  logprobs, old_logprobs, response_mask, entropy: [B, R]; rewards: [B]; `adv_estimator` the registered one."""
  advantages = group_advantages(rewards, group_size=group_size, estimator=adv_estimator)  # [B]
  loss, metrics = sequence_ratio_loss(old_logprobs, logprobs, advantages, response_mask,
                                      clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
  loss = entropy_bonus(loss, metrics, entropy, response_mask, entropy_coeff=entropy_coeff,
                       loss_agg_mode=LOSS_AGG_MODE, micro_batch_rows=1)
  metrics["actor/loss"] = jax.lax.stop_gradient(loss)
  metrics["actor/advantage_mean"] = jnp.mean(advantages)
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class GspoSettings(ClipSettings):
  """GSPO as verl's examples/gspo_trainer runs it: GRPO advantages, no KL loss."""
  clip_ratio_low: float = setting(3e-4, "ε_low: the sequence ratio's lower clip is 1 − ε_low")
  clip_ratio_high: float = setting(4e-4, "ε_high: the sequence ratio's upper clip is 1 + ε_high")


class Gspo(GrpoFamily):
  """GSPO on the shared loop: GRPO's group advantages, one clipped importance ratio per sequence."""

  settings_class = GspoSettings

  def norm_adv_by_std(self, settings):
    return True

  def loss_agg_mode(self, settings):
    return LOSS_AGG_MODE

  def loss(self, objective, logprobs, entropy, micro):
    s = objective.settings
    return gspo_loss(logprobs, micro["old_logprobs"], micro["loss_mask"], micro["rewards"],
                     group_size=objective.group_size, clip_ratio_low=s.clip_ratio_low,
                     clip_ratio_high=s.clip_ratio_high, entropy=entropy, entropy_coeff=s.entropy_coeff,
                     adv_estimator=objective.advantage_estimator)


algorithms.register("gspo", Gspo())
