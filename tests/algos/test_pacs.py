"""PACS loss against a PyTorch implementation of docs/algorithm.md, its analytic gradient, pinned numbers, padding."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pacs_jax.algos import pacs

GROUP_SIZE = 4
# (adv_estimator, norm_adv_by_std): rloo, grpo with and without std, naive.
ESTIMATORS = [("rloo", True), ("grpo", True), ("grpo", False), ("naive", True)]
WEIGHTS = [(False, "question")] + [(True, mode) for mode in pacs.WEIGHT_MODES]
COMBOS = list(itertools.product(["1", "2"], ESTIMATORS, WEIGHTS))
COMBO_IDS = [f"r{m}-{e}{'' if s else '-nostd'}-{'w_' + wm if w else 'noweight'}" for m, (e, s), (w, wm) in COMBOS]


def make_batch(seed=0, T=10, beta=1.0):
  """5 groups of 4: mixed labels (1 and 2 positives), all correct, all wrong, 3 positives; ragged lengths."""
  rng = np.random.default_rng(seed)
  rewards = np.array([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1], np.float32)
  N = rewards.size
  lengths = rng.integers(1, T + 1, size=N)
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  logprobs = rng.uniform(-3.0, 0.0, size=(N, T)).astype(np.float32)
  # Small policy/reference gaps keep ψ O(1) for reward_method "1", as in training.
  ref_logprobs = (logprobs + rng.normal(scale=0.15, size=(N, T))).astype(np.float32)
  # Padded positions hold junk: everything must mask them.
  logprobs = np.where(mask > 0, logprobs, rng.uniform(-30, 30, size=(N, T))).astype(np.float32)
  ref_logprobs = np.where(mask > 0, ref_logprobs, rng.uniform(-30, 30, size=(N, T))).astype(np.float32)
  return logprobs, ref_logprobs, mask, rewards


def torch_pacs_loss(logprobs, ref_logprobs, mask, rewards, *, n, beta, reward_method, adv_estimator,
                    norm_adv_by_std, use_weight, weight_mode, is_weights=None):
  """docs/algorithm.md written out in float64 torch; returns (loss, grad w.r.t. logprobs). `is_weights` [N]:
  per-response importance weights that multiply the class weights (the rollout correction)."""
  logp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
  ref = torch.tensor(ref_logprobs, dtype=torch.float64)
  m = torch.tensor(mask, dtype=torch.float64)
  R = torch.tensor(rewards, dtype=torch.float64)
  if reward_method == "1":
    r_hat = beta * ((logp - ref) * m).sum(-1)
  else:
    r_hat = beta * (logp * m).sum(-1) / m.sum(-1)
  g = r_hat.view(-1, n)
  if adv_estimator == "rloo":
    psi = g - (g.sum(-1, keepdim=True) - g) / (n - 1)
  elif adv_estimator == "grpo":
    psi = g - g.mean(-1, keepdim=True)
    if norm_adv_by_std:
      psi = psi / (g.std(-1, keepdim=True) + 1e-6)  # torch.std is unbiased (ddof=1)
  else:
    psi = g
  psi = psi.reshape(-1)
  labels = R.view(-1, n)
  if not use_weight:
    w = torch.ones_like(R)
  elif weight_mode == "only_positive":
    w = R.clone()
  elif weight_mode == "only_negative":
    w = 1 - R
  else:  # sklearn compute_class_weight("balanced") per group: n_samples / (n_classes · bincount)
    rows = []
    for group in labels:
      classes = torch.unique(group)
      counts = {float(c): float((group == c).sum()) for c in classes}
      rows.append(torch.tensor([n / (len(classes) * counts[float(y)]) for y in group], dtype=torch.float64))
    w = torch.cat(rows)
  if is_weights is not None:
    w = w * torch.as_tensor(is_weights, dtype=torch.float64)
  loss = torch.nn.BCEWithLogitsLoss(weight=w)(psi, R)  # reduction "mean": mean over N of w·bce
  loss.backward()
  return loss.item(), logp.grad.numpy()


def analytic_grad(logprobs, ref_logprobs, mask, rewards, *, n, beta, reward_method, adv_estimator, norm_adv_by_std,
                  weights):
  """−(1/N) Σ_i w_i (R_i − σ(ψ_i)) ∂ψ_i/∂logprobs in float64 numpy, with ∂ψ/∂r̂ worked out by hand."""
  lp, ref, m, R = (np.asarray(a, np.float64) for a in (logprobs, ref_logprobs, mask, rewards))
  N = R.size
  length = m.sum(-1)
  r_hat = beta * ((lp - ref) * m).sum(-1) if reward_method == "1" else beta * (lp * m).sum(-1) / length
  dr_dlogp = beta * m if reward_method == "1" else beta * m / length[:, None]  # ∂r̂_j/∂logp[j, t]
  psi = np.zeros(N)
  jac = np.zeros((N, N))  # ∂ψ_i/∂r̂_j, block diagonal per group
  eye, ones = np.eye(n), np.ones((n, n))
  for s in range(0, N, n):
    r = r_hat[s:s + n]
    c = r - r.mean()
    if adv_estimator == "naive":
      p, J = r, eye
    elif adv_estimator == "rloo":
      p, J = r - (r.sum() - r) / (n - 1), (n * eye - ones) / (n - 1)
    elif not norm_adv_by_std:
      p, J = c, eye - ones / n
    else:
      sd = np.sqrt((c * c).sum() / (n - 1))
      # ψ = c / (s + ε);  ∂s/∂r_j = c_j / ((n − 1) s)
      p = c / (sd + 1e-6)
      J = (eye - ones / n) / (sd + 1e-6) - np.outer(c, c) / ((n - 1) * sd * (sd + 1e-6) ** 2)
    psi[s:s + n], jac[s:s + n, s:s + n] = p, J
  dL_dpsi = -np.asarray(weights, np.float64) * (R - 1 / (1 + np.exp(-psi))) / N
  return (dL_dpsi @ jac)[:, None] * dr_dlogp


def jax_loss_and_grad(logprobs, ref_logprobs, mask, rewards, **kw):
  def loss_fn(lp):
    return pacs.pacs_loss(lp, ref_logprobs, mask, rewards, group_size=GROUP_SIZE, **kw)
  # Eager on purpose: per-op executables are cached across the ~70 configurations; a jit each would compile
  # the whole function every time (seconds each on a small CPU).
  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
  return float(loss), np.asarray(grad), metrics


@pytest.mark.parametrize("reward_method, estimator, weighting", COMBOS, ids=COMBO_IDS)
def test_loss_and_gradient_match_torch_and_analytic(reward_method, estimator, weighting):
  (adv_estimator, norm), (use_weight, weight_mode) = estimator, weighting
  beta = 2.0 if reward_method == "2" else 1.0  # β = 2 is the paper's other setting
  logprobs, ref_logprobs, mask, rewards = make_batch()
  kw = dict(beta=beta, reward_method=reward_method, adv_estimator=adv_estimator, norm_adv_by_std=norm,
            use_weight=use_weight, weight_mode=weight_mode)
  loss, grad, _ = jax_loss_and_grad(logprobs, ref_logprobs, mask, rewards, **kw)
  want_loss, torch_grad = torch_pacs_loss(logprobs, ref_logprobs, mask, rewards, n=GROUP_SIZE, **kw)
  np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6)
  np.testing.assert_allclose(grad, torch_grad, rtol=0, atol=1e-6)
  weights = pacs.class_weights(jnp.asarray(rewards), group_size=GROUP_SIZE, use_weight=use_weight,
                               weight_mode=weight_mode)
  want_grad = analytic_grad(logprobs, ref_logprobs, mask, rewards, n=GROUP_SIZE, beta=beta,
                            reward_method=reward_method, adv_estimator=adv_estimator, norm_adv_by_std=norm,
                            weights=weights)
  np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
  assert np.all(grad[mask == 0] == 0)


# ----------------------------------------------------------------------------------------------
# Hand-computed numbers


def test_pinned_advantages():
  r = jnp.array([[1.0, 2.0, 3.0]])
  np.testing.assert_allclose(pacs.rloo_advantage(r), [[-1.5, 0.0, 1.5]], rtol=1e-7)
  # mean 2, unbiased std 1
  np.testing.assert_allclose(pacs.grpo_advantage(r), [[-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)]], rtol=1e-7)
  np.testing.assert_allclose(pacs.grpo_advantage(r, norm_adv_by_std=False), [[-1.0, 0.0, 1.0]], rtol=1e-7)
  flat = jnp.array([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])
  np.testing.assert_allclose(pacs.score(flat, group_size=3, adv_estimator="rloo"), [-1.5, 0, 1.5, 0, 0, 0], atol=1e-7)
  np.testing.assert_allclose(pacs.score(flat, group_size=3, adv_estimator="naive"), flat)


def test_pinned_weights():
  R = jnp.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0], jnp.float32)
  kw = dict(group_size=4)
  # 1 positive of 4: 4 / (2·1) = 2, negatives 4 / (2·3) = 2/3; all-equal groups: 1; 2 of 4: 1.
  np.testing.assert_allclose(pacs.class_weights(R, **kw),
                             [2, 2 / 3, 2 / 3, 2 / 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], rtol=1e-7)
  np.testing.assert_array_equal(pacs.class_weights(R, weight_mode="only_positive", **kw), R)
  np.testing.assert_array_equal(pacs.class_weights(R, weight_mode="only_negative", **kw), 1 - R)
  np.testing.assert_array_equal(pacs.class_weights(R, use_weight=False, **kw), np.ones(16))


def test_pinned_reward_proxy_and_loss():
  logprobs = jnp.array([[-1.0, -3.0, 7.0], [-0.5, -0.5, -0.5]])
  ref = jnp.array([[-1.5, -3.0, 9.0], [-0.5, 0.0, 3.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 0]])
  # "1": β Σ (logp − ref) over the mask = 2·[0.5, −0.5];  "2": β Σ logp / |o| = 2·[−2, −0.5]
  np.testing.assert_allclose(pacs.reward_proxy(logprobs, ref, mask, beta=2.0, reward_method="1"), [1.0, -1.0])
  np.testing.assert_allclose(pacs.reward_proxy(logprobs, ref, mask, beta=2.0, reward_method="2"), [-4.0, -1.0])
  # r̂ = [0.5, −0.5] -> rloo ψ = [1, −1]; R = [1, 0]; weights 2/(2·1) = 1 each.
  # BCE(1, 1) = BCE(−1, 0) = log(1 + e^−1), so the loss is that number.
  loss, metrics = pacs.pacs_loss(logprobs, ref, mask, jnp.array([1.0, 0.0]), group_size=2)
  np.testing.assert_allclose(loss, np.log1p(np.exp(-1.0)), rtol=1e-6)
  np.testing.assert_allclose(metrics["pacs/score_mean"], 0.0, atol=1e-7)
  np.testing.assert_allclose(metrics["pacs/reward_proxy_mean"], 0.0, atol=1e-7)
  np.testing.assert_allclose(metrics["pacs/weight_mean"], 1.0)
  np.testing.assert_allclose(metrics["pacs/accuracy"], 1.0)  # ψ > 0 exactly where R = 1
  _, metrics = pacs.pacs_loss(logprobs, ref, mask, jnp.array([0.0, 1.0]), group_size=2)
  np.testing.assert_allclose(metrics["pacs/accuracy"], 0.0)


def test_pinned_bce():
  psi = jnp.array([0.0, 0.0, 2.0, -3.0, 40.0])
  R = jnp.array([1.0, 0.0, 0.0, 0.0, 0.0])
  want = [np.log(2), np.log(2), 2 + np.log1p(np.exp(-2)), np.log1p(np.exp(-3)), 40.0]
  np.testing.assert_allclose(pacs.bce_with_logits(psi, R), want, rtol=1e-6)
  # ∂/∂ψ = σ(ψ) − R, also at ψ = 0 exactly (where a max/abs formulation differentiates wrongly)
  grad = jax.grad(lambda x: jnp.sum(pacs.bce_with_logits(x, R)))(psi)
  np.testing.assert_allclose(grad, 1 / (1 + np.exp(-np.asarray(psi, np.float64))) - np.asarray(R), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# Invariances and edge cases


@pytest.mark.parametrize("reward_method", ["1", "2"])
@pytest.mark.parametrize("adv_estimator, norm", ESTIMATORS)
def test_padding_invariance(reward_method, adv_estimator, norm):
  logprobs, ref_logprobs, mask, rewards = make_batch(seed=1, T=8)
  kw = dict(reward_method=reward_method, adv_estimator=adv_estimator, norm_adv_by_std=norm)
  loss, grad, _ = jax_loss_and_grad(logprobs, ref_logprobs, mask, rewards, **kw)
  rng = np.random.default_rng(7)
  N, extra = rewards.size, 5

  def pad(a, values):
    return np.concatenate([a, values], axis=1).astype(np.float32)

  loss2, grad2, _ = jax_loss_and_grad(pad(logprobs, rng.uniform(-1e3, 1e3, (N, extra))),
                                      pad(ref_logprobs, rng.uniform(-1e3, 1e3, (N, extra))),
                                      pad(mask, np.zeros((N, extra))), rewards, **kw)
  assert loss2 == loss
  np.testing.assert_array_equal(grad2[:, :8], grad)
  assert np.all(grad2[:, 8:] == 0)


def test_grpo_with_all_equal_reward_proxy_has_finite_gradient():
  """π_θ = π_ref (the first step with a frozen reference) makes r̂ = 0 in every group: std = 0 must not NaN."""
  logprobs, _, mask, rewards = make_batch(seed=2)
  _, grad, _ = jax_loss_and_grad(logprobs, logprobs, mask, rewards, adv_estimator="grpo")
  assert np.all(np.isfinite(grad))
  # With zero spread only the mean-centring path remains: ∂ψ_i/∂r̂_j = (δ_ij − 1/n) / ε.
  weights = pacs.class_weights(jnp.asarray(rewards), group_size=GROUP_SIZE)
  dL_dpsi = -np.asarray(weights) * (rewards - 0.5) / rewards.size
  centred = dL_dpsi.reshape(-1, GROUP_SIZE) - dL_dpsi.reshape(-1, GROUP_SIZE).mean(-1, keepdims=True)
  np.testing.assert_allclose(grad, centred.reshape(-1)[:, None] * mask / 1e-6, rtol=1e-5)


def test_bad_arguments_raise():
  logprobs, ref_logprobs, mask, rewards = make_batch()
  with pytest.raises(ValueError, match="reward_method"):
    pacs.pacs_loss(logprobs, ref_logprobs, mask, rewards, group_size=4, reward_method="3")
  with pytest.raises(ValueError, match="adv_estimator"):
    pacs.pacs_loss(logprobs, ref_logprobs, mask, rewards, group_size=4, adv_estimator="gae")
  with pytest.raises(ValueError, match="weight_mode"):
    pacs.pacs_loss(logprobs, ref_logprobs, mask, rewards, group_size=4, weight_mode="balanced")
  with pytest.raises(ValueError, match="groups of 3"):
    pacs.pacs_loss(logprobs, ref_logprobs, mask, rewards, group_size=3)
