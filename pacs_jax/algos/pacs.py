"""The PACS loss (docs/algorithm.md): a BCE of the verified reward R on a score ψ built from the policy's own log-probs.

Shapes: B responses = U prompts × n samples (`group_size`), contiguous rows; R response positions (a subscripted
R_i is response i's verified reward).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.algos import advantages as advantages_lib, algorithms, batch as batch_lib, correction
from pacs_jax.algos import groups as groups_lib
from pacs_jax.algos.masked import masked_sum
from pacs_jax.algos.settings import Settings, choice, setting

ADV_ESTIMATORS = ("rloo", "grpo", "naive")  # the built-in ones; any registered estimator (`advantages`) is one too
WEIGHT_MODES = ("question", "only_positive", "only_negative")
REWARD_METHODS = ("1", "2")  # "1": β Σ (log π − log π_ref); "2": β Σ log π / |o|
REFERENCE_POLICIES = (algorithms.Reference.FROZEN.value, algorithms.Reference.ROLLOUT.value)
GRPO_EPS = groups_lib.GRPO_EPS


def reward_proxy(logprobs: jax.Array, ref_logprobs: jax.Array, response_mask: jax.Array, *, beta: float = 1.0,
                 reward_method: str = "1", sum_mask: jax.Array | None = None) -> jax.Array:
  """r̂_i [B] from per-token log-probs [B, R].

    "1":  r̂_i = β · Σ_t s_t · (log π_θ − log π_ref)
    "2":  r̂_i = β · Σ_t s_t · log π_θ / |o_i|,   |o_i| = Σ_t mask_t  (ref unused)

  s = `sum_mask`, by default the response mask. The released compute_reward (pacs_core_algos.py) sums every
  position of the response slice; `padding_replication_inputs` gives the s (and log-prob targets) that make
  this sum equal to it.
  """
  reward_method = str(reward_method)
  sum_mask = response_mask if sum_mask is None else sum_mask
  if reward_method == "1":
    return beta * masked_sum(logprobs - ref_logprobs, sum_mask, axis=-1)
  if reward_method == "2":
    length = jnp.sum((response_mask > 0).astype(jnp.float32), axis=-1)  # [B]
    return beta * masked_sum(logprobs, sum_mask, axis=-1) / jnp.maximum(length, 1.0)
  raise ValueError(f"reward_method must be one of {REWARD_METHODS}, got {reward_method!r}")


rloo_advantage = groups_lib.rloo  # ψ_i = r̂_i − mean_{j≠i} r̂_j, [U, n] -> [U, n]


def grpo_advantage(groups: jax.Array, norm_adv_by_std: bool = True, eps: float = GRPO_EPS) -> jax.Array:
  """ψ_i = (r̂_i − mean r̂) / (std r̂ + eps) (std unbiased, ddof=1), or r̂_i − mean r̂ without std; [U, n]."""
  return groups_lib.mean_std_normalise(groups, norm_adv_by_std, eps)


def estimator_name(adv_estimator: str, norm_adv_by_std: bool = True) -> str:
  """The registered estimator (`advantages`) of the settings: "grpo" without std is "drgrpo"."""
  return "drgrpo" if adv_estimator == "grpo" and not norm_adv_by_std else adv_estimator


def score(reward_proxy_values: jax.Array, *, group_size: int, adv_estimator: str = "rloo",
          norm_adv_by_std: bool = True) -> jax.Array:
  """ψ [B] from r̂ [B]: "rloo" | "grpo" (± std) | "naive" (ψ = r̂), or another registered estimator
  (`advantages`). Gradients flow through the baselines."""
  name = estimator_name(adv_estimator, norm_adv_by_std)
  if name not in advantages_lib.names():
    raise ValueError(f"adv_estimator must be one of {advantages_lib.names()}, got {adv_estimator!r}")
  return advantages_lib.get(name)(reward_proxy_values, group_size)


def class_weights(rewards: jax.Array, *, group_size: int, use_weight: bool = True,
                  weight_mode: str = "question") -> jax.Array:
  """Per-response BCE weights w [B] (constants: they depend on labels only).

    use_weight False:  w = 1
    "question":        per group with both labels, sklearn "balanced" w_c = n / (2 · count_c);
                       a group whose labels are all equal: w = 1
    "only_positive":   w = [R = 1];   "only_negative":  w = [R = 0]
  """
  if weight_mode not in WEIGHT_MODES:
    raise ValueError(f"weight_mode must be one of {WEIGHT_MODES}, got {weight_mode!r}")
  positive = (rewards > 0.5).astype(jnp.float32)  # [B]
  if not use_weight:
    return jnp.ones_like(positive)
  if weight_mode == "only_positive":
    return positive
  if weight_mode == "only_negative":
    return 1.0 - positive
  groups = groups_lib.split_groups(positive, group_size)  # [U, n]
  n = group_size
  num_pos = jnp.sum(groups, axis=-1, keepdims=True)  # [U, 1]
  num_neg = n - num_pos
  balanced = jnp.where(groups > 0, n / (2.0 * jnp.maximum(num_pos, 1.0)), n / (2.0 * jnp.maximum(num_neg, 1.0)))
  mixed = (num_pos > 0) & (num_neg > 0)
  return jnp.where(mixed, balanced, 1.0).reshape(-1)


def bce_with_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Elementwise −[y·log σ(x) + (1−y)·log(1−σ(x))] = softplus(x) − x·y;  ∂/∂x = σ(x) − y.

  Not torch's max(x, 0) − x·y + log1p(exp(−|x|)): the same values, but JAX differentiates its kinks at x = 0 to
  −y instead of ½ − y, and ψ = 0 exactly is common (r̂ = 0 whenever π_θ = π_ref). softplus = logaddexp(x, 0)
  has the exact gradient everywhere.
  """
  return jax.nn.softplus(logits) - logits * labels


