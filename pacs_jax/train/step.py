"""The pure train step `(state, minibatch) -> (state, metrics)` and the jitted log-prob / value passes it needs.

A mini-batch has a leading micro-batch axis: every array is [k, m, ...] with k micro-batches of m rows
(whole prompt groups). Gradients are accumulated over micro-batches weighted by each one's share of
the loss normaliser (responses for PACS, tokens or sequences for GRPO/PPO), so k micro-batches give
exactly the unsplit mini-batch's gradient. Shapes: L = P + R tokens (prompt left-padded to P,
response right-padded to R).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from pacs_jax.algos import grpo, logprobs as logprobs_lib, pacs, ppo
from pacs_jax.train.state import TrainState, skipped_updates, last_lr

Batch = dict[str, jax.Array]


def response_logprobs(model, input_ids, attention_mask, response_len: int, temperature: float,
                      with_entropy: bool = False, targets=None):
  """Log-probs [B, R] (and entropies) of the response tokens input_ids[:, P:] (or `targets` [B, R]) under
  logits / temperature.

  The hidden state at position t predicts token t + 1, so the response's predictors are [P-1, L-1).
  Logits are built chunk by chunk from hidden states, never as a full fp32 [B, R, V].
  """
  hidden = model.model(input_ids, attention_mask)  # [B, L, D]
  L = input_ids.shape[1]
  P = L - response_len
  targets = input_ids[:, P:] if targets is None else targets
  return logprobs_lib.token_logprobs_from_hidden(hidden[:, P - 1:L - 1], model.logits, targets,
                                                 temperature, with_entropy=with_entropy)


def response_values(critic, input_ids, attention_mask, response_len: int):
  """V [B, R] of the states before each response token (aligned with `response_logprobs`)."""
  values = critic(input_ids, attention_mask)  # [B, L]
  L = input_ids.shape[1]
  return values[:, L - response_len - 1:L - 1]


def loss_normaliser(cfg: ml_collections.ConfigDict, micro: Batch, mask: jax.Array | None = None) -> jax.Array:
  """What a loss over `mask` (default: the response mask) is a mean over, for this micro-batch: its
  accumulation weight."""
  rows = jnp.asarray(micro["rewards"].shape[0], jnp.float32)
  if cfg.algorithm == "pacs":
    return rows
  if cfg.grpo.loss_agg_mode == "token-mean":
    return jnp.sum((micro["response_mask"] if mask is None else mask).astype(jnp.float32))
  return rows


def policy_loss(cfg: ml_collections.ConfigDict, logp, entropy, micro: Batch):
  """The configured objective on one micro-batch -> (loss, metrics)."""
  mask = micro["response_mask"]
  if cfg.algorithm == "pacs":
    p = cfg.pacs
    return pacs.pacs_loss(logp, micro["ref_logprobs"], mask, micro["rewards"], group_size=cfg.rollout.n,
                          beta=p.beta, reward_method=p.reward_method, adv_estimator=p.adv_estimator,
                          norm_adv_by_std=p.norm_adv_by_std, use_weight=p.use_weight, weight_mode=p.weight_mode,
                          sum_mask=micro.get("proxy_mask"))
  g = cfg.grpo
  if cfg.algorithm == "grpo":
    return grpo.grpo_loss(logp, micro["old_logprobs"], micro.get("ref_logprobs"), mask, micro["rewards"],
                          group_size=cfg.rollout.n, norm_adv_by_std=g.norm_adv_by_std,
                          clip_ratio_low=g.clip_ratio_low, clip_ratio_high=g.clip_ratio_high,
                          clip_ratio_c=g.clip_ratio_c, loss_agg_mode=g.loss_agg_mode,
                          kl_loss_coef=g.kl_coef if g.use_kl_loss else 0.0, entropy=entropy,
                          entropy_coeff=g.entropy_coeff, micro_batch_rows=cfg.train.verl_micro_batch_rows)
  loss, metrics = ppo.policy_loss(micro["old_logprobs"], logp, micro["advantages"], mask,
                                  clip_ratio_low=g.clip_ratio_low, clip_ratio_high=g.clip_ratio_high,
                                  clip_ratio_c=g.clip_ratio_c, loss_agg_mode=g.loss_agg_mode,
                                  micro_batch_rows=cfg.train.verl_micro_batch_rows)
  return loss, metrics


def make_train_step(cfg: ml_collections.ConfigDict, graphdef, optimizer: optax.GradientTransformation,
                    critic_graphdef=None, critic_optimizer: optax.GradientTransformation | None = None
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """Builds the pure step: accumulate gradients over micro-batches, then one (possibly skipped) update."""
  temperature = cfg.rollout.temperature

  def micro_loss(params, micro):
    model = nnx.merge(graphdef, params)
    R = micro["response_mask"].shape[-1]
    logp, entropy = response_logprobs(model, micro["input_ids"], micro["attention_mask"], R, temperature,
                                      with_entropy=True, targets=micro.get("logprob_targets"))
    # The entropy only carries gradient when it is part of the objective (GRPO's entropy bonus).
    bonus = cfg.algorithm != "pacs" and cfg.grpo.entropy_coeff != 0
    loss, metrics = policy_loss(cfg, logp, entropy if bonus else jax.lax.stop_gradient(entropy), micro)
    metrics = dict(metrics)
    metrics["entropy"] = logprobs_lib.masked_mean(jax.lax.stop_gradient(entropy), micro["response_mask"])
    return loss, metrics

  def critic_loss(critic_params, micro):
    critic = nnx.merge(critic_graphdef, critic_params)
    R = micro["response_mask"].shape[-1]
    values = response_values(critic, micro["input_ids"], micro["attention_mask"], R)
    # The released critic (dp_critic.py update_critic): mask attention_mask[:, -R-1:-1], the actor's agg mode.
    return ppo.clipped_value_loss(values, micro["returns"], micro["old_values"],
                                  ppo.critic_mask(micro["attention_mask"], R),
                                  cliprange_value=cfg.ppo.cliprange_value, loss_agg_mode=cfg.grpo.loss_agg_mode,
                                  micro_batch_rows=cfg.train.verl_micro_batch_rows)

  def accumulate(loss_fn, params, minibatch, weight_fn):
    """Σ_j c_j ∇L_j / Σ_j c_j over micro-batches j (c_j = the loss normaliser of micro-batch j)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(carry, micro):
      grads_sum, metrics_sum, weight_sum = carry
      (loss, metrics), grads = grad_fn(params, micro)
      w = weight_fn(micro)
      metrics = dict(metrics, loss=loss)
      grads_sum = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), grads_sum, grads)
      metrics_sum = jax.tree.map(lambda a, m: a + w * m.astype(jnp.float32), metrics_sum, metrics)
      return (grads_sum, metrics_sum, weight_sum + w), None

    first = jax.tree.map(lambda x: x[0], minibatch)
    zeros_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    _, metrics_shape = jax.eval_shape(loss_fn, params, first)
    metrics_shape = dict(metrics_shape, loss=jax.ShapeDtypeStruct((), jnp.float32))
    zeros_metrics = jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), metrics_shape)
    (grads, metrics, total), _ = jax.lax.scan(body, (zeros_grads, zeros_metrics, jnp.float32(0)), minibatch)
    grads = jax.tree.map(lambda g, p: (g / total).astype(p.dtype), grads, params)
    metrics = jax.tree.map(lambda m: m / total, metrics)
    return grads, metrics

  def apply(optimizer, params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train_step(state: TrainState, minibatch: Batch) -> tuple[TrainState, dict]:
    grads, metrics = accumulate(micro_loss, state.params, minibatch, lambda m: loss_normaliser(cfg, m))
    metrics["grad_norm"] = optax.tree.norm(grads)
    params, opt_state = apply(optimizer, state.params, state.opt_state, grads)
    metrics["skipped_updates"] = skipped_updates(opt_state).astype(jnp.float32)
    metrics["lr"] = last_lr(opt_state)
    critic_params, critic_opt_state = state.critic_params, state.critic_opt_state
    if critic_graphdef is not None:
      value_weight = lambda m: loss_normaliser(cfg, m, ppo.critic_mask(m["attention_mask"], m["response_mask"].shape[-1]))
      critic_grads, critic_metrics = accumulate(critic_loss, critic_params, minibatch, value_weight)
      metrics.update({k if k.startswith("critic/") else f"critic/{k}": v for k, v in critic_metrics.items()})
      metrics["critic/grad_norm"] = optax.tree.norm(critic_grads)
      critic_params, critic_opt_state = apply(critic_optimizer, critic_params, critic_opt_state, critic_grads)
    state = state.replace(params=params, opt_state=opt_state, critic_params=critic_params,
                          critic_opt_state=critic_opt_state)
    return state, metrics

  return train_step


def make_logprob_fn(graphdef, temperature: float) -> Callable[[nnx.State, Batch], jax.Array]:
  """(params, minibatch [k, m, ...]) -> log-probs [k, m, R] of the responses (or of `logprob_targets`), one
  micro-batch at a time."""

  def fn(params, minibatch):
    R = minibatch["response_mask"].shape[-1]

    def one(micro):  # merged inside the mapped function's trace, so no module crosses a trace boundary
      model = nnx.merge(graphdef, params)
      return response_logprobs(model, micro["input_ids"], micro["attention_mask"], R, temperature,
                               targets=micro.get("logprob_targets"))

    keys = ("input_ids", "attention_mask", "response_mask", "logprob_targets")
    return jax.lax.map(one, {k: minibatch[k] for k in keys if k in minibatch})

  return fn


def make_value_fn(critic_graphdef) -> Callable[[nnx.State, Batch], jax.Array]:
  """(critic params, minibatch [k, m, ...]) -> values [k, m, R], zero outside `ppo.critic_mask` (as the released
  dp_critic.compute_values: values * attention_mask[:, -R-1:-1])."""

  def fn(critic_params, minibatch):
    R = minibatch["response_mask"].shape[-1]

    def one(micro):
      critic = nnx.merge(critic_graphdef, critic_params)
      values = response_values(critic, micro["input_ids"], micro["attention_mask"], R)
      return values * ppo.critic_mask(micro["attention_mask"], R).astype(values.dtype)

    return jax.lax.map(one, {k: minibatch[k] for k in ("input_ids", "attention_mask", "response_mask")})

  return fn


def ppo_advantages(cfg: ml_collections.ConfigDict, minibatches: list[Batch]) -> list[tuple[jax.Array, jax.Array]]:
  """GAE advantages (whitened over the whole step's batch, as verl) and returns, per mini-batch [k, m, R]."""
  mask = jnp.concatenate([mb["response_mask"].reshape(-1, mb["response_mask"].shape[-1]) for mb in minibatches])
  rewards = jnp.concatenate([mb["rewards"].reshape(-1) for mb in minibatches])
  values = jnp.concatenate([mb["old_values"].reshape(-1, mask.shape[-1]) for mb in minibatches])
  token_rewards = ppo.outcome_token_rewards(rewards, mask)
  advantages, returns = ppo.gae_advantages(token_rewards, values, mask, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam)
  out, start = [], 0
  for mb in minibatches:
    shape = mb["response_mask"].shape
    rows = shape[0] * shape[1]
    out.append((advantages[start:start + rows].reshape(shape), returns[start:start + rows].reshape(shape)))
    start += rows
  return out
