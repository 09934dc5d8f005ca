"""`pacs_jax.compare`'s pieces on hand-written metrics: the series each panel reads, the table, the PNG."""

import json
import os

import numpy as np
import pytest

from pacs_jax.study import compare_runs as compare


def write_run(directory, rewards, val_every=2):
  os.makedirs(directory)
  with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "val/accuracy/a": 0.0, "val/accuracy/b": 0.5}) + "\n")
    for step, reward in enumerate(rewards, start=1):
      row = {"step": step, "reward/mean": reward, "entropy": 2.0 - reward, "response_length/mean": 4.0,
             "timing/step_s": 0.5}
      if step % val_every == 0:
        row.update({"val/accuracy/a": reward, "val/accuracy/b": 1.0})
      f.write(json.dumps(row) + "\n")
    f.write('{"step": 99, "rew')  # a line cut off by a kill is left out


def test_three_runs_give_a_png_and_a_table(tmp_path):
  runs = {}
  for name, rewards in (("pacs", [0.2, 0.6, 1.0, 1.0]), ("grpo", [0.3, 0.3, 0.5, 0.7]), ("ppo", [0.1, 0.2])):
    write_run(tmp_path / name, rewards)
    runs[name] = compare.read_run(str(tmp_path / name))
  steps, val = runs["pacs"][compare.VAL_PREFIX]
  np.testing.assert_array_equal(steps, [0, 2, 4])
  np.testing.assert_allclose(val, [0.25, 0.8, 1.0])  # the mean over the validation sources
  table = compare.summary_rows(runs)
  assert table[1][:4] == ["pacs", "4", "1.000", "1.000"]
  assert table[3][:2] == ["ppo", "2"]
  compare.plot(runs, str(tmp_path / "out" / "compare.png"))
  assert os.path.getsize(tmp_path / "out" / "compare.png") > 10_000
  assert "grpo" in compare.format_table(table)


def test_smooth_is_a_trailing_mean():
  np.testing.assert_allclose(compare.smooth(np.array([1.0, 3.0, 5.0, 7.0]), 2), [1.0, 2.0, 4.0, 6.0])


def test_a_folder_without_metrics_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
    compare.read_run(str(tmp_path))
