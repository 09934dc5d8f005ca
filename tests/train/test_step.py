"""The pure train step: micro-batch accumulation equals the unsplit gradient; non-finite updates are skipped; the
step counter and the RNG advance inside the jitted step, never on the host."""

import ast
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as algo_registry, ppo
from pacs_jax.models import families as registry, qwen2
from pacs_jax.trainer import train_state as state_lib
from pacs_jax.trainer import step as step_lib

N_GROUPS, N, P, R = 4, 4, 5, 6
MODEL = qwen2.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def SGD_METRICS(opt_state):  # plain SGD keeps neither a skip counter nor a learning rate
  return {"skipped_updates": jnp.zeros((), jnp.float32), "lr": jnp.ones(())}


def make_cfg(algorithm="pacs", **grpo):
  cfg = config_lib.default_config()
  cfg.algorithm = algorithm
  cfg.rollout.n = N
  cfg.train.lr = 1e-2
  cfg.grpo.update(grpo)
  return cfg


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  rows = N_GROUPS * N
  ids = rng.integers(1, MODEL.vocab_size, (rows, P + R)).astype(np.int32)
  attn = np.ones((rows, P + R), np.int32)
  resp = np.ones((rows, R), np.float32)
  for r in range(rows):
    attn[r, :rng.integers(0, 3)] = 0  # left padding of the prompt
    length = rng.integers(1, R + 1)
    resp[r, length:] = 0
    attn[r, P + length:] = 0
  rewards = rng.integers(0, 2, rows).astype(np.float32)
  rewards[:N] = 1.0  # one group with all labels equal
  batch = dict(input_ids=ids, attention_mask=attn, loss_mask=resp, rewards=rewards,
               ref_logprobs=rng.normal(-2, 0.3, (rows, R)).astype(np.float32),
               old_logprobs=rng.normal(-2, 0.3, (rows, R)).astype(np.float32),
               advantages=rng.normal(0, 1, (rows, R)).astype(np.float32),
               returns=rng.normal(0, 1, (rows, R)).astype(np.float32),
               old_values=rng.normal(0, 1, (rows, R)).astype(np.float32))
  return {k: jnp.asarray(v) for k, v in batch.items()}


def split(batch, k):
  return jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)


def grads_of(cfg, batch, k):
  """The accumulated gradient the step applies, read back through a plain-SGD optimizer."""
  import optax
  model = registry.causal_lm(MODEL, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  sgd = optax.sgd(1.0)
  critic_graphdef = critic_params = None
  if cfg.algorithm == "ppo":
    critic_graphdef, critic_params = nnx.split(ppo.Critic(MODEL, rngs=nnx.Rngs(1)), nnx.Param)
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=sgd.init(params),
                               rng=state_lib.initial_rng(0), critic_params=critic_params,
                               critic_opt_state=sgd.init(critic_params) if critic_params is not None else None)

  # sgd has no skip counter / lr hyperparams: constant optimizer metrics instead.
  fn = step_lib.make_train_step(algo_registry.bind(cfg), graphdef, sgd, critic_graphdef, sgd if critic_graphdef else None,
                                optimizer_metrics=SGD_METRICS)
  new_state, metrics = jax.jit(fn)(state, split(batch, k))
  grads = jax.tree.map(lambda a, b: a - b, params, new_state.params)
  critic_grads = None
  if critic_params is not None:
    critic_grads = jax.tree.map(lambda a, b: a - b, critic_params, new_state.critic_params)
  return grads, critic_grads, metrics


CASES = {
    "pacs": dict(algorithm="pacs"),
    "grpo_token_mean": dict(algorithm="grpo", loss_agg_mode="token-mean"),
    "grpo_seq_mean_token_sum_norm": dict(algorithm="grpo", loss_agg_mode="seq-mean-token-sum-norm"),
    "ppo": dict(algorithm="ppo", loss_agg_mode="token-mean"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_micro_batches_give_the_unsplit_gradient(case):
  cfg = make_cfg(**CASES[case])
  batch = make_batch()
  whole, whole_critic, m1 = grads_of(cfg, batch, 1)
  split4, split_critic, m4 = grads_of(cfg, batch, N_GROUPS)  # one group per micro-batch
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(whole))
  assert scale > 0
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split4)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
  if whole_critic is not None:
    for a, b in zip(jax.tree.leaves(whole_critic), jax.tree.leaves(split_critic)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
  np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-5)


