"""GRPO baseline: group-normalised outcome advantages and verl's clipped-ratio policy loss (core_algos.py).

Shapes: B responses = U prompts × n samples (`group_size`), contiguous rows; R response positions (a subscripted
R_i is response i's outcome reward).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pacs_jax.algos import advantages as advantages_lib, algorithms, correction
from pacs_jax.algos.masked import masked_mean, masked_sum
from pacs_jax.algos.settings import Settings, setting

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def group_advantages(rewards: jax.Array, *, group_size: int, norm_adv_by_std: bool = True,
                     estimator: str | None = None) -> jax.Array:
  """A_i [B] = (R_i − mean_j R_j) / (std_j R_j + eps) over the j of i's group (std unbiased, ddof=1), or
  R_i − mean_j R_j without std: the registered estimator "grpo" or "drgrpo" (`advantages`), or `estimator`.

  A constant: rewards carry no gradient. (verl gives a single-response group mean 0, std 1; here n >= 2.)
  """
  estimator = estimator or ("grpo" if norm_adv_by_std else "drgrpo")
  return advantages_lib.get(estimator)(jax.lax.stop_gradient(rewards.astype(jnp.float32)), group_size)


def agg_loss(loss_mat: jax.Array, loss_mask: jax.Array, loss_agg_mode: str = "token-mean",
             micro_batch_rows: int = 1) -> jax.Array:
  """A scalar from per-token losses [B, R] (verl's agg_loss; masked positions never count).

    token-mean:               Σ_{i,t} m·ℓ / Σ_{i,t} m
    seq-mean-token-sum:       mean_i Σ_t m·ℓ
    seq-mean-token-mean:      mean_i (Σ_t m·ℓ / Σ_t m)
    seq-mean-token-sum-norm:  b · mean_i (Σ_t m·ℓ / R),  R = loss_mat.shape[-1] (the max response length, Dr. GRPO)

  verl's last mode divides the micro-batch *sum* by R, and verl then averages its micro-batches of b rows
  (dp_actor.update_policy: loss / gradient_accumulation, FSDP averages the ranks): the released gradient is
  b = ppo_micro_batch_size_per_gpu times the per-sequence mean. `micro_batch_rows` is that b, a number of the
  recipe, so the scale does not depend on how this project splits a mini-batch for memory.
  """
  if loss_agg_mode == "token-mean":
    return masked_mean(loss_mat, loss_mask)
  seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)  # [B]
  if loss_agg_mode == "seq-mean-token-sum":
    return jnp.mean(seq_sums)
  if loss_agg_mode == "seq-mean-token-mean":
    return jnp.mean(seq_sums / jnp.maximum(jnp.sum((loss_mask > 0).astype(jnp.float32), axis=-1), 1.0))
  if loss_agg_mode == "seq-mean-token-sum-norm":
    return micro_batch_rows * jnp.mean(seq_sums) / loss_mat.shape[-1]
  raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, kl_type: str = "low_var_kl") -> jax.Array:
  """Per-token KL estimate [B, R] (Schulman's estimators, verl's kl_penalty).

    kl / k1:          logp − ref
    abs:              |logp − ref|
    mse / k2:         ½ (logp − ref)²
    low_var_kl / k3:  exp(d) − d − 1, d = clip(ref − logp, −20, 20), result clipped to [−10, 10]
  """
  diff = logprobs - ref_logprobs
  if kl_type in ("kl", "k1"):
    return diff
  if kl_type == "abs":
    return jnp.abs(diff)
  if kl_type in ("mse", "k2"):
    return 0.5 * diff * diff
  if kl_type in ("low_var_kl", "k3"):
    d = jnp.clip(-diff, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)
  raise ValueError(f"unknown kl type {kl_type!r}")


def clipped_policy_loss(old_logprobs: jax.Array, logprobs: jax.Array, advantages: jax.Array,
                        response_mask: jax.Array, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                        clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                        micro_batch_rows: int = 1, is_weights: jax.Array | None = None
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """PPO clipped-ratio loss with dual clip (verl's compute_policy_loss_vanilla); all inputs [B, R].

    ρ = exp(clip(logp − old, −20, 20))
    ℓ₁ = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))
    ℓ = min(ℓ₁, −A·c) where A < 0 (dual clip: a negative advantage cannot push by more than c), else ℓ₁
    ℓ ← w·ℓ with `is_weights` w [B, R] or [B, 1] (the rollout correction, `correction`), when given
  `advantages` may be [B] (one per response) or [B, R]. Returns (agg_loss(ℓ), metrics).
  The released verl clamps nothing; the ±20 clamp of log ρ keeps exp finite (a 0 · inf would make the step NaN
  and skipped) and changes gradients by at most A·e⁻²⁰: beyond +20 the clip (A > 0) or dual clip (A < 0) holds ℓ
  constant, below −20 ρ is that small.
  """
  if clip_ratio_c <= 1.0:
    raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound), got {clip_ratio_c}")
  advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  if advantages.ndim == 1:
    advantages = jnp.broadcast_to(advantages[:, None], logprobs.shape)
  old_logprobs = jax.lax.stop_gradient(old_logprobs.astype(jnp.float32))
  log_ratio = jnp.clip(logprobs.astype(jnp.float32) - old_logprobs, -20.0, 20.0)  # clamp: exp stays finite
  ratio = jnp.exp(log_ratio)
  losses1 = -advantages * ratio
  losses2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
  clipped1 = jnp.maximum(losses1, losses2)
  losses3 = -advantages * clip_ratio_c
  negative = advantages < 0
  per_token = jnp.where(negative, jnp.minimum(losses3, clipped1), clipped1)
  if is_weights is not None:
    per_token = per_token * jax.lax.stop_gradient(is_weights)
  loss = agg_loss(per_token, response_mask, loss_agg_mode, micro_batch_rows)
  sg = jax.lax.stop_gradient
  metrics = {
      "actor/pg_loss": sg(loss),
      "actor/pg_clipfrac": masked_mean((losses2 > losses1).astype(jnp.float32), response_mask),
      "actor/pg_clipfrac_lower": masked_mean(((clipped1 > losses3) & negative).astype(jnp.float32), response_mask),
      "actor/ppo_kl": sg(masked_mean(-log_ratio, response_mask)),
  }
  return loss, metrics


def entropy_bonus(loss: jax.Array, metrics: dict[str, jax.Array], entropy: jax.Array | None,
                  response_mask: jax.Array, *, entropy_coeff: float, loss_agg_mode: str,
                  micro_batch_rows: int) -> jax.Array:
  """loss − ent_coef · agg(H), entropy [B, R] aggregated as the policy loss (`metrics` gains actor/entropy); the
  loss itself without entropy."""
  if entropy_coeff and entropy is None:
    raise ValueError("entropy_coeff != 0 needs per-token entropy")
  if entropy is not None:
    entropy_loss = agg_loss(entropy.astype(jnp.float32), response_mask, loss_agg_mode, micro_batch_rows)
    loss = loss - entropy_coeff * entropy_loss
    metrics["actor/entropy"] = jax.lax.stop_gradient(entropy_loss)
  return loss


def grpo_loss(logprobs: jax.Array, old_logprobs: jax.Array, ref_logprobs: jax.Array | None,
              response_mask: jax.Array, rewards: jax.Array, *, group_size: int, norm_adv_by_std: bool = True,
              clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
              loss_agg_mode: str = "seq-mean-token-sum-norm", kl_loss_coef: float = 0.0,
              kl_loss_type: str = "low_var_kl", entropy: jax.Array | None = None,
              entropy_coeff: float = 0.0, micro_batch_rows: int = 1, is_weights: jax.Array | None = None,
              adv_estimator: str | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GRPO actor loss: pg_loss(A = group_advantages(R)) + kl_coef · agg(KL(π_θ‖π_ref)) − ent_coef · agg(H).

  logprobs, old_logprobs, ref_logprobs, response_mask, entropy: [B, R]; rewards: [B]. The KL term is used when
  kl_loss_coef > 0 (needs ref_logprobs), the entropy bonus when entropy_coeff != 0 (needs entropy). Defaults
  are the paper's baseline: clip 0.2, seq-mean-token-sum-norm, no KL, no entropy; `micro_batch_rows`: see agg_loss;
  `is_weights` [B, R]: the rollout correction's weights on the policy loss (see clipped_policy_loss);
  `adv_estimator`: a registered estimator in place of the one `norm_adv_by_std` names (see group_advantages).
  """
  advantages = group_advantages(rewards, group_size=group_size, norm_adv_by_std=norm_adv_by_std,
                                estimator=adv_estimator)  # [B]
  loss, metrics = clipped_policy_loss(old_logprobs, logprobs, advantages, response_mask,
                                      clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                      clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                                      micro_batch_rows=micro_batch_rows, is_weights=is_weights)
  loss = entropy_bonus(loss, metrics, entropy, response_mask, entropy_coeff=entropy_coeff,
                       loss_agg_mode=loss_agg_mode, micro_batch_rows=micro_batch_rows)
  if kl_loss_coef:
    if ref_logprobs is None:
      raise ValueError("kl_loss_coef > 0 needs ref_logprobs")
    kl = kl_penalty(logprobs.astype(jnp.float32), jax.lax.stop_gradient(ref_logprobs.astype(jnp.float32)),
                    kl_loss_type)
    kl_loss = agg_loss(kl, response_mask, loss_agg_mode, micro_batch_rows)
    loss = loss + kl_loss_coef * kl_loss
    metrics["actor/kl_loss"] = jax.lax.stop_gradient(kl_loss)
  metrics["actor/loss"] = jax.lax.stop_gradient(loss)
  metrics["actor/advantage_mean"] = jnp.mean(advantages)
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class ClipSettings(Settings):
  """A ratio clipped to [1 − ε_low, 1 + ε_high] and an entropy bonus."""
  clip_ratio_low: float = setting(0.2, "ε_low: the ratio's lower clip is 1 − ε_low")
  clip_ratio_high: float = setting(0.2, "ε_high: the ratio's upper clip is 1 + ε_high (clip-higher when > ε_low)")
  entropy_coeff: float = setting(0.0, "entropy bonus coefficient (0: the entropy is a metric only)")

  def check(self, check):
    check(0 <= self.clip_ratio_low < 1, "clip_ratio_low", f"must be in [0, 1), got {self.clip_ratio_low}")
    check(self.clip_ratio_high >= 0, "clip_ratio_high", f"must be >= 0, got {self.clip_ratio_high}")


