"""PPO owns its actor settings (`ppo.*`, issue 24): its loss reads them, not GRPO's block; a config that still sets
them under `grpo` is refused naming the new field; a resume reads an older checkpoint's record from its grpo block."""

import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as registry
from pacs_jax.storage import resume

MOVED = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "entropy_coeff")


def ppo_loss(cfg):
  rng = np.random.default_rng(0)
  micro = {"old_logprobs": jnp.asarray(rng.normal(size=(4, 6)) * 0.1 - 1.0, jnp.float32),
           "advantages": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
           "loss_mask": jnp.asarray(rng.random((4, 6)) < 0.8, jnp.float32)}
  logprobs = micro["old_logprobs"] + jnp.asarray(rng.normal(size=(4, 6)) * 0.5, jnp.float32)
  loss, _ = registry.get("ppo").bind(cfg).loss(logprobs, None, micro)
  return float(loss)


def test_the_ppo_actor_reads_its_own_block_not_grpos():
  cfg = config_lib.default_config()
  base = ppo_loss(cfg)
  cfg.grpo.clip_ratio_high, cfg.grpo.clip_ratio_low = 0.01, 0.01
  assert ppo_loss(cfg) == base
  cfg.ppo.clip_ratio_high, cfg.ppo.clip_ratio_low = 0.01, 0.01
  assert ppo_loss(cfg) != base
  assert registry.get("ppo").settings(cfg).as_dict() == cfg.ppo.to_dict()
  assert registry.get("grpo").settings(cfg).as_dict() == cfg.grpo.to_dict()
  assert set(config_lib.default_config().ppo) >= set(MOVED)


@pytest.mark.parametrize("field,value", [("clip_ratio_low", 0.3), ("loss_agg_mode", "token-mean"),
                                         ("entropy_coeff", 0.01)])
def test_a_ppo_setting_left_in_the_grpo_block_is_refused_naming_the_new_field(field, value):
  cfg = config_lib.default_config()
  cfg.algorithm = "ppo"
  cfg.grpo[field] = value
  with pytest.raises(config_lib.ConfigError, match=rf"config\.grpo\.{field}: ppo reads ppo\.{field} now"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)
  cfg.ppo[field] = value  # set where PPO reads it: accepted
  config_lib.validate(cfg, num_devices=1, check_paths=False)
  grpo = config_lib.default_config()  # a GRPO run keeps reading its own block
  grpo.algorithm, grpo.grpo[field] = "grpo", value
  config_lib.validate(grpo, num_devices=1, check_paths=False)


def test_an_unknown_ppo_loss_agg_mode_is_named():
  cfg = config_lib.default_config()
  cfg.ppo.loss_agg_mode = "mean"
  config_lib.validate(cfg, num_devices=1, check_paths=False)  # a PACS run never reads the ppo block (issue 32)
  cfg.algorithm = "ppo"
  with pytest.raises(config_lib.ConfigError, match=r"config\.ppo\.loss_agg_mode: unknown mode 'mean'"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)


def older_ppo_checkpoint(grpo_clip_low):
  """The record and config a PPO checkpoint saved before PPO had its own actor settings."""
  saved_config = config_lib.default_config().to_dict()
  saved_config["algorithm"] = "ppo"
  saved_config["grpo"]["clip_ratio_low"] = grpo_clip_low
  saved_config["ppo"] = {k: v for k, v in saved_config["ppo"].items() if k not in MOVED}
  record = {"algorithm": "ppo", "objective": {f"ppo.{k}": v for k, v in sorted(saved_config["ppo"].items())}}
  return saved_config, record


def current_record():
  cfg = config_lib.default_config()
  return {"algorithm": "ppo", "objective": {f"ppo.{k}": v for k, v in sorted(cfg.ppo.to_dict().items())}}


def test_a_resume_reads_an_older_ppo_records_actor_settings_from_its_grpo_block():
  saved_config, record = older_ppo_checkpoint(0.2)  # the defaults then and now: the same objective
  assert resume.differences(record, current_record())  # (read naively, every moved field looks changed)
  assert resume.differences(resume.with_moved_settings(record, saved_config), current_record()) == {}
  saved_config, record = older_ppo_checkpoint(0.3)  # it trained with another clip: refused, naming the field
  diffs = resume.differences(resume.with_moved_settings(record, saved_config), current_record())
  assert diffs == {"objective": ["ppo.clip_ratio_low: 0.3 -> 0.2"]}
