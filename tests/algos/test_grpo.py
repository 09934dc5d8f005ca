"""GRPO loss against a PyTorch implementation of verl's formulas in every aggregation mode; clip behaviour."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pacs_jax.algos import grpo

GROUP_SIZE = 4


def make_batch(seed=0, T=9):
  rng = np.random.default_rng(seed)
  rewards = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0], np.float32)  # mixed, all-correct, two of four
  N = rewards.size
  lengths = rng.integers(1, T + 1, size=N)
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  old = rng.uniform(-3, 0, size=(N, T)).astype(np.float32)
  # Ratios from about 0.4 to 2.5, so both clip sides and the dual clip are exercised.
  logprobs = (old + rng.normal(scale=0.4, size=(N, T))).astype(np.float32)
  ref = (old + rng.normal(scale=0.3, size=(N, T))).astype(np.float32)
  entropy = rng.uniform(0, 2, size=(N, T)).astype(np.float32)
  junk = lambda: rng.uniform(-50, 50, size=(N, T))  # noqa: E731  padded positions hold garbage
  logprobs, old, ref, entropy = (np.where(mask > 0, a, junk()).astype(np.float32)
                                 for a in (logprobs, old, ref, entropy))
  return logprobs, old, ref, mask, rewards, entropy


def torch_agg(loss_mat, mask, mode):
  if mode == "token-mean":
    return (loss_mat * mask).sum() / mask.sum()
  seq = (loss_mat * mask).sum(-1)
  if mode == "seq-mean-token-sum":
    return seq.mean()
  if mode == "seq-mean-token-mean":
    return (seq / mask.sum(-1)).mean()
  return (seq / mask.shape[-1]).mean()  # seq-mean-token-sum-norm


def torch_grpo_loss(logprobs, old, ref, mask, rewards, entropy, *, n, norm_adv_by_std, mode, clip_low, clip_high,
                    clip_c, kl_coef, entropy_coeff):
  """verl's GRPO advantage + compute_policy_loss_vanilla + low_var_kl + entropy, in float64 torch."""
  to = lambda a: torch.tensor(np.asarray(a), dtype=torch.float64)  # noqa: E731
  logp = to(logprobs).requires_grad_(True)
  old, ref, m, R, ent = to(old), to(ref), to(mask), to(rewards), to(entropy)
  # Padded junk is zeroed first, as verl's inputs are (torch's 0·inf would be NaN); the jax side gets the junk.
  logp_in, old, ref, ent = logp * m, old * m, ref * m, ent * m
  g = R.view(-1, n)
  adv = g - g.mean(-1, keepdim=True)
  if norm_adv_by_std:
    adv = adv / (g.std(-1, keepdim=True) + 1e-6)
  A = adv.reshape(-1, 1).expand_as(m)
  neg_kl = torch.clamp(logp_in - old, -20.0, 20.0)
  ratio = torch.exp(neg_kl)
  l1 = -A * ratio
  l2 = -A * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
  c1 = torch.maximum(l1, l2)
  l3 = -A * clip_c
  c2 = torch.min(l3, c1)
  pg = torch.where(A < 0, c2, c1)
  loss = torch_agg(pg, m, mode)
  loss = loss - entropy_coeff * torch_agg(ent, m, mode)
  if kl_coef:
    kl = torch.clamp(ref - logp_in, -20, 20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
    loss = loss + kl_coef * torch_agg(kld, m, mode)
  loss.backward()
  metrics = dict(clipfrac=((l2 > l1).double() * m).sum() / m.sum(),
                 clipfrac_lower=((c1 > l3) & (A < 0)).double().mul(m).sum() / m.sum(),
                 ppo_kl=(-neg_kl * m).sum() / m.sum())
  return loss.item(), logp.grad.numpy(), {k: v.item() for k, v in metrics.items()}


CASES = list(itertools.product(grpo.LOSS_AGG_MODES, [True, False], [(0.0, 0.0), (0.1, 0.01)]))


@pytest.mark.parametrize("mode, norm, coefs", CASES,
                         ids=[f"{m}-{'std' if s else 'nostd'}-{'kl_ent' if c[0] else 'plain'}" for m, s, c in CASES])
def test_grpo_loss_matches_torch(mode, norm, coefs):
  kl_coef, entropy_coeff = coefs
  logprobs, old, ref, mask, rewards, entropy = make_batch()
  kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)

  def loss_fn(lp):
    return grpo.grpo_loss(lp, old, ref, mask, rewards, group_size=GROUP_SIZE, norm_adv_by_std=norm,
                          loss_agg_mode=mode, kl_loss_coef=kl_coef, entropy=entropy, entropy_coeff=entropy_coeff, **kw)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
  want, want_grad, want_metrics = torch_grpo_loss(
      logprobs, old, ref, mask, rewards, entropy, n=GROUP_SIZE, norm_adv_by_std=norm, mode=mode, clip_low=0.2,
      clip_high=0.28, clip_c=3.0, kl_coef=kl_coef, entropy_coeff=entropy_coeff)
  np.testing.assert_allclose(float(loss), want, rtol=0, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
  np.testing.assert_allclose(metrics["actor/pg_clipfrac"], want_metrics["clipfrac"], atol=1e-7)
  np.testing.assert_allclose(metrics["actor/pg_clipfrac_lower"], want_metrics["clipfrac_lower"], atol=1e-7)
  np.testing.assert_allclose(metrics["actor/ppo_kl"], want_metrics["ppo_kl"], atol=1e-6)
  assert 0 < want_metrics["clipfrac"] < 1  # the data does exercise clipping
  assert np.all(np.asarray(grad)[mask == 0] == 0)


def test_pinned_group_advantages():
  R = jnp.array([1.0, 0, 0, 0, 1, 1, 1, 1])
  # mean 1/4; unbiased std sqrt((9/16 + 3/16) / 3) = 1/2
  np.testing.assert_allclose(grpo.group_advantages(R, group_size=4),
                             np.array([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(grpo.group_advantages(R, group_size=4, norm_adv_by_std=False),
                             [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], rtol=1e-6)


def test_pinned_aggregation_modes():
  loss = jnp.array([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
  mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
  expected = {"token-mean": 10 / 4, "seq-mean-token-sum": (6 + 4) / 2, "seq-mean-token-mean": (2 + 4) / 2,
              "seq-mean-token-sum-norm": (6 / 4 + 4 / 4) / 2}
  for mode, want in expected.items():
    np.testing.assert_allclose(grpo.agg_loss(loss, mask, mode), want, rtol=1e-7, err_msg=mode)
  with pytest.raises(ValueError, match="loss_agg_mode"):
    grpo.agg_loss(loss, mask, "token-sum")


def test_clipping_and_dual_clip():
  """Per-token losses with one token per row (token-mean over 1 token = the token's loss)."""
  mask = jnp.ones((1, 1))

  def token_loss(ratio, advantage):
    loss, metrics = grpo.clipped_policy_loss(jnp.zeros((1, 1)), jnp.log(jnp.full((1, 1), ratio)),
                                             jnp.array([advantage]), mask, clip_ratio_low=0.2,
                                             clip_ratio_high=0.28, clip_ratio_c=3.0)
    return float(loss), metrics

  # A > 0: the ratio's gain is capped at 1 + ε_high; below 1 − ε_low nothing is clipped (the min picks ρ).
  np.testing.assert_allclose(token_loss(2.0, 1.0)[0], -1.28, rtol=1e-6)
  np.testing.assert_allclose(token_loss(0.5, 1.0)[0], -0.5, rtol=1e-6)
  # A < 0: ρ below 1 − ε_low is clipped to 0.8; a large ρ is pessimistic (−A·ρ) until the dual clip −A·c.
  np.testing.assert_allclose(token_loss(0.5, -1.0)[0], 0.8, rtol=1e-6)
  np.testing.assert_allclose(token_loss(2.0, -1.0)[0], 2.0, rtol=1e-6)
  loss, metrics = token_loss(10.0, -1.0)
  np.testing.assert_allclose(loss, 3.0, rtol=1e-6)
  assert float(metrics["actor/pg_clipfrac_lower"]) == 1.0
  # The dual clip does not apply to positive advantages.
  loss, metrics = token_loss(10.0, 1.0)
  np.testing.assert_allclose(loss, -1.28, rtol=1e-6)
  assert float(metrics["actor/pg_clipfrac_lower"]) == 0.0 and float(metrics["actor/pg_clipfrac"]) == 1.0
  # Clipped tokens pass no gradient; unclipped ones pass −A·ρ.
  grad = lambda r, a: float(jax.grad(lambda lp: grpo.clipped_policy_loss(  # noqa: E731
      jnp.zeros((1, 1)), lp, jnp.array([a]), mask)[0])(jnp.log(jnp.full((1, 1), r)))[0, 0])
  assert grad(10.0, -1.0) == 0.0 and grad(2.0, 1.0) == 0.0
  np.testing.assert_allclose(grad(2.0, -1.0), 2.0, rtol=1e-6)
  with pytest.raises(ValueError, match="clip_ratio_c"):
    grpo.clipped_policy_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.ones(1), mask, clip_ratio_c=1.0)


def test_pinned_low_var_kl():
  ref = jnp.array([0.0, 1.0, 0.0, 30.0])
  logp = jnp.array([0.0, 0.0, 1.0, 0.0])
  # d = ref − logp: 0 -> 0; 1 -> e − 2; −1 -> e^−1; 30 -> clipped to 20 -> e^20 − 21 -> clipped to 10
  np.testing.assert_allclose(grpo.kl_penalty(logp, ref, "low_var_kl"), [0.0, np.e - 2, np.exp(-1.0), 10.0],
                             rtol=1e-6)
  np.testing.assert_allclose(grpo.kl_penalty(logp, ref, "kl"), logp - ref)
  np.testing.assert_allclose(grpo.kl_penalty(logp, ref, "mse"), 0.5 * (logp - ref) ** 2)


def test_grpo_padding_invariance():
  logprobs, old, ref, mask, rewards, entropy = make_batch(seed=3)

  def run(lp, old, ref, mask, entropy):
    fn = lambda x: grpo.grpo_loss(x, old, ref, mask, rewards, group_size=GROUP_SIZE,  # noqa: E731
                                  loss_agg_mode="token-mean", kl_loss_coef=0.1, entropy=entropy,
                                  entropy_coeff=0.01)[0]
    return jax.value_and_grad(fn)(lp)

  loss, grad = run(logprobs, old, ref, mask, entropy)
  rng = np.random.default_rng(0)
  pad = lambda a, v: np.concatenate([a, v], axis=1).astype(np.float32)  # noqa: E731
  junk = lambda: rng.uniform(-1e3, 1e3, size=(rewards.size, 3))  # noqa: E731
  loss2, grad2 = run(pad(logprobs, junk()), pad(old, junk()), pad(ref, junk()), pad(mask, np.zeros((12, 3))),
                     pad(entropy, junk()))
  assert float(loss2) == float(loss)
  np.testing.assert_array_equal(grad2[:, :-3], grad)
  assert np.all(grad2[:, -3:] == 0)
