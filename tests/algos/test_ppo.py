"""PPO pieces: GAE against a plain reverse loop, clipped value loss, the critic module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import sharding
from pacs_jax.algos import grpo, ppo
from pacs_jax.models import families as registry


def reference_gae(token_level_rewards, values, response_mask, gamma, lam):
  """The released verl's compute_gae_advantage_return (core_algos.py, verl 432f9e) and masked_whiten, torch."""
  import torch
  token_level_rewards, values, response_mask = map(torch.as_tensor, (token_level_rewards, values, response_mask))
  lastgaelam = 0
  advantages_reversed = []
  gen_len = token_level_rewards.shape[-1]
  for t in reversed(range(gen_len)):
    nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
    delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
    lastgaelam = delta + gamma * lam * lastgaelam
    advantages_reversed.append(lastgaelam)
  advantages = torch.stack(advantages_reversed[::-1], dim=1)
  returns = advantages + values
  mean = (advantages * response_mask).sum() / response_mask.sum()
  var = (((advantages - mean) ** 2) * response_mask).sum() / response_mask.sum()
  var = var * response_mask.sum() / (response_mask.sum() - 1)
  whitened = (advantages - mean) * torch.rsqrt(var + 1e-8)
  return whitened.numpy(), returns.numpy()


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_matches_the_released_loop(gamma, lam):
  rng = np.random.default_rng(0)
  N, T = 5, 7
  lengths = rng.integers(1, T + 1, size=(N, 1))
  mask = (np.arange(T)[None, :] < lengths).astype(np.float32)
  attention = np.concatenate([np.ones((N, 1)), mask], axis=1)  # [prompt's last token | response]
  state_mask = np.asarray(ppo.critic_mask(jnp.asarray(attention), T))
  values = rng.normal(size=(N, T)).astype(np.float32) * state_mask  # compute_values zeroes the rest
  outcome = rng.integers(0, 2, size=N).astype(np.float32)
  token_rewards = np.asarray(ppo.outcome_token_rewards(jnp.asarray(outcome), jnp.asarray(mask)))
  token_rewards = token_rewards + 0.1 * rng.normal(size=(N, T)).astype(np.float32) * mask  # dense rewards too
  adv, returns = ppo.gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
  want_adv, want_returns = reference_gae(token_rewards.astype(np.float64), values.astype(np.float64), mask, gamma,
                                         lam)
  np.testing.assert_allclose(returns, want_returns, rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.where(mask > 0, adv, 0), np.where(mask > 0, want_adv, 0), rtol=0, atol=1e-5)


