"""The rollout correction at the sequence level (rollout.tis_level "sequence", PACS's): one truncated importance
weight per response, against verl's sequence-level TIS ported to torch below, in PACS's loss against the float64 torch
PACS of test_pacs.py (1e-6); inert, bitwise, when off and when the behaviour policy is π_old; its config.

Ported from verl-project/verl @ 20c30bf8 (verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_correction_weights:
rollout_is="sequence" with a single float threshold, the TIS branch; verl/utils/torch_functional.py masked_sum).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pacs_jax import config as config_lib
from pacs_jax.algos import batch as batch_lib
from pacs_jax.algos import algorithms as registry, correction, pacs
from tests.algos.test_pacs import GROUP_SIZE, make_batch, torch_pacs_loss

SAFETY_BOUND = 20.0


# ----------------------------------------------------------------------------------------------
# verl, ported (statements as in verl, the metrics and the IcePop / batch-normalise branches left out)


def verl_masked_sum(values, mask, axis=None):
  valid_values = torch.where(mask.bool(), values, 0.0)
  return (valid_values * mask).sum(axis=axis)


def verl_sequence_weights(log_ratio, response_mask, rollout_is_threshold):
  log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
  log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
  raw_rollout_is_weights = torch.exp(log_ratio_sum_safe).expand_as(log_ratio)
  raw_rollout_is_weights = raw_rollout_is_weights * response_mask
  rollout_is_weights = raw_rollout_is_weights.clamp(max=rollout_is_threshold)
  return rollout_is_weights.detach()


# ----------------------------------------------------------------------------------------------


def behaviour_of(old, mask, seed, scale=0.3):
  """μ a little off π_old, a few tokens far off (a cap truncates them), one response 25 nats off (the ±20 clamp)."""
  rng = np.random.default_rng(seed)
  behaviour = old + rng.normal(0.0, scale, old.shape) + np.where(rng.random(old.shape) < 0.15, -1.5, 0.0)
  behaviour[3, 0] = old[3, 0] - 25.0
  return np.where(mask > 0, behaviour, 0.0).astype(np.float32)  # 0 past a response's end, as the engine gives


def pacs_config(cap: float, level: str = ""):
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.n = "pacs", GROUP_SIZE
  cfg.rollout.tis_imp_ratio_cap, cfg.rollout.tis_level = cap, level
  config_lib.validate(cfg, num_devices=1, check_paths=False)
  return cfg


@pytest.mark.parametrize("cap", [2.0, 1.1, 1e12])  # the usual cap, one that truncates most, one that only ±20 bounds
def test_sequence_weights_equal_verls(cap):
  logprobs, _, mask, _ = make_batch(seed=1)
  old = np.where(mask > 0, logprobs, -0.5).astype(np.float32)
  behaviour = behaviour_of(old, mask, seed=2)
  w = correction.sequence_tis_weights(jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask), cap)
  t_mask = torch.tensor(mask)
  want = verl_sequence_weights(torch.tensor(old) - torch.tensor(behaviour), t_mask, cap)
  assert w.shape == (mask.shape[0],)
  np.testing.assert_allclose(np.asarray(w)[:, None] * mask, want.numpy(), rtol=1e-6, atol=1e-6)
  assert not np.any(jax.grad(lambda o: correction.sequence_tis_weights(o, jnp.asarray(behaviour),
                                                                       jnp.asarray(mask), cap).sum())(jnp.asarray(old)))
  if cap == 1e12:
    assert float(w[3]) == pytest.approx(np.exp(20.0), rel=1e-6)  # clamped at e^20, as verl's SAFETY_BOUND


@pytest.mark.parametrize("cap", [2.0, 1.1])
@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_pacs_loss_with_the_correction_matches_torch(cap, estimator):
  logprobs, ref, mask, rewards = make_batch(seed=3)
  old = np.where(mask > 0, logprobs + 0.05, 0.0).astype(np.float32)
  behaviour = behaviour_of(old, mask, seed=4)
  cfg = pacs_config(cap)
  cfg.pacs.adv_estimator = estimator
  micro = {"ref_logprobs": jnp.asarray(ref), "loss_mask": jnp.asarray(mask), "rewards": jnp.asarray(rewards),
           "old_logprobs": jnp.asarray(old), "behaviour_logprobs": jnp.asarray(behaviour)}
  fn = lambda lp: registry.bind(cfg).loss(lp, None, micro)  # noqa: E731
  (loss, _), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logprobs))
  weights = verl_sequence_weights(torch.tensor(old) - torch.tensor(behaviour), torch.tensor(mask), cap)[:, 0]
  kw = dict(n=GROUP_SIZE, beta=1.0, reward_method="1", adv_estimator=estimator, norm_adv_by_std=True,
            use_weight=True, weight_mode="question")
  want_loss, want_grad = torch_pacs_loss(logprobs, ref, mask, rewards, is_weights=weights.numpy(), **kw)
  np.testing.assert_allclose(float(loss), want_loss, rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=0, atol=1e-6)
  plain_loss, _ = torch_pacs_loss(logprobs, ref, mask, rewards, **kw)
  assert abs(plain_loss - want_loss) > 1e-3  # the weights were applied
  assert 0 < float(weights.min()) < 1.0 and float(weights.max()) == np.float32(cap)


def test_inert_when_off_and_when_behaviour_is_pi_old():
  logprobs, ref, mask, rewards = make_batch(seed=5)
  old = np.where(mask > 0, logprobs - 0.1, 0.0).astype(np.float32)
  micro = {"ref_logprobs": jnp.asarray(ref), "loss_mask": jnp.asarray(mask), "rewards": jnp.asarray(rewards),
           "old_logprobs": jnp.asarray(old), "behaviour_logprobs": jnp.asarray(old)}

  def loss_and_grad(cfg, micro):
    fn = jax.jit(jax.value_and_grad(lambda lp: registry.bind(cfg).loss(lp, None, micro)[0]))
    return [np.asarray(x) for x in fn(jnp.asarray(logprobs))]

  plain = loss_and_grad(pacs_config(-1.0), {k: v for k, v in micro.items() if "old" not in k and "behav" not in k})
  corrected = loss_and_grad(pacs_config(2.0), micro)  # μ = π_old: every weight exactly 1
  for a, b in zip(plain, corrected):
    assert np.array_equal(a, b)
  assert np.all(np.asarray(correction.sequence_tis_weights(micro["old_logprobs"], micro["behaviour_logprobs"],
                                                           micro["loss_mask"], 2.0)) == 1.0)
  off = pacs_config(-1.0)
  assert registry.of(off).is_weights(registry.bind(off), micro) is None
  names = [f.name for f in registry.of(off).batch_fields(off)]
  assert "old_logprobs" not in names and "behaviour_logprobs" not in names  # the frozen reference: no extra pass


def test_sequence_stats():
  logprobs, _, mask, _ = make_batch(seed=6)
  old = np.where(mask > 0, logprobs, 0.0).astype(np.float32)
  behaviour = behaviour_of(old, mask, seed=7)
  stats = correction.importance_stats(jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask), 2.0, "sequence")
  ratio = np.exp(np.clip(((old - behaviour) * mask).sum(-1), -20, 20))
  np.testing.assert_allclose(stats["rollout_corr/is_weight_mean"], ratio.mean(), rtol=1e-5)
  np.testing.assert_allclose(stats["rollout_corr/is_weight_max"], ratio.max(), rtol=1e-6)
  np.testing.assert_allclose(stats["rollout_corr/tis_truncated_frac"], np.mean(ratio > 2.0), rtol=1e-6)


def test_config():
  cfg = pacs_config(2.0)
  algo = registry.of(cfg)
  assert algo.tis_level(cfg) == "sequence"
  fields = algo.batch_fields(cfg)
  assert batch_lib.OLD_LOGPROBS in fields and batch_lib.BEHAVIOUR_LOGPROBS in fields
  assert pacs_config(2.0, "sequence").rollout.tis_level == "sequence"
  with pytest.raises(config_lib.ConfigError, match="config.rollout.tis_level"):
    pacs_config(2.0, "token")
  with pytest.raises(config_lib.ConfigError, match="config.rollout.tis_level"):
    pacs_config(2.0, "geometric")
  grpo = config_lib.default_config()
  grpo.algorithm, grpo.rollout.tis_imp_ratio_cap = "grpo", 2.0
  assert registry.of(grpo).tis_level(grpo) == "token"  # GRPO's default is unchanged (verl's TIS)


def test_grpo_at_the_sequence_level_weighs_each_token_by_its_responses_weight():
  """verl applies a sequence weight to each of the response's tokens (expand_as): GRPO with rollout.tis_level
  "sequence" is its clipped loss with verl's [B, R] weights."""
  from pacs_jax.algos import grpo
  logprobs, _, mask, rewards = make_batch(seed=8)
  old = np.where(mask > 0, logprobs + 0.05, 0.0).astype(np.float32)
  behaviour = behaviour_of(old, mask, seed=9)
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.n, cfg.rollout.tis_imp_ratio_cap, cfg.rollout.tis_level = "grpo", GROUP_SIZE, 2.0, "sequence"
  config_lib.validate(cfg, num_devices=1, check_paths=False)
  micro = {"loss_mask": jnp.asarray(mask), "rewards": jnp.asarray(rewards), "old_logprobs": jnp.asarray(old),
           "behaviour_logprobs": jnp.asarray(behaviour)}
  loss = registry.bind(cfg).loss(jnp.asarray(logprobs), None, micro)[0]
  weights = verl_sequence_weights(torch.tensor(old) - torch.tensor(behaviour), torch.tensor(mask), 2.0).numpy()
  want = grpo.grpo_loss(jnp.asarray(logprobs), jnp.asarray(old), None, jnp.asarray(mask), jnp.asarray(rewards),
                        group_size=GROUP_SIZE, micro_batch_rows=cfg.train.verl_micro_batch_rows,
                        is_weights=jnp.asarray(weights))[0]
  np.testing.assert_allclose(float(loss), float(want), rtol=0, atol=1e-6)
  token = config_lib.default_config()
  token.algorithm, token.rollout.n, token.rollout.tis_imp_ratio_cap = "grpo", GROUP_SIZE, 2.0
  assert abs(float(registry.bind(token).loss(jnp.asarray(logprobs), None, micro)[0]) - float(loss)) > 1e-4
