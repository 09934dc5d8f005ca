"""An own-model run that cannot learn says so (issue 35): every group's rewards equal for a few steps is one warning
that says why; the console shows validation accuracy and the response length by name, and no empty step-0 line."""

import logging

import numpy as np
import pytest

from pacs_jax.trainer import equal_rewards, packing as batching
from pacs_jax.services import metrics


def packed(rewards):
  rows = len(rewards)
  return batching.PackedRollout(np.ones((rows, 6), np.int32), np.ones((rows, 6), np.int32),
                                np.ones((rows, 2), np.float32), np.asarray(rewards, np.float32), ["mod3"] * rows,
                                ["stop"] * rows)


def test_mixed_groups_counts_groups_with_signal():
  m = batching.rollout_metrics(packed([0, 0, 1, 0, 1, 1, 0, 0]), {}, ["mod3"], n=2)  # groups: 00 10 11 00
  assert m["reward/mixed_groups"] == 0.25


@pytest.mark.parametrize("reward, why", [(0.0, "never solves a problem"),
                                         (0.5, "solved by all of its responses or by none")])
def test_a_streak_of_equal_groups_is_one_warning_naming_why(reward, why, caplog):
  watch = equal_rewards.EqualRewardsWatch("grpo")
  caplog.set_level(logging.WARNING)
  rows = [{"reward/mixed_groups": 0.0, "reward/mean": reward}] * 5
  said = [watch.observe(step, row) for step, row in enumerate(rows, start=1)]
  assert said[:2] == [None, None] and said[3:] == [None, None]
  assert said[2].startswith("steps 1-3: every group's rewards were equal: ") and why in said[2]
  assert "grpo has nothing to learn from" in said[2]
  assert [r.getMessage() for r in caplog.records] == [said[2]]
  # One group with signal ends the streak; a new streak warns again.
  assert watch.observe(6, {"reward/mixed_groups": 0.5}) is None
  assert [watch.observe(s, rows[0]) is not None for s in (7, 8, 9)] == [False, False, True]


def test_a_solved_task_is_said_once_as_information_not_warned(caplog):
  """Issue 44: the demo solves its task from step ~296 on; a streak of every reward 1 is one info line in the run
  (not a warning, not one per streak)."""
  watch = equal_rewards.EqualRewardsWatch("pacs")
  caplog.set_level(logging.INFO)
  solved, mixed = {"reward/mixed_groups": 0.0, "reward/mean": 1.0}, {"reward/mixed_groups": 0.25}
  said = [watch.observe(step, mixed if step % 5 == 0 else solved) for step in range(1, 40)]
  lines = [m for m in said if m is not None]
  assert len(lines) == 1 and lines[0].startswith("steps 1-3: every response solved its problem: the task is solved")
  assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_the_console_names_validation_accuracy_and_response_length_and_prints_no_empty_line(tmp_path, capsys):
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.write(0, {"val/accuracy/all": 0.0, "val/accuracy/mod3": 0.0})  # the first validation
  writer.write(1, {"reward/mean": 0.0, "response_length/mean": 8.0, "timing/step_s": 2.0})
  writer.write(2, {"unshown/metric": 1.0})
  writer.close()
  lines = capsys.readouterr().out.splitlines()
  assert lines == ["step     0  val_accuracy=0", "step     1  reward=0  response_length=8  step_s=2"], lines
