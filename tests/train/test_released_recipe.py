"""The released-recipe configs replicate the released code: reference, clipping, stop tokens, checkpoints,
and what the trainer then does with them (r̂ = 0 on each step's first mini-batch, generation dumps)."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pacs_jax import config as config_lib
from pacs_jax.rollout import stop_tokens
from pacs_jax.trainer import loop, packing as batching
from pacs_jax.trainer import train_state as state_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELEASED = [os.path.join(ROOT, "configs", f"{name}.py") for name in ("qwen7b_v5p", "qwen3b_v5p", "qwen3b_gpu",
                                                                     "qwen1p5b_1gpu")]


def load(path, algorithm="pacs"):
  import importlib.util
  spec = importlib.util.spec_from_file_location("released_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(algorithm)


@pytest.mark.parametrize("path", RELEASED, ids=os.path.basename)
@pytest.mark.parametrize("algorithm", ["pacs", "grpo", "ppo"])
def test_released_configs_pin_the_released_values(path, algorithm):
  cfg = load(path, algorithm)
  config_lib.validate(cfg, cfg.hardware.num_devices, cfg.hardware.num_processes)
  assert cfg.algorithm == algorithm
  assert cfg.pacs.reference_policy == "rollout"  # old_log_prob of the sampling policy (pacs_trainer.py)
  assert cfg.train.grad_clip == (0.0 if algorithm == "pacs" else 1.0)  # pacs_actor._optimizer_step never clips
  assert cfg.rollout.stop_tokens == "released"
  assert cfg.checkpoint.keep == 0  # max_actor_ckpt_to_keep: null
  assert cfg.train.verl_micro_batch_rows == 8 and cfg.grpo.loss_agg_mode == "seq-mean-token-sum-norm"
  assert cfg.pacs.exact_padding_replication is False
  assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.b1, cfg.train.b2, cfg.train.schedule) == (
      1e-6, 0.01, 0.9, 0.999, "constant")
  assert cfg.eval_every == (0 if algorithm == "ppo" else 5)  # ppo.sh: test_freq=-1
  if algorithm == "ppo":
    assert (cfg.ppo.critic_lr, cfg.ppo.cliprange_value, cfg.ppo.gamma, cfg.ppo.lam) == (1e-5, 0.5, 1.0, 1.0)


@pytest.mark.parametrize("algorithm", ["pacs", "grpo"])
def test_one_optimizer_step_clips_only_the_baselines(algorithm):
  """A gradient of norm 10: PACS's Adam first moment is (1 − β1)·g; GRPO's sees g clipped to norm 1."""
  cfg = load(RELEASED[0], algorithm)
  optimizer = state_lib.make_optimizer(cfg.train, cfg.train.lr, cfg.steps)
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros((5,))}
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  grads = jax.tree.map(lambda g: g * 10.0 / optax.tree.norm(grads), grads)
  np.testing.assert_allclose(float(optax.tree.norm(grads)), 10.0, rtol=1e-6)
  state = optimizer.init(params)
  _, state = optimizer.update(grads, state, params)
  mu = optax.tree.get(state, "mu")
  scale = 1.0 if algorithm == "pacs" else 1.0 / 10.0
  for name in params:
    np.testing.assert_allclose(np.asarray(mu[name]), (1 - cfg.train.b1) * scale * np.asarray(grads[name]), rtol=1e-5)


def test_group_check_names_the_rows():
  ids = np.array([[0, 1, 2, 9], [5, 1, 2, 8], [3, 4, 4, 7], [3, 4, 4, 6]], np.int32)  # [prompt of 3 | response]
  mask = np.ones_like(ids)
  mask[:2, 0] = 0  # left padding: the pad token's id does not matter
  batching.check_groups(ids, mask, prompt_len=3, n=2)
  ids[3, 1] = 5
  with pytest.raises(ValueError, match=r"rows 2\.\.3 .*one prompt"):
    batching.check_groups(ids, mask, prompt_len=3, n=2)


def test_rollout_reference_run_with_exact_padding_dumps_and_every_checkpoint(tmp_path):
  """3 steps of the tiny model with the released reference: r̂ is 0 on every step's first mini-batch and not on
  the next; the released padding term, generation dumps and keep-all checkpoints on the way."""
  overrides = {"steps": 3, "eval_every": 2, "train.batch_prompts": 8, "train.mini_batch_prompts": 4,
               "data.synthetic_val_size": 8, "checkpoint.async_save": False, "checkpoint.every": 1,
               "checkpoint.keep": 0, "pacs.reference_policy": "rollout", "pacs.exact_padding_replication": True,
               "rollout_data_dir": str(tmp_path / "rollout"), "validation_data_dir": str(tmp_path / "validation")}
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), overrides)
  trainer = loop.Trainer(cfg, str(tmp_path / "run"), devices=jax.devices()[:1])
  per_step = []
  update = trainer.update

  def recording_update(rb):
    out = update(rb)
    assert rb.extra["proxy_mask"].sum() > rb.response_mask.sum()  # early stops got the term
    per_step.append(trainer.minibatch_metrics)
    return out

  trainer.update = recording_update
  trainer.run()
  assert len(per_step) == 3
  for minibatches in per_step:
    assert len(minibatches) == 2
    assert minibatches[0]["pacs/reward_proxy_abs_mean"] < 1e-5, minibatches[0]
    assert minibatches[1]["pacs/reward_proxy_abs_mean"] > 1e-3, minibatches[1]  # the policy moved in between
  steps = sorted(int(os.path.basename(p)) for p in glob.glob(str(tmp_path / "run" / "checkpoints" / "*"))
                 if os.path.basename(p).isdigit())
  assert steps == [1, 2, 3]
  for step in (1, 2, 3):
    with open(tmp_path / "rollout" / f"{step}.jsonl") as f:
      rows = [json.loads(line) for line in f]
    assert len(rows) == 8 * cfg.rollout.n
    assert set(rows[0]) == {"input", "output", "score", "step", "data_source", "ground_truth"}
    assert {r["step"] for r in rows} == {step} and rows[0]["input"] == rows[cfg.rollout.n - 1]["input"]
  for step in (0, 2):
    with open(tmp_path / "validation" / f"{step}.jsonl") as f:
      rows = [json.loads(line) for line in f]
    assert len(rows) == 8 and set(rows[0]) == {"input", "output", "score", "step", "data_source", "ground_truth",
                                                "reward"}


@pytest.mark.parametrize("field, value, message", [
    ("train.grad_clip", -1.0, "grad_clip"), ("rollout.stop_tokens", "eos", "stop_tokens"),
    ("checkpoint.keep", -1, "checkpoint.keep"), ("train.verl_micro_batch_rows", 0, "verl_micro_batch_rows")])
def test_new_fields_are_validated(field, value, message):
  cfg = config_lib.default_config()
  section, name = field.split(".")
  cfg[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(cfg)


def test_exact_padding_needs_whole_verl_micro_batches():
  cfg = config_lib.default_config()
  cfg.pacs.exact_padding_replication = True
  cfg.train.verl_micro_batch_rows = 3  # 1024 x 8 rows are not groups of 3
  with pytest.raises(config_lib.ConfigError, match="verl_micro_batch_rows"):
    config_lib.validate(cfg)
  assert stop_tokens.parse_stop_tokens("151643, 151645") == (151643, 151645)
  assert stop_tokens.parse_stop_tokens("chat") == "chat" and stop_tokens.parse_stop_tokens("x") is None
