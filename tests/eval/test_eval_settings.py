"""Evaluation's settings are fields of the training config (same names, types and checks)."""

import os
import subprocess
import sys

import pytest

from pacs_jax import config
from pacs_jax.eval import eval_settings as settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fields(cfg, prefix=""):
  out = []
  for key, value in cfg.items():
    out += _fields(value, f"{prefix}{key}.") if hasattr(value, "items") else [f"{prefix}{key}"]
  return out


def test_every_eval_field_is_a_training_config_field_of_the_same_type():
  train = config.default_config()
  for field in _fields(settings.eval_config()):
    assert type(config.get_field(train, field)) is type(config.get_field(settings.eval_config(), field)), field


def test_settings_round_trip_and_share_the_training_checks():
  s = settings.EvalSettings(n=4, temperature=0.0, top_p=1.0, seed=3, dtype="float32", batch_slots=8)
  assert settings.EvalSettings.from_config(s.to_config()) == s
  with pytest.raises(config.ConfigError, match="config.rollout.top_p"):
    settings.EvalSettings(top_p=2.0)
  with pytest.raises(config.ConfigError, match="config.model.dtype"):
    settings.EvalSettings(dtype="float16")
  with pytest.raises(config.ConfigError, match="config.rollout.stop_tokens"):
    settings.EvalSettings(stop_tokens="nope")


def test_a_bad_flag_is_a_usage_error_naming_it():
  proc = subprocess.run([sys.executable, "-m", "pacs_jax.evaluate", "--model=nowhere", "--data=synthetic/mod3",
                         "--top_k=-1"], capture_output=True, text=True, cwd=ROOT, env=os.environ | {"JAX_PLATFORMS": "cpu"})
  assert proc.returncode != 0
  assert "--top_k: config.rollout.top_k: must be >= 0" in proc.stderr, proc.stderr
