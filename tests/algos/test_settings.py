"""Each algorithm owns its settings (issue 32): one typed class per algorithm with defaults, one-line docs and checks,
from which the run config's block is built. config/ names no algorithm's field; only the configured algorithm's
block is validated; an objective added outside the package brings its own settings class, and `--config.<name>.<field>`
overrides, validation and the resume record follow without touching config/."""

import dataclasses
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from absl import flags
from ml_collections import config_flags

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as registry, groups, settings
from pacs_jax.algos.masked import masked_sum
from pacs_jax.storage import resume
from pacs_jax.trainer import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")


@dataclasses.dataclass(frozen=True)
class ToySettings(settings.Settings):
  """A REINFORCE objective's own settings."""
  scale: float = settings.setting(1.0, "the loss's scale")
  baseline: str = settings.setting("mean", "mean | none: the group baseline subtracted from each reward")

  def check(self, check):
    check(self.scale > 0, "scale", f"must be positive, got {self.scale}")
    settings.choice(check, self.baseline, ("mean", "none"), "baseline")


class ToyScaled(registry.Algorithm):
  """L = −scale · mean_i (R_i − b_i) Σ_t log π(o_i,t), b the group mean or 0 (`ToySettings`)."""

  min_group_size = 2
  settings_class = ToySettings

  def loss(self, objective, logprobs, entropy, micro):
    s = objective.settings
    rewards = groups.split_groups(micro["rewards"], objective.group_size)  # [U, n]
    advantages = rewards - jnp.mean(rewards, -1, keepdims=True) if s.baseline == "mean" else rewards
    loss = -s.scale * jnp.mean(advantages.reshape(-1) * masked_sum(logprobs, micro["loss_mask"], axis=-1))
    return loss, {"toy/scale": jnp.float32(s.scale)}


@pytest.fixture
def toy():
  algorithm = registry.register("toy_scaled", ToyScaled())
  yield algorithm
  registry._REGISTRY.pop("toy_scaled")  # other tests' configs must not carry its block


def command_line(*args: str):
  """The config `python -m pacs_jax.train --config ... args` builds (ml_collections' config flags)."""
  values, argv = flags.FlagValues(), ["train", *args]
  config_flags.DEFINE_config_file("config", None, "config", flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


def test_every_block_is_its_settings_class_and_config_names_no_algorithms_field():
  cfg = config_lib.default_config()
  for name in registry.names():  # objectives other tests register (without settings) included
    algo = registry.get(name)
    if not dataclasses.fields(algo.settings_class):  # no settings: no block
      assert name not in cfg, name
      continue
    assert cfg[name].to_dict() == algo.settings_class().as_dict(), name
    assert algo.settings(cfg) == algo.settings_class(), name
    assert all(algo.settings_class.docs().values()), f"{name}: a setting without its one-line doc"
  sources = "".join(p.read_text() for p in (ROOT / "pacs_jax" / "config").glob("*.py"))
  named = [f"{name}.{field}" for name in registry.names() for field in cfg.get(name, {})
           if f"{name}.{field}" in sources or re.search(rf"\bc\.{name}\b", sources)]
  assert named == [], "config/ names these algorithm settings; they belong to the algorithm's settings class"


def test_only_the_configured_algorithms_settings_are_validated():
  cfg = config_lib.default_config()
  cfg.grpo.clip_ratio_c = 0.5  # a bad value in a block this PACS run never reads
  config_lib.validate(cfg, num_devices=1, check_paths=False)
  cfg.algorithm = "grpo"
  with pytest.raises(config_lib.ConfigError, match=r"^config\.grpo\.clip_ratio_c: must be > 1"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)


def test_a_block_with_a_field_its_class_lacks_or_a_value_of_another_type_is_refused():
  cfg = config_lib.default_config()
  cfg.algorithm = "grpo"
  cfg.grpo.clip_low = 0.1  # a typo: would be ignored silently
  with pytest.raises(config_lib.ConfigError, match=r"^config\.grpo\.clip_low: is not a setting of this algorithm"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)
  errors = []
  settings_class = registry.get("grpo").settings_class
  settings_class.validate({"use_kl_loss": 1, "clip_ratio_c": 2}, lambda ok, field, msg: ok or errors.append(field))
  assert errors == ["use_kl_loss"]  # an int is a float's value, not a bool's


def test_a_toy_objective_brings_its_settings_without_touching_config(toy, tmp_path):
  cfg = command_line(f"--config={TINY}:toy_scaled", "--config.toy_scaled.scale=0.5", "--config.steps=1",
                     "--config.eval_every=0", "--config.rollout.n=4", "--config.train.batch_prompts=2",
                     "--config.train.mini_batch_prompts=2", "--config.checkpoint.async_save=False")
  assert toy.settings(cfg) == ToySettings(scale=0.5, baseline="mean")
  bad = command_line(f"--config={TINY}:toy_scaled", "--config.toy_scaled.baseline=median")
  with pytest.raises(config_lib.ConfigError, match=r"^config\.toy_scaled\.baseline: mean \| none, got 'median'"):
    config_lib.validate(bad, num_devices=1, check_paths=False)
  bad.algorithm = "pacs"  # another run never reads the toy's block
  config_lib.validate(bad, num_devices=1, check_paths=False)

  trainer = loop.Trainer(cfg, str(tmp_path), devices=jax.devices()[:1])
  assert trainer.record["objective"] == {"toy_scaled.baseline": "mean", "toy_scaled.scale": 0.5}
  last = trainer.run()
  assert last["toy/scale"] == 0.5 and int(trainer.state.step) == 1
  # A resume under another scale is another objective: refused naming the field.
  other = dict(trainer.record, objective={"toy_scaled.baseline": "mean", "toy_scaled.scale": 1.0})
  assert resume.differences(trainer.record, other) == {"objective": ["toy_scaled.scale: 0.5 -> 1.0"]}


def test_presets_keep_their_normalisations_and_dapo_its_buffer_within_the_budget():
  cfg = config_lib.default_config()
  cfg.algorithm = "drgrpo"
  with pytest.raises(config_lib.ConfigError, match=r"^config\.drgrpo\.loss_agg_mode: is not a setting"):
    cfg.drgrpo.loss_agg_mode = "token-mean"  # a preset: the normalisations are not settings
    config_lib.validate(cfg, num_devices=1, check_paths=False)
  cfg = config_lib.default_config()
  cfg.algorithm, cfg.rollout.max_new_tokens, cfg.dapo.overlong_buffer_len = "dapo", 8, 9
  with pytest.raises(config_lib.ConfigError, match=r"^config\.dapo\.overlong_buffer_len: must be at most"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)
