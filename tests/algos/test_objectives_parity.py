"""DAPO, Dr. GRPO and GSPO against today's verl, ported to torch below (fp32, as verl runs): loss and gradient at 1e-6,
for one micro-batch and for a mini-batch split into micro-batches (verl normalises each by the global mini-batch and
sums them; this project weights each by its share of the normaliser), plus DAPO's overlong reward shaping and its
dynamic-sampling group filter.

Ported from verl-project/verl @ 1dda039b: verl/trainer/ppo/core_algos.py (agg_loss, compute_grpo_outcome_advantage,
compute_policy_loss_vanilla, compute_policy_loss_gspo), verl/utils/torch_functional.py (masked_sum, masked_mean),
verl/workers/utils/losses.py (ppo_loss's entropy term), verl/workers/reward_manager/dapo.py (the overlong buffer);
and @ 9d77200 (the last with recipe/dapo in the tree): recipe/dapo/dapo_ray_trainer.py (filter_groups).
"""

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as registry, dapo

N = 4  # responses per prompt


# ----------------------------------------------------------------------------------------------
# verl, ported (names and statements as in verl; configs reduced to the fields read)


def masked_sum(values, mask, axis=None):
  valid_values = torch.where(mask.bool(), values, 0.0)
  return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
  s = masked_sum(values, mask, axis)
  return s / (mask.sum(axis=axis) + 1e-8)


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
  if loss_agg_mode == "token-mean":
    if batch_num_tokens is None:
      batch_num_tokens = loss_mask.sum()
    loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
  elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
    if global_batch_size is None:
      global_batch_size = seq_mask.sum()
    loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
      if loss_scale_factor is None:
        horizon = loss_mask.shape[-1]
        loss_scale_factor = horizon
      loss /= loss_scale_factor
  elif loss_agg_mode == "seq-mean-token-mean":
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    if global_batch_size is None:
      global_batch_size = seq_mask.sum()
    loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
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
      if len(id2score[idx]) == 1:
        id2mean[idx] = torch.tensor(0.0)
        id2std[idx] = torch.tensor(1.0)
      elif len(id2score[idx]) > 1:
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


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
  clip_ratio_low, clip_ratio_high, clip_ratio_c = config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c
  negative_approx_kl = log_prob - old_log_prob
  negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
  ratio = torch.exp(negative_approx_kl)
  ppo_kl = masked_mean(-negative_approx_kl, response_mask)
  pg_losses1 = -advantages * ratio
  pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
  clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
  pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
  pg_losses3 = -advantages * clip_ratio_c
  clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
  pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
  pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
  pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                     **config.global_batch_info)
  return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl,
                   "actor/pg_clipfrac_lower": pg_clipfrac_lower}


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
  clip_ratio_low, clip_ratio_high = config.clip_ratio_low, config.clip_ratio_high
  negative_approx_kl = log_prob - old_log_prob
  seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
  negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
  log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
  log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
  seq_importance_ratio = torch.exp(log_seq_importance_ratio)
  pg_losses1 = -advantages * seq_importance_ratio
  pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
  pg_losses = torch.maximum(pg_losses1, pg_losses2)
  pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode="seq-mean-token-mean",
                     **config.global_batch_info)
  pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
  ppo_kl = masked_mean(-negative_approx_kl, response_mask)
  return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl}


def ppo_loss(policy_loss_fn, config, log_prob, entropy, old_log_prob, advantages, response_mask):
  """verl/workers/utils/losses.py ppo_loss: the policy loss, then the entropy bonus in the same aggregation."""
  pg_loss, pg_metrics = policy_loss_fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                       response_mask=response_mask, loss_agg_mode=config.loss_agg_mode, config=config)
  entropy_loss = agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode,
                          **config.global_batch_info)
  return pg_loss - config.entropy_coeff * entropy_loss, pg_metrics


def overlong_reward(valid_response_length, max_resp_len, overlong_buffer_cfg):
  """DAPORewardManager.__call__, the overlong buffer's part (per response)."""
  overlong_buffer_len = overlong_buffer_cfg.len
  expected_len = max_resp_len - overlong_buffer_len
  exceed_len = valid_response_length - expected_len
  overlong_penalty_factor = overlong_buffer_cfg.penalty_factor
  overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
  return overlong_reward


def kept_trajectories(uids, metric_vals):
  """dapo_ray_trainer.fit, filter_groups: the indices of the trajectories of the prompts kept."""
  prompt_uid2metric_vals = defaultdict(list)
  for uid, metric_val in zip(uids, metric_vals, strict=True):
    prompt_uid2metric_vals[uid].append(metric_val)
  prompt_uid2metric_std = {}
  for prompt_uid, metric_vals in prompt_uid2metric_vals.items():
    prompt_uid2metric_std[prompt_uid] = np.std(metric_vals)
  kept_prompt_uids = [uid for uid, std in prompt_uid2metric_std.items()
                      if std > 0 or len(prompt_uid2metric_vals[uid]) == 1]
  kept_traj_idxs = []
  for idx, traj_from_prompt_uid in enumerate(uids):
    if traj_from_prompt_uid in kept_prompt_uids:
      kept_traj_idxs.append(idx)
  return kept_traj_idxs


