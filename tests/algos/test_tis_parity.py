"""The rollout correction (rollout.tis_imp_ratio_cap) against the released verl's truncated importance sampling, ported
to torch below (fp32): GRPO's and PPO's loss and gradient at 1e-6, with caps that truncate some tokens and none;
the weights themselves; off by default, and refused for an objective without it.

Ported from verl-project/verl @ 7f27789 (2025-10-13, the last commit with `tis_imp_ratio_cap`, added in b8dc5377c):
verl/trainer/ppo/core_algos.py (agg_loss, compute_grpo_outcome_advantage, compute_policy_loss_vanilla),
verl/utils/torch_functional.py (masked_sum, masked_mean).
"""

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pacs_jax import config as config_lib
from pacs_jax.algos import batch as batch_lib
from pacs_jax.algos import algorithms as registry, correction

N, GROUPS, R = 4, 3, 7  # responses per prompt, prompts, response positions
B = N * GROUPS


# ----------------------------------------------------------------------------------------------
# verl, ported (names and statements as in verl; configs reduced to the fields read)


def masked_sum(values, mask, axis=None):
  valid_values = torch.where(mask.bool(), values, 0.0)
  return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
  s = masked_sum(values, mask, axis)
  return s / (mask.sum(axis=axis) + 1e-8)


def agg_loss(loss_mat, loss_mask, loss_agg_mode):
  if loss_agg_mode == "token-mean":
    loss = masked_mean(loss_mat, loss_mask)
  elif loss_agg_mode == "seq-mean-token-sum":
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    loss = torch.mean(seq_losses)
  elif loss_agg_mode == "seq-mean-token-mean":
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1)
    loss = torch.mean(seq_losses)
  elif loss_agg_mode == "seq-mean-token-sum-norm":
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    loss = torch.sum(seq_losses) / loss_mask.shape[-1]
  else:
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
  return loss


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
  scores = token_level_rewards.sum(dim=-1)
  id2score = defaultdict(list)
  id2mean = {}
  id2std = {}
  with torch.no_grad():
    bsz = scores.shape[0]
    for i in range(bsz):
      id2score[index[i]].append(scores[i])
    for idx in id2score:
      scores_tensor = torch.stack(id2score[idx])
      id2mean[idx] = torch.mean(scores_tensor)
      id2std[idx] = torch.std(scores_tensor)
    for i in range(bsz):
      if norm_adv_by_std_in_grpo:
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
      else:
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1) * response_mask
  return scores, scores


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_log_probs=None):
  clip_ratio = config.clip_ratio
  clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
  clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
  clip_ratio_c = config.get("clip_ratio_c", 3.0)
  cliprange = clip_ratio
  cliprange_low = clip_ratio_low
  cliprange_high = clip_ratio_high
  negative_approx_kl = log_prob - old_log_prob
  negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
  ratio = torch.exp(negative_approx_kl)
  ppo_kl = masked_mean(-negative_approx_kl, response_mask)
  pg_losses1 = -advantages * ratio
  if cliprange_low is None:
    cliprange_low = cliprange
  if cliprange_high is None:
    cliprange_high = cliprange
  pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
  clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
  pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
  pg_losses3 = -advantages * clip_ratio_c
  clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
  pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
  pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
  if config.tis_imp_ratio_cap > 0 and rollout_log_probs is not None:
    # Apply truncated importance sampling -> https://fengyao.notion.site/off-policy-rl
    tis_imp_ratio = torch.exp(old_log_prob - rollout_log_probs)
    tis_imp_ratio = torch.clamp(tis_imp_ratio, max=config.tis_imp_ratio_cap)
    pg_losses = pg_losses * tis_imp_ratio
  pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
  return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


class ActorConfig(types.SimpleNamespace):
  def get(self, key, default=None):
    return getattr(self, key, default)


# ----------------------------------------------------------------------------------------------


def rollout(seed: int) -> dict[str, np.ndarray]:
  """A mini-batch of GROUPS groups of N: π_old, the behaviour policy μ a little off it (some tokens far off, so a
  cap truncates them), the policy after some updates, rewards, responses of different lengths."""
  rng = np.random.default_rng(seed)
  old = rng.uniform(-3.0, -0.05, (B, R)).astype(np.float32)
  behaviour = (old + rng.normal(0.0, 0.3, (B, R)) + np.where(rng.random((B, R)) < 0.15, -1.5, 0.0)).astype(np.float32)
  lengths = rng.integers(1, R + 1, B)
  return {"old_logprobs": old, "behaviour_logprobs": np.minimum(behaviour, 0.0).astype(np.float32),
          "logprobs": (old + rng.normal(0.0, 0.15, (B, R))).astype(np.float32),
          "response_mask": (np.arange(R)[None] < lengths[:, None]).astype(np.float32),
          "rewards": rng.integers(0, 2, B).astype(np.float32),
          "advantages": rng.normal(0.0, 1.0, (B, R)).astype(np.float32)}