@dataclasses.dataclass(frozen=True)
class ClippedRatioSettings(ClipSettings):
  """verl's clipped-ratio actor (compute_policy_loss_vanilla): dual clip, a loss aggregation mode."""
  clip_ratio_c: float = setting(3.0, "dual clip for negative advantages: a token's loss is at most −A·c")
  loss_agg_mode: str = setting("seq-mean-token-sum-norm", " | ".join(LOSS_AGG_MODES))

  def check(self, check):
    super().check(check)
    check(self.loss_agg_mode in LOSS_AGG_MODES, "loss_agg_mode", f"unknown mode {self.loss_agg_mode!r}")
    check(self.clip_ratio_c > 1, "clip_ratio_c", f"must be > 1 (the dual clip's bound), got {self.clip_ratio_c}")


@dataclasses.dataclass(frozen=True)
class GrpoSettings(ClippedRatioSettings):
  """GRPO as the paper's baseline (the released PACS recipe's verl)."""
  norm_adv_by_std: bool = setting(True, "divide the group advantage by the group's std")
  use_kl_loss: bool = setting(False, "a KL loss against a frozen copy of the initial policy")
  kl_coef: float = setting(0.001, "the KL loss's coefficient (low_var_kl)")


class ClippedRatio(algorithms.Algorithm):
  """verl's clipped-ratio actor on the shared loop: ratios against the step's sampling policy, losses
  aggregated by `loss_agg_mode` (its accumulation weight: tokens for token-mean, rows otherwise). Each subclass
  reads its own settings block (`settings`): clip ratios, aggregation, entropy coefficient."""

  settings_class = ClippedRatioSettings
  supports_rollout_correction = True

  def is_weights(self, objective, micro) -> jax.Array | None:
    """The rollout correction's truncated importance weights [..., R] (token level, `correction.tis_weights`) or
    [..., 1] (sequence level), or None without it (`rollout.tis_imp_ratio_cap` <= 0)."""
    cap = objective.tis_cap
    if cap is None:
      return None
    if objective.tis_level == "sequence":  # one weight per response on each of its tokens, as verl broadcasts it
      return correction.sequence_tis_weights(micro["old_logprobs"], micro["behaviour_logprobs"],
                                             micro["loss_mask"], cap)[..., None]
    return correction.tis_weights(micro["old_logprobs"], micro["behaviour_logprobs"], cap)

  def loss_agg_mode(self, settings) -> str:
    """How the loss aggregates its per-token terms: the settings' mode, or a preset's fixed one."""
    return settings.loss_agg_mode

  def micro_batch_rows(self, objective) -> int:
    """The rows verl's seq-mean-token-sum-norm sums per micro-batch (`agg_loss`): the released PACS recipe's
    ppo_micro_batch_size_per_gpu (GRPO, PPO); an objective ported from today's verl, which normalises over the
    global mini-batch, says 1."""
    return objective.verl_micro_batch_rows

  def needs_old_logprobs(self, cfg):
    return True

  def entropy_has_grad(self, objective):
    return objective.settings.entropy_coeff != 0

  def normaliser(self, objective, micro, mask=None):
    if self.loss_agg_mode(objective.settings) == "token-mean":
      return jnp.sum((micro["loss_mask"] if mask is None else mask).astype(jnp.float32))
    return super().normaliser(objective, micro, mask)


