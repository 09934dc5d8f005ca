"""Algorithms are objects registered by name: an objective defined outside the package trains through the Trainer,
and no module but the registry compares `algorithm` as a string."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as registry, groups
from pacs_jax.algos.masked import masked_mean, masked_sum
from pacs_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ToyReinforce(registry.Algorithm):
  """REINFORCE with a group-mean baseline and an entropy bonus:
  L = −mean_i (R_i − mean_group R) · Σ_t log π(o_i,t) − 0.01 · mean_{i,t} H_i,t."""

  min_group_size = 2

  def __init__(self):
    self.traced = 0

  def entropy_has_grad(self, objective):
    return True

  def loss(self, objective, logprobs, entropy, micro):
    self.traced += 1
    rewards = groups.split_groups(micro["rewards"], objective.group_size)  # [U, n]
    advantages = groups.mean_std_normalise(rewards, norm_by_std=False).reshape(-1)  # [B]
    loss = -jnp.mean(advantages * masked_sum(logprobs, micro["loss_mask"], axis=-1))
    loss = loss - 0.01 * masked_mean(entropy, micro["loss_mask"])  # a gradient even when all rewards agree
    return loss, {"toy/advantage_abs_mean": jnp.mean(jnp.abs(advantages))}


def test_builtin_algorithms_are_registered():
  assert {"pacs", "grpo", "ppo"} <= set(registry.names())
  assert registry.get("ppo").has_critic and not registry.get("pacs").has_critic
  with pytest.raises(KeyError, match="unknown algorithm 'nope'"):
    registry.get("nope")
  cfg = config_lib.default_config()
  cfg.algorithm = "nope"
  with pytest.raises(config_lib.ConfigError, match="config.algorithm"):
    config_lib.validate(cfg, num_devices=1)


@pytest.mark.parametrize("algorithm, overrides, reference, old_logprobs", [
    ("pacs", {"pacs.reference_policy": "frozen"}, registry.Reference.FROZEN, False),
    ("pacs", {"pacs.reference_policy": "rollout"}, registry.Reference.ROLLOUT, True),
    ("grpo", {}, registry.Reference.NONE, True),
    ("grpo", {"grpo.use_kl_loss": True}, registry.Reference.FROZEN, True),
    ("ppo", {"grpo.use_kl_loss": True}, registry.Reference.NONE, True),
])
def test_each_algorithm_names_its_reference_policy(algorithm, overrides, reference, old_logprobs):
  cfg = config_lib.default_config()
  cfg.algorithm = algorithm
  for field, value in overrides.items():
    config_lib.set_field(cfg, field, value)
  algo = registry.of(cfg)
  assert algo.reference(cfg) is reference and algo.needs_old_logprobs(cfg) is old_logprobs


def test_an_objective_registered_outside_the_package_trains_two_steps(tmp_path):
  toy = registry.register("toy_reinforce", ToyReinforce())
  assert registry.get("toy_reinforce") is toy
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "steps": 2, "eval_every": 0, "rollout.n": 4, "train.batch_prompts": 2, "train.mini_batch_prompts": 1,
      "checkpoint.async_save": False})
  cfg.algorithm = "toy_reinforce"
  cfg.rollout.n = 1
  with pytest.raises(config_lib.ConfigError, match="needs n >= 2"):  # its own requirement, checked by validate
    config_lib.validate(cfg, num_devices=1)
  cfg.rollout.n = 4

  trainer = loop.Trainer(cfg, str(tmp_path), devices=jax.devices()[:1])
  assert trainer.ref_params is None and trainer.programs.value_fn is None  # it asked for neither
  initial = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
  last = trainer.run()

  assert toy.traced > 0
  assert int(trainer.state.step) == 2
  assert np.isfinite(last["loss"]) and np.isfinite(last["grad_norm"]) and last["toy/advantage_abs_mean"] >= 0
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in zip(initial, jax.tree.leaves(trainer.state.params))]
  assert any(moved)
  with open(tmp_path / "metrics.jsonl") as f:
    logged = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in logged][-1] == 2 and "toy/advantage_abs_mean" in logged[-1]


DISPATCH = re.compile(r"algorithm\s*(==|!=|in\b|not\s+in\b)")


def test_no_module_but_the_registry_dispatches_on_the_algorithm_name():
  offenders = []
  # The package, the shipped configs, benchmarks and launch scripts (tests may compare names in assertions).
  walked = [w for top in ("pacs_jax", "configs", "benchmarks", "launch") for w in os.walk(os.path.join(ROOT, top))]
  assert len(walked) > 4
  for folder, _, files in walked:
    for name in files:
      path = os.path.join(folder, name)
      if not name.endswith(".py") or path.endswith(os.path.join("algos", "algorithms.py")):
        continue
      for lineno, line in enumerate(open(path, encoding="utf-8"), 1):
        if DISPATCH.search(line):
          offenders.append(f"{os.path.relpath(path, ROOT)}:{lineno}: {line.strip()}")
  assert offenders == []
