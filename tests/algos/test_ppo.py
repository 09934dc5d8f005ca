"""PPO pieces: GAE against a plain reverse loop, clipped value loss, the critic module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import sharding
from pacs_jax.algos import grpo, ppo
from pacs_jax.models import qwen2


def reference_gae(rewards, values, mask, gamma, lam):
  """verl's compute_gae_advantage_return as a plain Python loop over rows and positions, float64."""
  N, T = rewards.shape
  adv = np.zeros((N, T))
  for i in range(N):
    next_value, last_gae = 0.0, 0.0
    for t in reversed(range(T)):
      delta = rewards[i, t] + gamma * next_value - values[i, t]
      gae = delta + gamma * lam * last_gae
      if mask[i, t]:
        next_value, last_gae = values[i, t], gae
      adv[i, t] = last_gae
  returns = adv + values
  valid = mask > 0
  n = valid.sum()
  mean = adv[valid].mean()
  var = ((adv[valid] - mean) ** 2).sum() / (n - 1)
  whitened = np.where(valid, (adv - mean) / np.sqrt(var + 1e-8), 0.0)
  return whitened, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_matches_reverse_loop(gamma, lam):
  rng = np.random.default_rng(0)
  N, T = 5, 7
  mask = (np.arange(T)[None, :] < rng.integers(1, T + 1, size=(N, 1))).astype(np.float32)
  mask[0, 2] = 0.0  # a masked position inside a response: skipped, value and GAE carried across it
  values = rng.normal(size=(N, T)).astype(np.float32)
  outcome = rng.integers(0, 2, size=N).astype(np.float32)
  token_rewards = np.asarray(ppo.outcome_token_rewards(jnp.asarray(outcome), jnp.asarray(mask)))
  token_rewards = token_rewards + 0.1 * rng.normal(size=(N, T)).astype(np.float32) * mask  # dense rewards too
  adv, returns = ppo.gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
  want_adv, want_returns = reference_gae(token_rewards.astype(np.float64), values.astype(np.float64), mask, gamma,
                                         lam)
  np.testing.assert_allclose(returns, want_returns, rtol=0, atol=1e-5)
  np.testing.assert_allclose(adv, want_adv, rtol=0, atol=1e-5)


def test_gae_with_gamma_lambda_one_returns_the_outcome():
  """γ = λ = 1 telescopes: Â_t = R − V_t, so returns = R at every response position."""
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
  token_rewards = ppo.outcome_token_rewards(jnp.array([1.0, 0.0]), mask)
  np.testing.assert_array_equal(token_rewards, [[0, 0, 1, 0], [0, 0, 0, 0]])
  values = jnp.array([[0.3, -0.2, 0.9, 5.0], [0.1, 0.4, 7.0, 7.0]])
  _, returns = ppo.gae_advantages(token_rewards, values, mask)
  np.testing.assert_allclose(np.where(mask > 0, returns, 0), [[1, 1, 1, 0], [0, 0, 0, 0]], atol=1e-6)


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
  np.testing.assert_allclose(loss, 0.5 * (1 + 0.49 + 3.24 + 3.24) / 4, rtol=1e-6)
  np.testing.assert_allclose(metrics["critic/vf_clipfrac"], 0.0)
  # A prediction beyond the clip that lands closer to R is still charged its clipped error:
  pred2 = jnp.array([[1.4, 0.3, 0.8, -0.8]])  # 1.4 -> clipped 0.5: (0.16, 0.25) -> 0.25
  loss2, metrics2 = ppo.clipped_value_loss(pred2, returns, old, mask, cliprange_value=0.5)
  np.testing.assert_allclose(loss2, 0.5 * (0.25 + 0.49 + 3.24 + 3.24) / 4, rtol=1e-6)
  np.testing.assert_allclose(metrics2["critic/vf_clipfrac"], 0.25)
  # where the clipped term wins the prediction gets no gradient (clip is flat there)
  grad = jax.grad(lambda p: ppo.clipped_value_loss(p, returns, old, mask, cliprange_value=0.5)[0])(pred2)
  np.testing.assert_allclose(grad, [[0.0, 0.5 * 2 * -0.7 / 4, 0.5 * 2 * 1.8 / 4, 0.5 * 2 * -1.8 / 4]], rtol=1e-6)


def test_policy_loss_is_grpos():
  assert ppo.policy_loss is grpo.clipped_policy_loss


def test_critic_values_and_gradients():
  config = qwen2.get_preset("tiny", num_hidden_layers=1)
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
