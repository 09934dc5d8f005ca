"""The step at which each objective's demo (configs/tiny_cpu.py:<algorithm>) reaches a 10-step mean reward of 0.9,
and where it ends: the mean of its last 50 steps and the step of any collapse (services/collapse.py).

  python benchmarks/objectives_demo.py [--algorithms=dapo,drgrpo,gspo] [--max_steps=300] [--window=10] [--last=50]

The reward of a step is the verifier's mean over every response it sampled: DAPO's dynamic sampling trains on the
groups whose verdicts differ, so its trained batch's `reward/mean` stays below 1 by construction; it reports every
sampled response's as `sampling/score_mean`, the others' `accuracy/all` is the same mean. Trains in process, one
objective after another, without checkpoints or validation, every objective for `max_steps` steps (a run that
reached the target may still collapse: issue 44), and reports the first step whose trailing `window` steps average
at least `target`, beside the mean of the last `last` steps and the steps at which the reward collapsed. Exits with
status 1, naming them, when an objective misses the target within `max_steps` (issue 32, acceptance 3: each
objective trains the demo to 0.9).
"""

import os
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from pacs_jax.rewards import math as rewards_lib
from pacs_jax.services import collapse, runtime
from pacs_jax.trainer import loop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, also when loaded by path
from demo_runs import demo_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ALGORITHMS = flags.DEFINE_list("algorithms", ["dapo", "drgrpo", "gspo"], "Registered objectives to train.")
_MAX_STEPS = flags.DEFINE_integer("max_steps", 300, "Give up on an objective after this many steps.")
_WINDOW = flags.DEFINE_integer("window", 10, "Steps the running mean covers.")
_TARGET = flags.DEFINE_float("target", 0.9, "The running mean to reach.")
_LAST = flags.DEFINE_integer("last", 50, "Steps at the end whose mean reward is reported (where the run ended up).")


def sampled_reward(row: dict) -> float:
  """The verifier's mean over every response the step sampled."""
  return row.get("sampling/score_mean", row["accuracy/all"])


def steps_to_target(algorithm: str, workdir: str, max_steps: int, window: int,
                    target: float) -> tuple[int | None, list[float], float]:
  """(the first step whose trailing window averages >= target or None, every step's reward, seconds): trains all
  `max_steps` steps."""
  cfg = demo_config(algorithm)
  trainer = loop.Trainer(cfg, workdir, devices=jax.devices()[:1])
  rewards, start, reached = [], time.perf_counter(), None
  try:
    with rewards_lib.RewardScorer(num_workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s) as scorer:
      for step in range(1, max_steps + 1):
        rewards.append(sampled_reward(trainer.train_one_step(next(trainer.data_iter), scorer)))
        if reached is None and step >= window and np.mean(rewards[-window:]) >= target:
          reached = step
  finally:  # what `Trainer.run` lets go of (it never ran): the checkpointer and the workdir lock
    trainer.checkpointer.close()
    trainer.lock.release()
  return reached, rewards, time.perf_counter() - start


def collapses(rewards: list[float]) -> str:
  """The steps (1-based) at which the reward collapsed (`collapse.falls`), or "none"."""
  steps = [i + 1 for i in collapse.falls(rewards, collapse.WINDOWS[collapse.REWARD])]
  return ",".join(map(str, steps)) or "none"


def run(algorithms: list[str], max_steps: int, window: int, target: float, last: int = 50) -> None:
  """Trains each objective in turn and prints its row; exits with status 1 naming those that missed the target."""
  missed = []
  print(f"{'objective':<10} {'steps to ' + str(target):>14} {'first ' + str(window):>9} {'last ' + str(last):>8} "
        f"{'collapsed at':>12} {'seconds':>8}", flush=True)
  for name in algorithms:
    with tempfile.TemporaryDirectory() as workdir:
      step, rewards, seconds = steps_to_target(name, workdir, max_steps, window, target)
    reached = str(step) if step is not None else f"> {max_steps}"
    print(f"{name:<10} {reached:>14} {np.mean(rewards[:window]):>9.3f} {np.mean(rewards[-last:]):>8.3f} "
          f"{collapses(rewards):>12} {seconds:>8.0f}", flush=True)
    missed += [name] if step is None else []
  if missed:
    sys.exit(f"not reached: {', '.join(missed)} did not train the demo to a {window}-step mean reward of {target} "
             f"within {max_steps} steps")


def main(argv):
  del argv
  runtime.prefer_cpu_without_accelerators()  # (else libtpu and the CUDA plugin print their failures first)
  run(_ALGORITHMS.value, _MAX_STEPS.value, _WINDOW.value, _TARGET.value, _LAST.value)


if __name__ == "__main__":
  app.run(main)