class Grpo(ClippedRatio):
  """GRPO: group-normalised outcome advantages, optional KL loss against a frozen reference."""

  min_group_size = 2
  settings_class = GrpoSettings

  def norm_adv_by_std(self, settings) -> bool:
    return settings.norm_adv_by_std

  def advantage_estimator(self, settings):
    return "grpo" if self.norm_adv_by_std(settings) else "drgrpo"

  def kl_loss_coef(self, settings) -> float | None:
    """The KL loss's coefficient, None without a KL loss (and so without a frozen reference)."""
    return settings.kl_coef if settings.use_kl_loss else None

  def reference(self, cfg):
    return algorithms.Reference.NONE if self.kl_loss_coef(self.settings(cfg)) is None else algorithms.Reference.FROZEN

  def loss(self, objective, logprobs, entropy, micro):
    g = objective.settings
    return grpo_loss(logprobs, micro["old_logprobs"], micro.get("ref_logprobs"), micro["loss_mask"],
                     micro["rewards"], group_size=objective.group_size, adv_estimator=objective.advantage_estimator,
                     clip_ratio_low=g.clip_ratio_low, clip_ratio_high=g.clip_ratio_high,
                     clip_ratio_c=g.clip_ratio_c, loss_agg_mode=self.loss_agg_mode(g),
                     kl_loss_coef=self.kl_loss_coef(g) or 0.0, entropy=entropy,
                     entropy_coeff=g.entropy_coeff, micro_batch_rows=self.micro_batch_rows(objective),
                     is_weights=self.is_weights(objective, micro))


class GrpoFamily(Grpo):
  """The GRPO-family objectives ported from today's verl (DAPO, Dr. GRPO, GSPO): no KL loss (so no reference
  policy) and a loss normalised over the global mini-batch (one verl row per micro-batch, `micro_batch_rows`).
  No rollout correction yet: its parity with verl is tested for GRPO and PPO only."""

  supports_rollout_correction = False

  def kl_loss_coef(self, settings):
    return None

  def micro_batch_rows(self, objective):
    return 1


algorithms.register("grpo", Grpo())
