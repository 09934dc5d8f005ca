"""Runs side by side (`python -m pacs_jax.compare`, and the study's curves): reward, validation accuracy, entropy,
response length and step time of several workdirs (their metrics.jsonl) in one figure, and a summary table."""

from __future__ import annotations

import math
import os

import numpy as np

from pacs_jax import paths
from pacs_jax.services import metrics as metrics_lib

VAL_PREFIX = "val/accuracy/"
# (panel title, metric key; VAL_PREFIX = the mean over the validation sources of a row)
PANELS = (("reward (train, mean)", "reward/mean"), ("validation accuracy (greedy)", VAL_PREFIX),
          ("entropy", "entropy"), ("response length (tokens)", "response_length/mean"),
          ("step time (s)", "timing/step_s"))


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of one metric over a run's rows; for VAL_PREFIX, the mean over the sources a row has."""
  steps, values = [], []
  for row in rows:
    if key == VAL_PREFIX:
      found = [v for k, v in row.items() if k.startswith(VAL_PREFIX) and isinstance(v, (int, float))]
      value = float(np.mean(found)) if found else None
    else:
      value = row.get(key)
    if isinstance(value, (int, float)) and math.isfinite(value):
      steps.append(int(row["step"]))
      values.append(float(value))
  return np.asarray(steps, np.int64), np.asarray(values, np.float64)


def read_run(run_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{metric key: (steps, values)} for every panel; FileNotFoundError naming the file when it is missing."""
  path = paths.join(run_dir, metrics_lib.METRICS_FILE)
  if not paths.exists(path):
    raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a training workdir?)")
  rows = metrics_lib.read_rows(path)
  return {key: series(rows, key) for _, key in PANELS}


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing mean over up to `window` values (the first points average what there is)."""
  if window <= 1 or len(values) == 0:
    return values
  cumulative = np.concatenate([[0.0], np.cumsum(values)])
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(0, ends - window)
  return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def summary_rows(runs: dict[str, dict]) -> list[list[str]]:
  """Per run: steps, mean reward over its last tenth, last validation accuracy, last entropy and response length,
  median step time, total train time."""
  header = ["run", "steps", "reward (last 10%)", "val accuracy (last)", "entropy (last)", "response length (last)",
            "step s (median)", "train time"]
  table = [header]
  for name, run in runs.items():
    steps, reward = run["reward/mean"]
    tail = reward[-max(1, len(reward) // 10):] if len(reward) else reward
    _, val = run[VAL_PREFIX]
    _, entropy = run["entropy"]
    _, length = run["response_length/mean"]
    _, step_s = run["timing/step_s"]
    cell = lambda a, fmt: fmt.format(a) if a is not None else "-"  # noqa: E731
    table.append([name, str(int(steps[-1])) if len(steps) else "0",
                  cell(tail.mean() if len(tail) else None, "{:.3f}"), cell(val[-1] if len(val) else None, "{:.3f}"),
                  cell(entropy[-1] if len(entropy) else None, "{:.3f}"),
                  cell(length[-1] if len(length) else None, "{:.1f}"),
                  cell(float(np.median(step_s)) if len(step_s) else None, "{:.2f}"),
                  cell(float(step_s.sum()) / 60 if len(step_s) else None, "{:.1f} min")])
  return table


def format_table(table: list[list[str]]) -> str:
  widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
  return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   for row in table)


def plot(runs: dict[str, dict], out_path: str, smoothing: int = 0, title: str = "") -> None:
  """A grid of panels (PANELS; the last cell holds the legend), a line per run (trailing mean over `smoothing` steps; 0 = a twentieth of the
  longest run), the raw values faint behind it; written as a PNG (Agg: no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  longest = max((len(run["reward/mean"][0]) for run in runs.values()), default=1)
  window = smoothing or max(1, longest // 20)
  fig, grid = plt.subplots(2, 3, figsize=(12, 6.4), constrained_layout=True)
  axes, legend_cell = grid.flat[:len(PANELS)], grid.flat[-1]
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for (panel, key), ax in zip(PANELS, axes):
    for i, (name, run) in enumerate(runs.items()):
      steps, values = run[key]
      if not len(steps):
        continue
      color = colors[i % len(colors)]
      if key == VAL_PREFIX:  # validation runs every few steps: its points as they are
        ax.plot(steps, values, color=color, marker="o", markersize=3, label=name)
      else:
        ax.plot(steps, values, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, smooth(values, window), color=color, label=name)
    ax.set_title(panel, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if key == "timing/step_s":
      ax.set_yscale("log")  # the first step compiles: tens of times the others
  legend_cell.axis("off")
  legend_cell.legend(*axes[0].get_legend_handles_labels(), loc="center", fontsize=11,
                     title=f"trailing mean over {window} steps" if window > 1 else None)
  if title:
    fig.suptitle(title)
  directory = os.path.dirname(out_path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  fig.savefig(out_path, dpi=80)
  plt.close(fig)
