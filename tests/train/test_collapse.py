"""Collapse (issue 44, services/collapse.py): a reward or validation accuracy that falls from a sustained level (its
trailing mean >= 0.9) to half of it or less is one warning line at that step naming the drop and the checkpoint
saved while the level held; the closing line repeats it; noise, a slow start and a run that stays down do not warn
(again). Unit tests on metric sequences: no training."""

import numpy as np

from pacs_jax.services import collapse

# The GSPO demo's shape (configs/tiny_cpu.py:gspo before issue 44): at 0.98 for a long time, then 0.25 in one step.
DEMO = [0.3] * 50 + list(np.linspace(0.3, 0.98, 60)) + [0.98] * 171 + [0.25, 0.375, 0.375, 0.44, 0.19] + [0.3] * 14


def rows(rewards, val_every=10, val=None):
  """Metrics rows of steps 1.. with `reward/mean`, and `val/accuracy/all` every `val_every` steps from `val(step)`."""
  out = []
  for step, reward in enumerate(rewards, start=1):
    row = {"reward/mean": reward}
    if val is not None and step % val_every == 0:
      row["val/accuracy/all"] = val(step)
    out.append((step, row))
  return out


def run(watch, steps_rows, every=50):
  """Feeds the rows as the loop does, a checkpoint saved every `every` steps after each row; returns the lines."""
  lines, last_saved = [], None
  for step, row in steps_rows:
    lines += [(step, line) for line in watch.observe(step, row, last_saved)]
    if step % every == 0:
      last_saved = step
  return lines


def test_falls_finds_the_one_step_that_fell_from_the_sustained_level():
  assert collapse.falls(DEMO) == [281]  # index 281: step 282
  # Staying down counts once; climbing back to the level and falling again counts again.
  assert collapse.falls([1.0] * 10 + [0.2] * 30) == [10]
  assert collapse.falls([1.0] * 10 + [0.2] + [1.0] * 10 + [0.1]) == [10, 21]


def test_noise_a_slow_climb_and_a_shallow_dip_are_not_collapses():
  rng = np.random.default_rng(0)
  assert collapse.falls(np.clip(rng.normal(0.93, 0.04, 300), 0, 1).tolist()) == []  # noise at the level
  assert collapse.falls(np.linspace(0.0, 1.0, 100).tolist()) == []  # learning
  assert collapse.falls([0.95] * 10 + [0.5] + [0.95] * 10) == []  # 0.5 of 0.95 is more than half
  assert collapse.falls([0.85] * 10 + [0.1]) == []  # never at the level
  assert collapse.falls([1.0] * 9 + [0.1]) == []  # not sustained: 9 steps


def test_the_warning_names_the_step_the_drop_and_the_checkpoint_saved_while_it_held(monkeypatch):
  warned = []
  monkeypatch.setattr(collapse.logging, "warning", lambda fmt, *args: warned.append(fmt % args))
  watch = collapse.Watch()
  val = lambda step: 1.0 if step <= 280 else 0.33  # noqa: E731  (validation sees it at step 290)
  lines = run(watch, rows(DEMO, val=val))
  assert [step for step, _ in lines] == [282, 290]
  assert lines[0][1] == ("training collapsed at step 282: reward fell from 0.98 (mean of the last 10 steps) to 0.25; "
                         "go back to the checkpoint of step 250")
  assert lines[1][1] == ("training collapsed at step 290: validation accuracy fell from 1 (mean of the last 3 "
                         "evaluations) to 0.33; go back to the checkpoint of step 250")
  assert warned == [line for _, line in lines] and all("\n" not in line for line in warned)
  assert [e.step for e in watch.events] == [282, 290]


def test_a_checkpoint_saved_after_the_fall_is_not_the_one_to_go_back_to():
  # Saves every 5 steps, each after its step's row: the last row at the level (step 29) was seen with step 25 the
  # newest checkpoint; the policy the fall at step 30 sampled is the one saved at step 29 or later.
  lines = run(collapse.Watch(), rows([1.0] * 29 + [0.1] * 11), every=5)
  assert [step for step, _ in lines] == [30] and lines[0][1].endswith("go back to the checkpoint of step 25")
  # No checkpoint while it held: a rerun starts over.
  lines = run(collapse.Watch(), rows([1.0] * 12 + [0.1]), every=50)
  assert lines[0][1].endswith("no checkpoint was saved while it held (a rerun starts over)")


def test_dynamic_sampling_reads_every_sampled_response_and_non_finite_values_are_skipped():
  watch = collapse.Watch()
  # DAPO's trained batch holds mixed groups (its reward/mean about 0.5); every sampled response's mean is the reward.
  steps_rows = [(s, {"reward/mean": 0.5, "sampling/score_mean": 0.97}) for s in range(1, 21)]
  steps_rows += [(21, {"reward/mean": float("nan")}), (22, {"reward/mean": 0.5, "sampling/score_mean": 0.3})]
  assert [step for step, _ in run(watch, steps_rows)] == [22]


def test_the_closing_line_says_the_run_collapsed():
  line = "done at step 300: metrics /w/metrics.jsonl, TensorBoard /w/tensorboard, checkpoints /w/checkpoints\n  export: x"
  assert collapse.closing(line, []) == line
  watch = collapse.Watch()
  run(watch, rows(DEMO, val=lambda step: 1.0 if step <= 280 else 0.33))
  assert collapse.closing(line, watch.events) == (
      "done at step 300, but training collapsed at step 282 (reward fell from 0.98 (mean of the last 10 steps) to "
      "0.25, and 1 more collapse(s) after it; go back to the checkpoint of step 250): metrics /w/metrics.jsonl, "
      "TensorBoard /w/tensorboard, checkpoints /w/checkpoints\n  export: x")
