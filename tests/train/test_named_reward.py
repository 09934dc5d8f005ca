"""A reward is one function named in the config (`reward.fn = "package.module:function"`, issue 41): one of a test
module's trains the tiny config and its scores are the run's rewards; a name that names no function stops
validation in one line naming the field."""

import os

import jax
import pytest

from pacs_jax import config as config_lib
from pacs_jax.trainer import loop
from pacs_jax.services.metrics import METRICS_FILE, read_rows
from tests import tiny_config

tiny = tiny_config.two_steps


def test_a_reward_named_in_the_config_scores_the_run(tmp_path):
  cfg = tiny(**{"reward.fn": "custom_rewards:always_one"})  # returns a score alone, not (score, error)
  config_lib.validate(cfg, 1)
  loop.train(cfg, str(tmp_path), devices=jax.devices()[:1])
  rows = read_rows(os.path.join(tmp_path, METRICS_FILE))
  # The built-in verifier scores this random model's 4-token answers to mod 3 at about a third, never all 1.0.
  assert [(row["step"], row["reward/mean"]) for row in rows] == [(1, 1.0), (2, 1.0)]


@pytest.mark.parametrize("name", ["custom_rewards:missing", "no_such_module_here:score", "custom_rewards"])
def test_a_reward_that_names_no_function_fails_validation_naming_the_field(name):
  with pytest.raises(config_lib.ConfigError, match=r"^config\.reward\.fn: [^\n]+$"):
    config_lib.validate(tiny(**{"reward.fn": name}), 1)
