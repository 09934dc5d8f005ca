"""PPO baseline: a critic (the policy family's backbone + scalar value head), GAE, clipped value loss (verl's core_algos.py).

Shapes: B rows (responses), L = P + R tokens, R response positions, D model width. The actor loss is GRPO's
clipped-ratio loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax.algos import algorithms, batch as batch_lib
from pacs_jax.algos.grpo import ClippedRatio, ClippedRatioSettings, agg_loss, clipped_policy_loss
from pacs_jax.algos.masked import masked_mean
from pacs_jax.algos.settings import setting
from pacs_jax.models import families
from pacs_jax.models.model_config import ModelConfig

# The actor side of PPO is the same clipped-ratio objective as GRPO, fed token-level GAE advantages.
policy_loss = clipped_policy_loss


class Critic(nnx.Module):
  """V(s_t) for every position: the backbone of the policy's family, then a scalar linear head (as HF's TokenClassification
  head with one label). values[b, t] is the value of the state after token t, so it lines up with the
  log-prob read from logits[b, t] (callers shift both the same way)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.model = families.backbone(config, rngs=rngs)
    init = nnx.initializers.normal(0.02)
    self.value_kernel = nnx.Param(init(rngs.params(), (config.hidden_size, 1), config.param_dtype),
                                  logical_axes=("embed", "value"))
    self.value_bias = nnx.Param(jnp.zeros((1,), config.param_dtype), logical_axes=("value",))

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, **packed) -> jax.Array:
    """input_ids, attention_mask: [B, L] -> values [B, L] fp32 (packed rows: `segment_ids` and `positions` as
    `decoder.Backbone`)."""
    hidden = self.model(input_ids, attention_mask, **packed)  # [B, L, D]
    # fp32 head: a D x 1 matmul costs nothing, and bf16 values would quantise the regression target.
    values = jnp.einsum("BLD,DO->BLO", hidden.astype(jnp.float32), self.value_kernel[...].astype(jnp.float32))
    return values[..., 0] + self.value_bias[...].astype(jnp.float32)[0]


def outcome_token_rewards(rewards: jax.Array, response_mask: jax.Array) -> jax.Array:
  """[B] outcome rewards -> [B, R] token rewards: the reward at each row's last response token, 0 elsewhere (verl)."""
  valid = response_mask > 0  # [B, R]
  R = valid.shape[-1]
  last = R - 1 - jnp.argmax(valid[:, ::-1], axis=-1)  # [B] index of the last valid position
  at_last = (jnp.arange(R)[None, :] == last[:, None]) & jnp.any(valid, axis=-1, keepdims=True)
  return jnp.where(at_last, rewards[:, None].astype(jnp.float32), 0.0)


