"""Remat on and off give the same numbers in every jitted program a run executes: the train step (first-step
loss, metrics and update), the reference / old log-prob pass, the PPO value pass, and the engine's prefill
and decode (sampled tokens and their log-probs), fp32 to 1e-6.

Why the tests missed the remat crash (flax TraceContextError in the log-prob pass and in generate): every
trainer and engine test ran the tiny config, whose `model.remat` is False; the released configs that set
it were only loaded, validated and dry-run (abstract shapes, no program traced). Remat is now
`jax.checkpoint` of the pure layer-scan body, these tests run each program with it, and
tests/test_configs_e2e.py trains every shipped config's settings (remat included) for 2 steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as algo_registry, ppo
from pacs_jax.models import families as registry
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import scheduler
from pacs_jax.rollout import sampling
from pacs_jax.trainer import train_state as state_lib
from pacs_jax.trainer import step as step_lib

GROUPS, N, P, R = 4, 4, 6, 7
CONFIG = registry.preset("tiny", vocab_size=64, num_hidden_layers=3)


def models(cls=registry.causal_lm):
  """(graphdef without remat, graphdef with remat, shared params)."""
  graphdef, params = nnx.split(cls(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
  remat_graphdef, _ = nnx.split(nnx.eval_shape(lambda: cls(CONFIG.replace(remat=True), rngs=nnx.Rngs(0))),
                                nnx.Param)
  return graphdef, remat_graphdef, params


def minibatch(k=2):
  """A mini-batch [k, m, ...] of left-padded prompts and right-padded responses, with the step's inputs."""
  rng = np.random.default_rng(0)
  rows = GROUPS * N
  ids = rng.integers(1, CONFIG.vocab_size, (rows, P + R)).astype(np.int32)
  attn = np.ones((rows, P + R), np.int32)
  resp = np.ones((rows, R), np.float32)
  for r in range(rows):
    attn[r, :rng.integers(0, 3)] = 0
    length = rng.integers(1, R + 1)
    resp[r, length:] = 0
    attn[r, P + length:] = 0
  batch = dict(input_ids=ids, attention_mask=attn, loss_mask=resp,
               rewards=rng.integers(0, 2, rows).astype(np.float32),
               ref_logprobs=rng.normal(-2, 0.3, (rows, R)).astype(np.float32),
               old_logprobs=rng.normal(-2, 0.3, (rows, R)).astype(np.float32),
               advantages=rng.normal(0, 1, (rows, R)).astype(np.float32),
               returns=rng.normal(0, 1, (rows, R)).astype(np.float32),
               old_values=rng.normal(0, 1, (rows, R)).astype(np.float32))
  return {key: jnp.asarray(v.reshape((k, rows // k) + v.shape[1:])) for key, v in batch.items()}


def test_logprob_pass_is_the_same_with_remat():
  graphdef, remat_graphdef, params = models()
  mb = minibatch()
  plain = jax.jit(step_lib.make_logprob_fn(graphdef, 0.7))(params, mb)
  remat = jax.jit(step_lib.make_logprob_fn(remat_graphdef, 0.7))(params, mb)
  assert plain.shape == (2, GROUPS * N // 2, R)
  np.testing.assert_allclose(remat, plain, atol=1e-6, rtol=0)


def test_value_pass_is_the_same_with_remat():
  graphdef, remat_graphdef, params = models(ppo.Critic)
  mb = minibatch()
  plain = jax.jit(step_lib.make_value_fn(graphdef, ppo.Ppo().critic_mask))(params, mb)
  remat = jax.jit(step_lib.make_value_fn(remat_graphdef, ppo.Ppo().critic_mask))(params, mb)
  np.testing.assert_allclose(remat, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("algorithm", ["pacs", "ppo"])
def test_first_train_step_is_the_same_with_remat(algorithm):
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.n = algorithm, N
  graphdef, remat_graphdef, params = models()
  critic = models(ppo.Critic) if algorithm == "ppo" else (None, None, None)
  # Plain SGD with step 1: the update is the gradient itself (AdamW's first step, g / (|g| + eps), would
  # turn float rounding in near-zero gradients into large differences). SGD has no skip counter or lr.
  optimizer = optax.sgd(1.0)
  sgd_metrics = lambda s: {"skipped_updates": jnp.zeros((), jnp.float32), "lr": jnp.ones(())}
  mb = minibatch()
  results = []
  for policy_graphdef, critic_graphdef in ((graphdef, critic[0]), (remat_graphdef, critic[1])):
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                                 rng=state_lib.initial_rng(0), critic_params=critic[2],
                                 critic_opt_state=None if critic[2] is None else optimizer.init(critic[2]))
    step = step_lib.make_train_step(algo_registry.bind(cfg), policy_graphdef, optimizer, critic_graphdef,
                                    optimizer if critic_graphdef is not None else None, optimizer_metrics=sgd_metrics)
    results.append(jax.jit(step)(state, mb))
  (plain_state, plain_metrics), (remat_state, remat_metrics) = results
  assert plain_metrics.keys() == remat_metrics.keys() and "loss" in plain_metrics
  for name in plain_metrics:
    np.testing.assert_allclose(remat_metrics[name], plain_metrics[name], atol=1e-6, rtol=1e-6, err_msg=name)
  for a, b in zip(jax.tree.leaves(plain_state), jax.tree.leaves(remat_state)):  # the gradients
    np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)


def test_prefill_and_decode_sample_the_same_tokens_with_remat():
  graphdef, remat_graphdef, params = models()
  prompts = [np.random.default_rng(i).integers(1, CONFIG.vocab_size, n).tolist() for i, n in enumerate((3, 9, 5))]
  out = []
  for g in (graphdef, remat_graphdef):
    engine = engine_lib.Engine(nnx.merge(g, params), max_concurrent_decodes=4, max_prefill_length=16,
                               max_decode_length=24, steps_per_call=8, min_prefill_bucket=8)
    out.append(scheduler.generate(engine, engine.load_params(params), prompts, n=2, max_new_tokens=24,
                                   sampling=sampling.Temperature(1.0), seed=3, eos_ids=[1, 2]))
  for a, b in zip(*out):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6, rtol=0)
  assert len({len(c.tokens) for c in out[0]}) > 1