# ----------------------------------------------------------------------------------------------
# The three objectives as verl's trainer runs them, and as this project's loop does


def rollout(seed=0, groups=6, R=10):
  rng = np.random.default_rng(seed)
  B = groups * N
  rewards = rng.integers(0, 2, B).astype(np.float32)
  rewards[:N] = 1.0  # a group whose verdicts agree (zero advantage)
  rewards[N:2 * N] = [0.0, 0.25, 1.0, 0.5]  # shaped rewards are not 0/1
  lengths = rng.integers(1, R + 1, B)
  mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.float32)
  old = rng.uniform(-3, 0, (B, R)).astype(np.float32)
  logp = (old + rng.normal(scale=0.3, size=(B, R))).astype(np.float32)  # token ratios ~0.5..2: every clip side
  entropy = rng.uniform(0, 2, (B, R)).astype(np.float32)
  junk = lambda: rng.uniform(-5, 5, (B, R)).astype(np.float32)  # noqa: E731  what padded positions hold
  logp, old, entropy = (np.where(mask > 0, a, junk()) for a in (logp, old, entropy))
  return dict(logprobs=logp, old_logprobs=old, response_mask=mask, rewards=rewards, entropy=entropy)


VERL = {  # name: (policy loss, actor config as verl's scripts set it, GRPO's norm_adv_by_std)
    "dapo": (compute_policy_loss_vanilla, dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0,
                                               loss_agg_mode="token-mean"), True),
    "drgrpo": (compute_policy_loss_vanilla, dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                                 loss_agg_mode="seq-mean-token-sum-norm"), False),
    "gspo": (compute_policy_loss_gspo, dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                                            loss_agg_mode="seq-mean-token-mean"), True),
}