def masked_whiten(values: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
  """(v − μ) / sqrt(σ² + eps) with μ, σ² (unbiased, n/(n−1)) over masked positions (verl's masked_whiten)."""
  mean = masked_mean(values, mask)
  n = jnp.sum((mask > 0).astype(jnp.float32))
  var = masked_mean((values - mean) ** 2, mask) * n / jnp.maximum(n - 1.0, 1.0)
  return (values - mean) * jax.lax.rsqrt(var + eps)


def critic_mask(attention_mask: jax.Array, response_len: int) -> jax.Array:
  """[B, L] -> [B, R]: attention_mask[:, -R-1:-1], the states the released critic is trained on (dp_critic.py
  update_critic, and compute_values zeroes the values outside it): the last prompt token's state (always
  real) and each response token's but the last, so a response that ended early also has the state after
  its EOS, with return 0."""
  L = attention_mask.shape[-1]
  return attention_mask[:, L - response_len - 1:L - 1]


def gae_advantages(token_level_rewards: jax.Array, values: jax.Array, response_mask: jax.Array, *,
                   gamma: float = 1.0, lam: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(advantages, returns), both [B, R], by the released verl's compute_gae_advantage_return (no gradient).

  Backwards over every position t (the released version has no mask in the loop; values are zero past the
  critic mask, see `critic_mask`):
    δ_t = r_t + γ·V_{t+1} − V_t  (V_R = 0),   Â_t = δ_t + γλ·Â_{t+1}
  returns = Â + V; the advantages are then whitened over `response_mask` (positions outside it set to 0; the
  actor loss never reads them).
  """
  sg = jax.lax.stop_gradient
  rewards = sg(token_level_rewards.astype(jnp.float32))
  values = sg(values.astype(jnp.float32))
  mask = (response_mask > 0).astype(jnp.float32)

  def step(carry, xs):
    next_value, next_gae = carry  # [B], [B]
    r, v = xs  # [B] each: position t
    gae = r + gamma * next_value - v + gamma * lam * next_gae
    return (v, gae), gae

  zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
  _, advantages = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T), reverse=True)  # [R, B]
  advantages = advantages.T
  returns = advantages + values
  advantages = jnp.where(mask > 0, masked_whiten(advantages, mask), 0.0)
  return advantages, returns


def clipped_value_loss(values_pred: jax.Array, returns: jax.Array, old_values: jax.Array,
                       mask: jax.Array, *, cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean",
                       micro_batch_rows: int = 1) -> tuple[jax.Array, dict[str, jax.Array]]:
  """agg(max((v − ret)², (v_clip − ret)²)), ret the returns, v_clip = clip(v, old − c, old + c); inputs [B, R].

  The released verl's compute_value_loss: no ½, the actor's loss_agg_mode (critic.loss_agg_mode follows it in
  ppo_trainer.yaml), and `mask` = `critic_mask`. The max means a prediction that moved more than c from the
  rollout-time value is only ever penalised more.
  """
  returns = jax.lax.stop_gradient(returns.astype(jnp.float32))
  old_values = jax.lax.stop_gradient(old_values.astype(jnp.float32))
  values_pred = values_pred.astype(jnp.float32)
  # verl's clip_by_value(vpreds, values - c, values + c): exactly v inside the range, so `vf_clipfrac` counts
  # only real clipping (old + clip(v - old) would round v and count rounding noise as clipped).
  clipped = jnp.clip(values_pred, old_values - cliprange_value, old_values + cliprange_value)
  losses1 = (values_pred - returns) ** 2
  losses2 = (clipped - returns) ** 2
  loss = agg_loss(jnp.maximum(losses1, losses2), mask, loss_agg_mode, micro_batch_rows)
  metrics = {
      "critic/vf_loss": jax.lax.stop_gradient(loss),
      "critic/vf_clipfrac": masked_mean((losses2 > losses1).astype(jnp.float32), mask),
      "critic/vpred_mean": jax.lax.stop_gradient(masked_mean(values_pred, mask)),
  }
  return loss, metrics


def step_advantages(minibatches: list[dict], *, gamma: float, lam: float) -> list[dict[str, jax.Array]]:
  """GAE advantages (whitened over the whole step's batch, as verl) and returns, per mini-batch [k, m, R]."""
  mask = jnp.concatenate([mb["loss_mask"].reshape(-1, mb["loss_mask"].shape[-1]) for mb in minibatches])
  rewards = jnp.concatenate([mb["rewards"].reshape(-1) for mb in minibatches])  # [rows]
  values = jnp.concatenate([mb["old_values"].reshape(-1, mask.shape[-1]) for mb in minibatches])  # [rows, R]
  advantages, returns = gae_advantages(outcome_token_rewards(rewards, mask), values, mask, gamma=gamma, lam=lam)
  out, start = [], 0
  for mb in minibatches:
    shape = mb["loss_mask"].shape
    rows = shape[0] * shape[1]
    out.append({"advantages": advantages[start:start + rows].reshape(shape),
                "returns": returns[start:start + rows].reshape(shape)})
    start += rows
  return out


@dataclasses.dataclass(frozen=True)
class PpoSettings(ClippedRatioSettings):
  """PPO: its actor is the same clipped-ratio loss as GRPO's (verl's actor block; `loss_agg_mode` is the actor's
  and the critic's), and a critic."""
  critic_lr: float = setting(1e-5, "the critic optimizer's learning rate")
  cliprange_value: float = setting(0.5, "the value loss's clip around the rollout-time values")
  gamma: float = setting(1.0, "GAE's discount γ")
  lam: float = setting(1.0, "GAE's λ")

  def check(self, check):
    super().check(check)
    check(self.critic_lr > 0, "critic_lr", f"must be positive, got {self.critic_lr}")


class Ppo(ClippedRatio):
  """PPO: a critic trained beside the policy, token-level GAE advantages for the clipped-ratio actor."""

  has_critic = True
  settings_class = PpoSettings
  # The actor's settings, read from the grpo block before PPO had its own (a resume upgrades such a checkpoint's
  # record from its saved grpo block; a config that still sets one there is refused, naming the new field).
  moved_settings = {f"ppo.{k}": f"grpo.{k}" for k in
                    ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "entropy_coeff")}

  def extra_fields(self, cfg):
    return (batch_lib.per_response("advantages", jnp.float32, batch_lib.STEP),
            batch_lib.per_response("returns", jnp.float32, batch_lib.STEP))

  def step_inputs(self, objective, minibatches):
    s = objective.settings
    return step_advantages(minibatches, gamma=s.gamma, lam=s.lam)

  def loss(self, objective, logprobs, entropy, micro):
    g = objective.settings
    return policy_loss(micro["old_logprobs"], logprobs, micro["advantages"], micro["loss_mask"],
                       clip_ratio_low=g.clip_ratio_low, clip_ratio_high=g.clip_ratio_high,
                       clip_ratio_c=g.clip_ratio_c, loss_agg_mode=self.loss_agg_mode(g),
                       micro_batch_rows=self.micro_batch_rows(objective),
                       is_weights=self.is_weights(objective, micro))

  def make_critic(self, model_config, rngs):
    return Critic(model_config, rngs=rngs)

  def critic_lr(self, cfg):
    return self.settings(cfg).critic_lr

  def critic_mask(self, micro):
    return critic_mask(micro["attention_mask"], micro["loss_mask"].shape[-1])

  def critic_loss(self, objective, values, micro):
    # The released critic (dp_critic.py update_critic): mask attention_mask[:, -R-1:-1], the actor's agg mode.
    s = objective.settings
    return clipped_value_loss(values, micro["returns"], micro["old_values"], self.critic_mask(micro),
                              cliprange_value=s.cliprange_value, loss_agg_mode=self.loss_agg_mode(s),
                              micro_batch_rows=self.micro_batch_rows(objective))


algorithms.register("ppo", Ppo())