def test_critic_mask_is_attention_mask_shifted_by_one():
  attention = jnp.array([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])  # P = 2, R = 5
  # response of 3 tokens: the prompt's last state, the states after tokens 1, 2 and after the EOS (3)
  np.testing.assert_array_equal(ppo.critic_mask(attention, 5), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


def test_gae_with_gamma_lambda_one_returns_the_outcome():
  """γ = λ = 1 telescopes: Â_t = R − V_t, so returns = R at every response position."""
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
  token_rewards = ppo.outcome_token_rewards(jnp.array([1.0, 0.0]), mask)
  np.testing.assert_array_equal(token_rewards, [[0, 0, 1, 0], [0, 0, 0, 0]])
  values = jnp.array([[0.3, -0.2, 0.9, 5.0], [0.1, 0.4, 7.0, 7.0]])
  values = values * jnp.array([[1, 1, 1, 1], [1, 1, 1, 0]])  # the critic mask: one state past the response
  _, returns = ppo.gae_advantages(token_rewards, values, mask)
  # The state after the EOS (row 0 has none: it filled R) gets return 0.
  np.testing.assert_allclose(returns, [[1, 1, 1, 0], [0, 0, 0, 0]], atol=1e-6)


def test_outcome_token_rewards_handle_empty_rows():
  mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
  np.testing.assert_array_equal(ppo.outcome_token_rewards(jnp.array([2.0, 3.0, 4.0]), mask),
                                [[0, 2, 0], [0, 0, 0], [0, 0, 4]])


def test_value_clipping():
  old = jnp.array([[0.0, 0.0, 0.0, 0.0]])
  returns = jnp.array([[1.0, 1.0, -1.0, 1.0]])
  pred = jnp.array([[2.0, 0.3, 0.8, -0.8]])
  mask = jnp.ones((1, 4))
  loss, metrics = ppo.clipped_value_loss(pred, returns, old, mask, cliprange_value=0.5)
  # clipped predictions: 0.5, 0.3, 0.5, −0.5; squared errors (unclipped, clipped), max:
  #   (1, 0.25) -> 1;  (0.49, 0.49) -> 0.49;  (3.24, 2.25) -> 3.24;  (3.24, 2.25) -> 3.24
  np.testing.assert_allclose(loss, (1 + 0.49 + 3.24 + 3.24) / 4, rtol=1e-6)  # the released loss has no ½
  np.testing.assert_allclose(metrics["critic/vf_clipfrac"], 0.0)
  # A prediction beyond the clip that lands closer to R is still charged its clipped error:
  pred2 = jnp.array([[1.4, 0.3, 0.8, -0.8]])  # 1.4 -> clipped 0.5: (0.16, 0.25) -> 0.25
  loss2, metrics2 = ppo.clipped_value_loss(pred2, returns, old, mask, cliprange_value=0.5)
  np.testing.assert_allclose(loss2, (0.25 + 0.49 + 3.24 + 3.24) / 4, rtol=1e-6)
  np.testing.assert_allclose(metrics2["critic/vf_clipfrac"], 0.25)
  # where the clipped term wins the prediction gets no gradient (clip is flat there)
  grad = jax.grad(lambda p: ppo.clipped_value_loss(p, returns, old, mask, cliprange_value=0.5)[0])(pred2)
  np.testing.assert_allclose(grad, [[0.0, 2 * -0.7 / 4, 2 * 1.8 / 4, 2 * -1.8 / 4]], rtol=1e-6)
  # seq-mean-token-sum-norm with b = 8 rows per verl micro-batch: 8 · mean_i Σ_t / T.
  loss3, _ = ppo.clipped_value_loss(pred2, returns, old, mask, cliprange_value=0.5,
                                    loss_agg_mode="seq-mean-token-sum-norm", micro_batch_rows=8)
  np.testing.assert_allclose(loss3, 8 * (0.25 + 0.49 + 3.24 + 3.24) / 4, rtol=1e-6)


def test_policy_loss_is_grpos():
  assert ppo.policy_loss is grpo.clipped_policy_loss


def test_critic_values_and_gradients():
  config = registry.preset("tiny", num_hidden_layers=1)
  # Built abstractly, then filled from numpy: concrete init would compile the PRNG for every parameter shape.
  graphdef, state = nnx.split(nnx.eval_shape(lambda: ppo.Critic(config, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype), state)
  critic = nnx.merge(graphdef, state)
  assert critic.value_kernel.get_metadata()["logical_axes"] == ("embed", "value")
  assert critic.value_bias.get_metadata()["logical_axes"] == ("value",)
  ids = jnp.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
  attention = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])

  def loss_fn(model):
    values = model(ids, attention)
    return ppo.clipped_value_loss(values, jnp.ones((2, 5)), jnp.zeros((2, 5)), attention)[0], values

  grads, values = nnx.jit(nnx.grad(loss_fn, has_aux=True))(critic)  # one compile (eager: one per op)
  assert values.shape == (2, 5) and values.dtype == jnp.float32
  assert float(jnp.abs(grads.value_kernel[...]).sum()) > 0
  assert float(jnp.abs(grads.model.embed_tokens[...]).sum()) > 0
  specs = sharding.state_specs(nnx.state(critic, nnx.Param), sharding.make_mesh(data=1, fsdp=2, tensor=4))
  assert specs.value_kernel == jax.sharding.PartitionSpec("fsdp", None)
