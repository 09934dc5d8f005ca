"""`rollout.engine` names the run's rollout (issue 41): a scripted engine from a test module (tests/scripted_engine.py)
trains the tiny config through the rollout interface alone, its inserted token carried as a loss mask of 0; a name
that names no engine, or a factory whose result lacks the interface, is refused in one line naming the field."""

import os

import jax
import numpy as np
import pytest

import scripted_engine
from pacs_jax import config as config_lib
from pacs_jax.trainer import loop, packing as batching
from pacs_jax.trainer import programs as programs_lib
from pacs_jax.services.metrics import METRICS_FILE, read_rows
from tests import tiny_config

tiny = tiny_config.two_steps


def test_a_scripted_engine_named_in_the_config_trains_two_steps(tmp_path):
  cfg = tiny(**{"rollout.engine": "scripted_engine:make"})
  config_lib.validate(cfg, 1)
  loop.train(cfg, str(tmp_path), devices=jax.devices()[:1])
  rows = read_rows(os.path.join(tmp_path, METRICS_FILE))
  # Half of each group answers right; every response is [answer, inserted "+", EOS] (3 tokens, 2 of them the model's).
  assert [(row["step"], row["reward/mean"], row["response_length/mean"]) for row in rows] == [(1, 0.5, 3.0),
                                                                                                (2, 0.5, 3.0)]
  assert all(np.isfinite(row["loss"]) and row["grad_norm"] > 0 for row in rows)


def test_the_scripted_engines_inserted_token_is_in_the_attention_mask_but_out_of_the_loss_mask():
  engine = scripted_engine.ScriptedRollout(eos_ids=(scripted_engine.EOS,))
  prompts = [[1, 13, 7, 12, 2], [1, 10, 7, 12, 2]]  # "4 mod 3", "1 mod 3" in the template's ids
  completions = engine.generate(prompts, n=2)
  P, R = 6, 4
  _, attention, response = batching.pack_rows(prompts, completions, P, R, pad_id=0, mask_eos_ids=(scripted_engine.EOS,))
  np.testing.assert_array_equal(attention[:, P:], [[1, 1, 1, 0]] * 4)
  np.testing.assert_array_equal(batching.loss_mask(completions, response), [[1, 0, 1, 0]] * 4)


@pytest.mark.parametrize("name", ["scripted_engine:missing", "no_such_module_here:make", "scripted_engine", "locale"])
def test_an_engine_that_names_no_factory_fails_validation_naming_the_field(name):
  with pytest.raises(config_lib.ConfigError, match=r"^config\.rollout\.engine: [^\n]+$"):
    config_lib.validate(tiny(**{"rollout.engine": name}), 1)


def test_a_factory_whose_result_lacks_the_interface_is_refused():
  cfg = tiny(**{"rollout.engine": "scripted_engine:not_a_rollout"})
  with pytest.raises(TypeError, match="lacks members of interface.Rollout"):
    programs_lib.make_rollout(cfg, None, None, eos_ids=(2,))