def test_non_finite_gradient_is_skipped_and_counted_then_training_continues():
  cfg = make_cfg("pacs")
  model = registry.causal_lm(MODEL, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  opt = state_lib.make_optimizer(cfg.train, cfg.train.lr, 10)
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params),
                               rng=state_lib.initial_rng(0))
  step = jax.jit(step_lib.make_train_step(algo_registry.bind(cfg), graphdef, opt))
  good = make_batch()
  bad = dict(good, ref_logprobs=good["ref_logprobs"].at[3, 0].set(jnp.nan))
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = step(state, split(bad, 1))
  assert not np.isfinite(float(metrics["grad_norm"]))
  assert float(metrics["skipped_updates"]) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, np.asarray(b))
  state, metrics = step(state, split(good, 1))
  assert np.isfinite(float(metrics["grad_norm"]))
  assert float(metrics["skipped_updates"]) == 1
  changed = [not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert all(changed)
  assert float(metrics["lr"]) == pytest.approx(cfg.train.lr)


def test_jitted_step_advances_the_step_counter_and_the_rng():
  """The training step's last update returns step + 1 and the next RNG key (the split whose other half seeded
  this step's rollout); an earlier mini-batch of the same training step changes neither."""
  cfg = make_cfg("pacs")
  graphdef, params = nnx.split(registry.causal_lm(MODEL, rngs=nnx.Rngs(0)), nnx.Param)
  opt = state_lib.make_optimizer(cfg.train, cfg.train.lr, 10)
  state = state_lib.TrainState(step=jnp.asarray(7, jnp.int32), params=params, opt_state=opt.init(params),
                               rng=state_lib.initial_rng(3))
  rng_before = np.asarray(state.rng)
  carry, sub = jax.random.split(jax.random.wrap_key_data(state.rng))
  assert state_lib.rollout_seed(state.rng) == int(jax.random.randint(sub, (), 0, 2**31 - 1))
  step = jax.jit(step_lib.make_train_step(algo_registry.bind(cfg), graphdef, opt))
  batch = split(make_batch(), 2)

  mid, _ = step(state, batch, jnp.asarray(False))
  assert int(mid.step) == 7 and np.array_equal(np.asarray(mid.rng), rng_before)
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(mid.params)))

  last, _ = step(mid, batch, jnp.asarray(True))
  assert last.step.dtype == jnp.int32 and int(last.step) == 8
  assert not np.array_equal(np.asarray(last.rng), rng_before)
  np.testing.assert_array_equal(np.asarray(last.rng), np.asarray(jax.random.key_data(carry)))
  assert step._cache_size() == 1  # `ends_step` is a traced argument: one compiled step for every update


TRAIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pacs_jax",
                         "trainer")


def test_no_host_code_changes_the_step_counter_or_the_rng():
  """Outside the jitted step's own `state.advance`, no train module replaces or assigns a state's step / rng."""
  offenders = []
  for name in sorted(os.listdir(TRAIN_DIR)):
    if not name.endswith(".py") or name == "train_state.py":
      continue
    tree = ast.parse(open(os.path.join(TRAIN_DIR, name)).read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "replace":
        offenders += [f"{name}:{node.lineno}" for k in node.keywords if k.arg in ("step", "rng")]
      if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        offenders += [f"{name}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in ("step", "rng")]
  assert offenders == []


def test_the_loop_seeds_each_rollout_from_the_state_rng(tmp_path, monkeypatch):
  """Each step's rollout is seeded with `rollout_seed(state.rng)` of the state it starts from, and the RNG the
  next step starts from is the carry of that same split: the host draws nothing of its own."""
  from pacs_jax.trainer import loop
  seen = []  # (the state's RNG when the rollout starts, the seed it was given)
  rollout = loop.Trainer.rollout

  def spy(self, prompt_ids, seed, *args, **kwargs):
    seen.append((np.asarray(self.state.rng), seed))
    return rollout(self, prompt_ids, seed, *args, **kwargs)

  monkeypatch.setattr(loop.Trainer, "rollout", spy)
  tiny = os.path.join(os.path.dirname(TRAIN_DIR), os.pardir, "configs", "tiny_cpu.py")
  cfg = config_lib.load_config_file(tiny, {"steps": 2, "eval_every": 0, "train.batch_prompts": 4,
                                           "train.mini_batch_prompts": 2, "checkpoint.async_save": False})
  loop.train(cfg, str(tmp_path), devices=jax.devices()[:1])
  assert len(seen) == 2
  np.testing.assert_array_equal(seen[0][0], np.asarray(state_lib.initial_rng(cfg.seed)))
  for rng, seed in seen:
    assert seed == state_lib.rollout_seed(jnp.asarray(rng))
  carry, _ = jax.random.split(jax.random.wrap_key_data(jnp.asarray(seen[0][0])))
  np.testing.assert_array_equal(seen[1][0], np.asarray(jax.random.key_data(carry)))


@pytest.mark.parametrize("k", [1, 2])
def test_a_mini_batch_no_loss_sees_gives_a_zero_gradient_not_nan(k):
  """Issue 44: a dynamically sampled step that kept no group trains on filler rows whose loss mask is 0 (DAPO's
  token-mean normaliser is then 0): the gradient is exactly 0 and finite, so the update is not skipped."""
  cfg = make_cfg("dapo")
  cfg.dapo.overlong_buffer_len = 2
  batch = make_batch()
  batch = dict(batch, loss_mask=jnp.zeros_like(batch["loss_mask"]))
  grads, _, metrics = grads_of(cfg, batch, k)
  assert float(metrics["grad_norm"]) == 0.0
  assert all(np.all(np.asarray(g) == 0.0) for g in jax.tree.leaves(grads))
