"""Training health (issue 34): a dead or diverged run stops at the step boundary, before it saves, in one line
naming the symptom, the step and the last healthy checkpoint (exit status 8); healthy runs, GRPO's all-equal
groups included, never do."""

import math
import os

import pytest

from pacs_jax import config as config_lib
from pacs_jax import errors
from pacs_jax.services import health
from tests.train.test_failures import RUN, cli

LOG_V = math.log(64)


def monitor(restored_step=None, **overrides):
  cfg = config_lib.default_config()
  cfg.update_from_flattened_dict({f"health.{k}": v for k, v in overrides.items()})
  return health.Monitor(cfg, vocab_size=64, updates_per_step=2, start_norm=20.0, restored_step=restored_step)


def row(**changes):
  """A healthy step of the demo (its first steps' figures: entropy 0.025 below ln 64)."""
  return {"grad_norm": 1.5, "reward/mixed_groups": 0.9, "entropy": 4.134, "param_norm": 20.0, **changes}


def run_steps(m, rows, skipped=0, save_every=0, first=1):
  """Steps `first`.. through `m` (a save after each `save_every`-th healthy one); the Unhealthy raised, or None."""
  for step, r in enumerate(rows, start=first):
    try:
      m.check(step, r, skipped)
    except health.Unhealthy as e:
      return e
    if save_every and step % save_every == 0 and m.saving_is_healthy:
      m.saved(step)
  return None


def test_a_healthy_run_never_stops():
  m = monitor()
  assert run_steps(m, [row()] * 50) is None and m.saving_is_healthy


def test_updates_all_skipped_for_patience_steps_stop_the_run():
  stopped = run_steps(monitor(restored_step=4), [row()] * 3, skipped=2, first=5)
  assert str(stopped) == ("training died at step 7: no update applied (every gradient non-finite) for 3 steps; "
                          "stopped without saving; the last healthy checkpoint is step 4 (a rerun resumes from it: "
                          "lower train.lr first)")
  assert run_steps(monitor(), [row()] * 5, skipped=1) is None  # one of two updates skipped: the run goes on


def test_zero_gradient_while_a_groups_rewards_differ_stops_the_run():
  stopped = run_steps(monitor(), [row()] * 4 + [row(grad_norm=0.0)] * 3, save_every=2)
  assert "training died at step 7: gradient norm 0 while the rewards within 90% of the groups differ" in str(stopped)
  assert "the last healthy checkpoint is step 4" in str(stopped)


def test_zero_gradient_with_all_equal_rewards_is_grpos_normal():
  """GRPO (or PACS) on groups whose responses all scored alike has nothing to learn from: a gradient of 0."""
  assert run_steps(monitor(), [row(grad_norm=0.0, **{"reward/mixed_groups": 0.0})] * 20) is None


def test_entropy_pinned_at_the_uniform_policy_stops_the_run():
  stopped = run_steps(monitor(), [row(entropy=LOG_V - 1e-6)] * 3)
  assert f"entropy {LOG_V:.4f} at the uniform policy's ln V = {LOG_V:.4f} for 3 steps" in str(stopped)
  assert "no checkpoint before step 1 (a rerun starts over" in str(stopped)
  assert run_steps(monitor(), [row(entropy=LOG_V - 0.01)] * 20) is None  # near uniform is a random start


def test_a_dead_streak_broken_by_a_healthy_step_starts_over_and_holds_back_saves():
  m = monitor()
  dead = row(grad_norm=0.0)
  assert run_steps(m, [dead, dead, row(), dead, dead]) is None
  assert not m.saving_is_healthy  # a periodic save waits for a healthy step: a dead state never replaces one
  m.check(6, row(), 0)
  assert m.saving_is_healthy


def test_exploding_parameters_stop_the_run_at_once():
  stopped = run_steps(monitor(restored_step=10, max_param_growth=100.0), [row(), row(param_norm=2001.0)], first=11)
  assert str(stopped).startswith("training diverged at step 12: parameter norm 2e+03, 100x its 20 at the start "
                                 "(health.max_param_growth=100); stopped without saving; the last healthy "
                                 "checkpoint is step 10")
  assert "parameter norm inf" in str(run_steps(monitor(), [row(param_norm=math.inf)]))


@pytest.mark.parametrize("restored_step, source", [(None, "the starting model (config.model)"),
                                                    (4, "the checkpoint of step 4")])
def test_weights_non_finite_from_the_start_are_named_as_such(restored_step, source):
  """A NaN base model: every gradient is non-finite, no update applies, the norm stays NaN. The line said `lower
  train.lr first`; it says where the non-finite weights came from."""
  cfg = config_lib.default_config()
  m = health.Monitor(cfg, vocab_size=64, updates_per_step=2, start_norm=math.nan, restored_step=restored_step)
  first = (restored_step or 0) + 1
  stopped = str(run_steps(m, [row(param_norm=math.nan)], skipped=2, first=first))
  assert stopped == (f"training stopped at step {first}: the weights were non-finite before any update (parameter "
                     f"norm nan at the start, from {source}), so no update can apply; stopped without saving; not a "
                     "learning-rate problem: start from finite weights")
  assert "train.lr" not in stopped
  # Finite at the start, non-finite after an update: the learning rate's doing, as before.
  assert "lower train.lr first" in str(run_steps(monitor(), [row(param_norm=math.nan)]))


def test_a_norm_that_jumps_in_one_step_stops_the_run_at_once():
  stopped = run_steps(monitor(), [row(param_norm=250.0)])
  assert "the parameter norm moved by 230 in one step, 11.5x its 20 before it (health.max_update_ratio=10)" in \
      str(stopped)
  assert run_steps(monitor(), [row(param_norm=26.0)] + [row(param_norm=26.0 + 0.1 * i) for i in range(20)]) is None


def test_each_check_turns_off():
  off = monitor(patience=0, max_param_growth=0.0, max_update_ratio=0.0)
  rows = [row(grad_norm=0.0, entropy=LOG_V, param_norm=1e6)] * 10
  assert run_steps(off, rows, skipped=2) is None


@pytest.mark.parametrize("field, value", [("patience", -1), ("entropy_tolerance", -0.1),
                                          ("max_param_growth", 0.5), ("max_update_ratio", -1.0)])
def test_bad_thresholds_are_refused_naming_the_field(field, value):
  cfg = config_lib.default_config()
  cfg.health[field] = value
  with pytest.raises(config_lib.ConfigError, match=f"health.{field}"):
    config_lib.validate(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("lr", ["1e3", "1e30"])
def test_the_demo_at_a_huge_learning_rate_stops_in_one_line(lr, tmp_path):
  """Acceptance 2: before, lr 1e3 trained on with a zero gradient and a uniform policy, lr 1e30 with every update
  skipped, and both exited 0. Now the first update's explosion stops the run, before it saves."""
  result = cli("pacs_jax.train", *RUN, f"--config.train.lr={lr}", "--config.steps=10", "--workdir", "run",
               cwd=tmp_path)
  assert result.returncode == errors.EXIT_UNHEALTHY, result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("train: training diverged at step 1: parameter norm "), last
  assert "stopped without saving; no checkpoint before step 1" in last, last
  assert "Traceback" not in result.stderr
  checkpoints = tmp_path / "run" / "checkpoints"
  assert not checkpoints.exists() or not [name for name in os.listdir(checkpoints) if name.isdigit()]