def verl_loss(name: str, batch, cap: float, mode: str) -> tuple[float, np.ndarray]:
  t = {k: torch.tensor(v) for k, v in batch.items()}
  if name == "grpo":
    token_rewards = torch.zeros(B, R)
    token_rewards[torch.arange(B), t["response_mask"].sum(-1).long() - 1] = t["rewards"]
    advantages, _ = compute_grpo_outcome_advantage(token_rewards, t["response_mask"], np.arange(B) // N)
  else:
    advantages = t["advantages"]
  log_prob = t["logprobs"].clone().requires_grad_(True)
  config = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                       tis_imp_ratio_cap=cap)
  loss, *_ = compute_policy_loss_vanilla(t["old_logprobs"], log_prob, advantages, t["response_mask"], mode, config,
                                         rollout_log_probs=t["behaviour_logprobs"])
  loss.backward()
  return loss.item(), log_prob.grad.numpy()


def config(name: str, cap: float, mode: str):
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.n, cfg.rollout.tis_imp_ratio_cap = name, N, cap
  cfg[name].clip_ratio_low, cfg[name].clip_ratio_high, cfg[name].loss_agg_mode = 0.2, 0.28, mode
  cfg.train.verl_micro_batch_rows = B  # verl's micro-batch: the whole mini-batch (its sum / R mode)
  config_lib.validate(cfg, num_devices=1, check_paths=False)
  return cfg


def our_loss(name: str, batch, cap: float, mode: str) -> tuple[float, np.ndarray]:
  cfg = config(name, cap, mode)
  algo = registry.of(cfg)
  micro = {("loss_mask" if k == "response_mask" else k): jnp.asarray(v) for k, v in batch.items() if k != "logprobs"}
  fn = lambda logp: algo.bind(cfg).loss(logp, jnp.zeros((B, R)), micro)[0]  # noqa: E731
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(batch["logprobs"]))
  return float(loss), np.asarray(grad)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
@pytest.mark.parametrize("cap", [2.0, 1.1, 100.0])  # the usual cap, one that truncates many tokens, one that none
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_loss_and_gradient_equal_verls_tis(name, cap, mode):
  batch = rollout(seed=int(cap * 10))
  want_loss, want_grad = verl_loss(name, batch, cap, mode)
  loss, grad = our_loss(name, batch, cap, mode)
  np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
  assert np.abs(want_grad).max() > 1e-3
  # The correction changes the loss (else the comparison would not show it was applied).
  untruncated, _ = verl_loss(name, batch, -1.0, mode)
  assert abs(untruncated - want_loss) > 1e-4


def test_the_weights_are_truncated_ratios_without_gradient():
  batch = rollout(seed=0)
  old, behaviour = jnp.asarray(batch["old_logprobs"]), jnp.asarray(batch["behaviour_logprobs"])
  w = correction.tis_weights(old, behaviour, 2.0)
  np.testing.assert_allclose(w, np.minimum(np.exp(batch["old_logprobs"] - batch["behaviour_logprobs"]), 2.0),
                             rtol=1e-6)
  assert float(w.max()) == 2.0 and float(w.min()) < 1.0
  assert not np.any(jax.grad(lambda o: correction.tis_weights(o, behaviour, 2.0).sum())(old))
  stats = correction.importance_stats(old, behaviour, jnp.asarray(batch["response_mask"]), 2.0)
  on = batch["response_mask"] > 0
  ratio = np.exp(batch["old_logprobs"] - batch["behaviour_logprobs"])[on]
  np.testing.assert_allclose(stats["rollout_corr/is_weight_mean"], ratio.mean(), rtol=1e-5)
  np.testing.assert_allclose(stats["rollout_corr/is_weight_max"], ratio.max(), rtol=1e-6)
  np.testing.assert_allclose(stats["rollout_corr/tis_truncated_frac"], np.mean(ratio > 2.0), rtol=1e-6)


def test_off_by_default_and_only_where_tested():
  cfg = config_lib.default_config()
  for name in ("grpo", "ppo", "pacs"):
    cfg.algorithm = name
    assert batch_lib.BEHAVIOUR_LOGPROBS not in registry.of(cfg).batch_fields(cfg)
  cfg = config("grpo", 2.0, "token-mean")
  assert batch_lib.BEHAVIOUR_LOGPROBS in registry.of(cfg).batch_fields(cfg)
  cfg.algorithm = "dapo"
  with pytest.raises(config_lib.ConfigError, match="config.rollout.tis_imp_ratio_cap"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)