def pacs_loss(logprobs: jax.Array, ref_logprobs: jax.Array, response_mask: jax.Array, rewards: jax.Array, *,
              group_size: int, beta: float = 1.0, reward_method: str = "1", adv_estimator: str = "rloo",
              norm_adv_by_std: bool = True, use_weight: bool = True, weight_mode: str = "question",
              sum_mask: jax.Array | None = None, is_weights: jax.Array | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """loss = (1/B) Σ_i w_i · BCEWithLogits(ψ_i, R_i)  (mean over the B responses, not divided by Σ w).

  logprobs, ref_logprobs, response_mask: [B, R]; rewards: [B] in {0, 1}. ref_logprobs carries no gradient.
  `sum_mask`: the positions r̂ sums (see `reward_proxy`). ∇loss = −(1/B) Σ_i w_i (R_i − σ(ψ_i)) ∇ψ_i.
  `is_weights` ρ [B]: the rollout correction's per-response weights (`correction.sequence_tis_weights`), no
  gradient; given, w_i becomes w_i · ρ_i (a response sampled by an older policy μ counts as π_old would sample it).
  Returns (loss, metrics).
  """
  logprobs = logprobs.astype(jnp.float32)
  ref_logprobs = jax.lax.stop_gradient(ref_logprobs.astype(jnp.float32))
  rewards = rewards.astype(jnp.float32)
  r_hat = reward_proxy(logprobs, ref_logprobs, response_mask, beta=beta, reward_method=reward_method,
                       sum_mask=sum_mask)  # [B]
  psi = score(r_hat, group_size=group_size, adv_estimator=adv_estimator, norm_adv_by_std=norm_adv_by_std)  # [B]
  weights = class_weights(rewards, group_size=group_size, use_weight=use_weight, weight_mode=weight_mode)  # [B]
  per_response = bce_with_logits(psi, rewards)  # [B]
  if is_weights is not None:
    weights = weights * jax.lax.stop_gradient(is_weights.astype(jnp.float32))
  loss = jnp.mean(weights * per_response)

  sg = jax.lax.stop_gradient
  psi, r_hat, per_response = sg(psi), sg(r_hat), sg(per_response)
  prob = jax.nn.sigmoid(psi)
  positive = rewards > 0.5
  num_pos = jnp.sum(positive)
  num_neg = positive.size - num_pos
  metrics = {
      "pacs/loss": sg(loss),
      "pacs/bce_unweighted": jnp.mean(per_response),
      "pacs/score_mean": jnp.mean(psi),
      "pacs/score_pos_mean": jnp.sum(jnp.where(positive, psi, 0.0)) / jnp.maximum(num_pos, 1),
      "pacs/score_neg_mean": jnp.sum(jnp.where(positive, 0.0, psi)) / jnp.maximum(num_neg, 1),
      "pacs/reward_proxy_mean": jnp.mean(r_hat),
      # 0 on each step's first mini-batch with the rollout policy as reference (the policy has not moved yet).
      "pacs/reward_proxy_abs_mean": jnp.mean(jnp.abs(r_hat)),
      "pacs/weight_mean": jnp.mean(weights),
      "pacs/prob_mean": jnp.mean(prob),
      # σ(ψ) > 0.5 (i.e. ψ > 0) read as "predicts correct": how often the implicit critic is right.
      "pacs/accuracy": jnp.mean(((prob > 0.5) == positive).astype(jnp.float32)),
      "pacs/reward_mean": jnp.mean(rewards),
      "pacs/response_length_mean": jnp.mean(jnp.sum((response_mask > 0).astype(jnp.float32), axis=-1)),
  }
  return loss, metrics


def padding_replication_inputs(input_ids: np.ndarray, attention_mask: np.ndarray, response_len: int,
                               pack_rows: int) -> tuple[np.ndarray, np.ndarray]:
  """(log-prob targets [B, R], sum mask [B, R]) that make r̂ the released one, term for term.

  The released actor (dp_actor._forward_micro_batch, use_remove_padding) packs a micro-batch's real tokens
  into one row (unpad_input), reads each position's log-prob of the next packed token (torch.roll by −1),
  scatters them back (pad_input: 0 at padding) and slices [:, -R-1:-1]; compute_reward then sums that slice
  without a mask. So a response of length ℓ < R adds, at slice position ℓ, the log-prob of the next packed
  row's first real token given this whole row; the last row of a micro-batch wraps to its first row's. Rows
  are packed in groups of `pack_rows` (ppo_micro_batch_size_per_gpu). The targets are the response tokens with
  that token at position ℓ, and the sum mask is the response mask plus position ℓ.

  input_ids, attention_mask: [B, P + R] host arrays, prompts left-padded, responses right-padded.
  """
  B, L = input_ids.shape
  P = L - response_len
  if B % pack_rows:
    raise ValueError(f"{B} rows do not split into verl micro-batches of {pack_rows} rows")
  first = input_ids[np.arange(B), np.argmax(attention_mask > 0, axis=1)]  # [B] first real token of each row
  following = np.arange(B) + 1
  following[pack_rows - 1::pack_rows] -= pack_rows  # the last row of each packed micro-batch wraps to its first
  lengths = attention_mask[:, P:].sum(axis=1)  # [B] response lengths
  targets = input_ids[:, P:].copy()
  sum_mask = attention_mask[:, P:].astype(np.float32)
  early = np.nonzero(lengths < response_len)[0]
  targets[early, lengths[early]] = first[following[early]]
  sum_mask[early, lengths[early]] = 1.0
  return targets, sum_mask


@dataclasses.dataclass(frozen=True)
class PacsSettings(Settings):
  """PACS (docs/algorithm.md): r̂ from log-prob ratios, ψ = advantage of r̂ in the group, BCE(ψ, R) with weights."""
  beta: float = setting(1.0, "β, the scale of r̂")
  reward_method: str = setting("1", '"1": β Σ (log π − log π_ref); "2": β Σ log π / |o|')
  adv_estimator: str = setting("rloo", "rloo | grpo | naive: ψ from r̂ in the group")
  norm_adv_by_std: bool = setting(True, "grpo estimator only: divide by the group's std")
  use_weight: bool = setting(True, "weight the BCE by class (weight_mode)")
  weight_mode: str = setting("question", "question | only_positive | only_negative")
  reference_policy: str = setting("frozen", "frozen (initial model) | rollout (the sampling policy, as released)")
  # Off: r̂ sums the masked response tokens (docs/algorithm.md). On: it also sums the term verl's remove-padding
  # forward leaves at the first padding position of a response that ended early: the log-prob of the next packed
  # row's first token given this row (rows packed in groups of train.verl_micro_batch_rows; the last wraps).
  exact_padding_replication: bool = setting(False, "add verl's first-padding-position term to r̂")

  def check(self, check):
    check(self.reward_method in REWARD_METHODS, "reward_method", f'"1" | "2", got {self.reward_method!r}')
    choice(check, self.adv_estimator, advantages_lib.names(), "adv_estimator")
    choice(check, self.weight_mode, WEIGHT_MODES, "weight_mode")
    choice(check, self.reference_policy, REFERENCE_POLICIES, "reference_policy")
    check(math.isfinite(self.beta), "beta", f"must be finite, got {self.beta}")


class Pacs(algorithms.Algorithm):
  """PACS on the shared loop: the reference is a frozen copy of the initial policy or the step's sampling policy."""

  min_group_size = 2
  settings_class = PacsSettings
  # Each BCE term is a whole response's: one importance weight per response (correction.sequence_tis_weights).
  supports_rollout_correction = True
  rollout_correction_level = "sequence"

  def validate(self, cfg, check, num_processes):
    t = cfg.train
    check(self.tis_cap(cfg) is None or self.tis_level(cfg) == "sequence", "rollout.tis_level",
          "PACS's loss has one term per response, so its rollout correction weighs responses: \"sequence\" "
          f"(or \"\"), got {self.tis_level(cfg)!r}")
    if self.settings(cfg).exact_padding_replication:
      local_rows = t.batch_prompts * cfg.rollout.n // max(num_processes, 1)
      check(local_rows % t.verl_micro_batch_rows == 0, "train.verl_micro_batch_rows",
            f"pacs.exact_padding_replication packs each process's {local_rows} rows in groups of "
            f"{t.verl_micro_batch_rows}, which must divide them")

  def reference(self, cfg):
    return algorithms.Reference(self.settings(cfg).reference_policy)  # "frozen" | "rollout"

  def needs_old_logprobs(self, cfg):  # the rollout reference, or π_old of the rollout correction
    return super().needs_old_logprobs(cfg) or self.tis_cap(cfg) is not None

  def extra_fields(self, cfg):
    if not self.settings(cfg).exact_padding_replication:
      return ()
    return (batch_lib.per_response("logprob_targets", jnp.int32, batch_lib.HOST),
            batch_lib.per_response("proxy_mask", jnp.float32, batch_lib.HOST))

  def host_inputs(self, objective, input_ids, attention_mask, response_len):
    if not objective.settings.exact_padding_replication:
      return {}
    targets, proxy_mask = padding_replication_inputs(input_ids, attention_mask, response_len,
                                                     objective.verl_micro_batch_rows)
    return {"logprob_targets": targets, "proxy_mask": proxy_mask}

  def advantage_estimator(self, settings):
    return estimator_name(settings.adv_estimator, settings.norm_adv_by_std)

  def logprob_targets(self, objective, batch):
    return batch["logprob_targets"] if objective.settings.exact_padding_replication else None

  def loss(self, objective, logprobs, entropy, micro):
    p = objective.settings
    sum_mask = micro.get("proxy_mask")
    if sum_mask is not None:  # less the inserted tokens: in the attention mask, out of the loss mask
      R = micro["loss_mask"].shape[-1]
      sum_mask = sum_mask - (micro["attention_mask"][:, -R:].astype(jnp.float32) - micro["loss_mask"])
    return pacs_loss(logprobs, micro["ref_logprobs"], micro["loss_mask"], micro["rewards"],
                     group_size=objective.group_size, beta=p.beta, reward_method=p.reward_method,
                     adv_estimator=objective.advantage_estimator, use_weight=p.use_weight,
                     weight_mode=p.weight_mode, sum_mask=sum_mask, is_weights=self.is_weights(objective, micro))

  def is_weights(self, objective, micro) -> jax.Array | None:
    """The rollout correction's per-response weights [m], or None without it (`rollout.tis_imp_ratio_cap` <= 0)."""
    cap = objective.tis_cap
    if cap is None:
      return None
    return correction.sequence_tis_weights(micro["old_logprobs"], micro["behaviour_logprobs"],
                                           micro["loss_mask"], cap)


algorithms.register("pacs", Pacs())
