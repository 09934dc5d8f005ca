"""The tool demo learns to call its tool (issue 43, acceptance 1): PACS and GRPO on configs/tiny_tools_cpu.py, each
from the warmed-up base (calls 3% of the time, reward near chance) to a 10-step mean reward of at least 0.9 while
the tool-call rate rises to 1.

  python benchmarks/tools_demo.py [--algorithms=pacs,grpo] [--steps=300] [--window=10] [--target=0.9]

Each run is the README's command (`python -m pacs_jax.train --config configs/tiny_tools_cpu.py:<algorithm>`) with
`--config.steps` and no validation, in a fresh workdir (the base model's warm-up included). Prints per objective the
first `window` steps' mean reward, the tool-call rate of step 1 (the base's own samples) and of the first `window`
steps (RL raises it within them), the first step whose trailing `window` steps average at least `target`, the last `window` steps' mean
reward and call rate, and the minutes it took; exits with status 1 naming an objective whose first `window` steps
average above 0.35, or that misses the target, or whose call rate does not rise from below 0.1 to above 0.9.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ALGORITHMS = flags.DEFINE_list("algorithms", ["pacs", "grpo"], "Objectives to train.")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps each run trains.")
_WINDOW = flags.DEFINE_integer("window", 10, "Steps a running mean covers.")
_TARGET = flags.DEFINE_float("target", 0.9, "The running mean reward to reach.")
START_AT_MOST, CALLS_FROM, CALLS_TO = 0.35, 0.1, 0.9  # the acceptance's bounds


def curves(workdir: str) -> tuple[np.ndarray, np.ndarray]:
  """Each step's mean reward and tool-call rate (metrics.jsonl)."""
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  rows = [r for r in rows if "reward/mean" in r]
  return np.array([r["reward/mean"] for r in rows]), np.array([r["tools/call_rate"] for r in rows])


def first_reaching(values: np.ndarray, window: int, target: float) -> int | None:
  """The first step (1-based) whose trailing `window` values average at least `target`."""
  means = np.convolve(values, np.ones(window) / window, mode="valid")
  hits = np.flatnonzero(means >= target)
  return int(hits[0]) + window if hits.size else None


def train(algorithm: str, steps: int, workdir: str) -> float:
  """Runs the demo's command; the minutes it took."""
  start = time.perf_counter()
  command = [sys.executable, "-m", "pacs_jax.train", "--config",
             os.path.join(ROOT, "configs", f"tiny_tools_cpu.py:{algorithm}"), "--workdir", workdir,
             f"--config.steps={steps}", "--config.eval_every=0"]
  out = subprocess.run(command, capture_output=True, text=True)
  if out.returncode:
    sys.exit(f"{algorithm}: the run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
  return (time.perf_counter() - start) / 60


def main(argv):
  del argv
  window, target = _WINDOW.value, _TARGET.value
  print(f"{'objective':<10} {'reward first ' + str(window):>16} {'calls step 1':>12} {'calls first ' + str(window):>15} "
        f"{'steps to ' + str(target):>12} {'reward last ' + str(window):>15} {'calls last':>10} {'minutes':>8}",
        flush=True)
  failed = []
  for name in _ALGORITHMS.value:
    with tempfile.TemporaryDirectory() as workdir:
      minutes = train(name, _STEPS.value, workdir)
      reward, calls = curves(workdir)
    reached = first_reaching(reward, window, target)
    head, tail = slice(0, window), slice(-window, None)
    print(f"{name:<10} {reward[head].mean():>16.3f} {calls[0]:>12.3f} {calls[head].mean():>15.3f} "
          f"{reached if reached else '> ' + str(len(reward)):>12} {reward[tail].mean():>15.3f} "
          f"{calls[tail].mean():>10.3f} {minutes:>8.1f}", flush=True)
    if (reward[head].mean() > START_AT_MOST or reached is None or calls[0] >= CALLS_FROM
        or calls[tail].mean() <= CALLS_TO):
      failed.append(name)
  if failed:
    sys.exit(f"not met: {', '.join(failed)} (a start above {START_AT_MOST}, no {window}-step mean of {target}, or "
             f"a call rate not rising from below {CALLS_FROM} to above {CALLS_TO})")


if __name__ == "__main__":
  app.run(main)