def verl_update(name, batch, micro_rows, entropy_coeff=0.0):
  """(loss, d loss / d log_prob [B, R]) of verl's actor over a mini-batch in micro-batches of `micro_rows` rows:
  advantages over the whole batch, each micro-batch's loss normalised by the mini-batch's tokens / rows, summed."""
  policy_loss_fn, actor, norm = VERL[name]
  t = {k: torch.tensor(v) for k, v in batch.items()}
  B, R = t["response_mask"].shape
  token_level_rewards = torch.zeros(B, R)
  last = t["response_mask"].sum(-1).long() - 1
  token_level_rewards[torch.arange(B), last] = t["rewards"]
  index = np.repeat(np.arange(B // N), N)
  advantages, _ = compute_grpo_outcome_advantage(token_level_rewards, t["response_mask"], index,
                                                 norm_adv_by_std_in_grpo=norm)
  log_prob = t["logprobs"].clone().requires_grad_(True)
  global_info = dict(batch_num_tokens=t["response_mask"].sum(), global_batch_size=torch.tensor(float(B)))
  config = types.SimpleNamespace(**actor, entropy_coeff=entropy_coeff, global_batch_info=global_info)
  total, metrics = 0.0, []
  for start in range(0, B, micro_rows):
    rows = slice(start, start + micro_rows)
    loss, m = ppo_loss(policy_loss_fn, config, log_prob[rows], t["entropy"][rows], t["old_logprobs"][rows],
                       advantages[rows], t["response_mask"][rows])
    loss.backward()
    total, metrics = total + loss.item(), metrics + [m]
  return total, log_prob.grad.numpy(), {k: v.item() for k, v in metrics[0].items()}


def our_update(name, batch, micro_rows, entropy_coeff=0.0):
  """(loss, gradient) of the algorithm's loss hook accumulated as the train step does: Σ_j c_j ∇loss_j / Σ_j c_j,
  c_j the micro-batch's normaliser; and the first micro-batch's metrics."""
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.n = name, N
  cfg[name].entropy_coeff = entropy_coeff
  algo = registry.of(cfg)
  config_lib.validate(cfg, num_devices=1, check_paths=False)
  B = batch["rewards"].shape[0]
  losses, grads, weights, metrics = [], [], [], []
  for start in range(0, B, micro_rows):
    micro = {("loss_mask" if k == "response_mask" else k): jnp.asarray(v[start:start + micro_rows])
             for k, v in batch.items() if k not in ("logprobs", "entropy")}
    entropy = jnp.asarray(batch["entropy"][start:start + micro_rows])
    fn = lambda logp: algo.bind(cfg).loss(logp, entropy, micro)  # noqa: E731
    (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(batch["logprobs"][start:start + micro_rows]))
    losses, grads, metrics = losses + [loss], grads + [grad], metrics + [m]
    weights.append(algo.bind(cfg).normaliser(micro))
  total = sum(weights)
  loss = sum(w * l for w, l in zip(weights, losses)) / total
  grad = np.concatenate([np.asarray(w * g / total) for w, g in zip(weights, grads)])
  return float(loss), grad, {k: float(v) for k, v in metrics[0].items()}


@pytest.mark.parametrize("name", ["dapo", "drgrpo", "gspo"])
@pytest.mark.parametrize("micro_groups", [6, 2, 1])  # the whole mini-batch, then 3 and 6 micro-batches
def test_loss_and_gradient_equal_verls(name, micro_groups):
  batch = rollout(seed=micro_groups)
  want_loss, want_grad, want_metrics = verl_update(name, batch, micro_groups * N)
  loss, grad, metrics = our_update(name, batch, micro_groups * N)
  np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
  assert np.abs(want_grad).max() > 1e-3  # (a gradient that is all but zero would compare equal trivially)
  for key in want_metrics:  # the first micro-batch's
    np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=0, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", ["dapo", "drgrpo", "gspo"])
def test_entropy_bonus_equals_verls(name):
  batch = rollout(seed=7)
  want_loss, _, _ = verl_update(name, batch, 2 * N, entropy_coeff=0.01)
  loss, _, _ = our_update(name, batch, 2 * N, entropy_coeff=0.01)
  np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6)
  assert abs(want_loss - verl_update(name, batch, 2 * N)[0]) > 1e-4  # the bonus is felt


def test_clip_higher_lets_a_positive_advantage_ratio_grow_to_1_28():
  """One token, A > 0, ratio 1.25: GRPO's symmetric 0.2 clip holds its loss (no gradient); DAPO's 0.28 does not."""
  cfg = config_lib.default_config()
  cfg.rollout.n = 2
  micro = {"old_logprobs": jnp.zeros((2, 1)), "loss_mask": jnp.ones((2, 1)), "rewards": jnp.asarray([1.0, 0.0])}
  logp = jnp.log(jnp.asarray([[1.25], [1.0]], jnp.float32))
  grads = {}
  for name in ("grpo", "dapo"):
    cfg.algorithm = name
    grads[name] = jax.grad(lambda lp: registry.bind(cfg).loss(lp, jnp.zeros((2, 1)), micro)[0])(logp)
  assert grads["grpo"][0, 0] == 0.0
  assert grads["dapo"][0, 0] < -0.1


@pytest.mark.parametrize("max_resp_len, buffer_len, factor", [(20, 4, 1.0), (20, 20, 0.5), (7, 3, 2.0)])
def test_overlong_shaping_equals_verls(max_resp_len, buffer_len, factor):
  lengths = np.arange(1, max_resp_len + 1)
  buffer_cfg = types.SimpleNamespace(len=buffer_len, penalty_factor=factor)
  want = [float(overlong_reward(torch.tensor(int(n)), max_resp_len, buffer_cfg)) for n in lengths]
  got = dapo.overlong_penalty(lengths, max_response_len=max_resp_len, buffer_len=buffer_len, penalty_factor=factor)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  assert got[-1] == -factor  # at the budget
  assert buffer_len == max_resp_len or got[max_resp_len - buffer_len - 1] == 0.0  # none before the buffer
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.max_new_tokens = "dapo", max_resp_len
  cfg.dapo.overlong_buffer_len, cfg.dapo.overlong_penalty_factor = buffer_len, factor
  mask = (np.arange(max_resp_len)[None, :] < lengths[:, None]).astype(np.float32)
  scores = np.tile([1.0, 0.0], max_resp_len // 2 + 1)[:max_resp_len].astype(np.float32)
  np.testing.assert_allclose(registry.bind(cfg).shape_rewards(scores, mask), scores + np.asarray(want, np.float32),
                             rtol=0, atol=1e-6)
  cfg.dapo.overlong_buffer_len = 0  # off: the verdicts themselves
  np.testing.assert_array_equal(registry.bind(cfg).shape_rewards(scores, mask), scores)


@pytest.mark.parametrize("group_size", [4, 1])
def test_group_filter_equals_verls(group_size):
  rng = np.random.default_rng(group_size)
  scores = rng.integers(0, 2, 12 * group_size).astype(np.float32)
  scores[:group_size] = 1.0
  scores[group_size:2 * group_size] = 0.0
  uids = np.repeat([f"uid-{i}" for i in range(12)], group_size)
  kept = dapo.keep_groups(scores, group_size)
  assert list(np.nonzero(np.repeat(kept, group_size))[0]) == kept_trajectories(uids, scores)
  if group_size > 1:
    assert not kept[0] and not kept[1] and kept.any()
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.n = "dapo", group_size
  np.testing.assert_array_equal(registry.bind(cfg).keep_groups(scores), kept)
  cfg.dapo.filter_groups = False
  assert registry.bind(cfg).keep_groups(scores).all() and registry.bind(cfg).sampling_rounds == 1
