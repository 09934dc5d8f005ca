"""The demo (configs/tiny_cpu.py) in each rollout mode: the step at which PACS and GRPO reach a 10-step mean reward
of 0.9 in `sync`, `one_step_off` (staleness 1) and `async` (staleness 2), issue 33's acceptance 2.

  python benchmarks/overlap_demo.py [--algorithms=pacs,grpo] [--max_steps=300] [--slack=1.25]
                                   [--pacs_reference=rollout]

Exits 1 if an off-policy mode needs more than `slack` times sync's steps (or never gets there), if a loss or reward
is not finite, or if more than `max_dropped` of the responses were dropped as too stale (a drop storm). The
off-policy runs apply the rollout correction (`rollout.tis_imp_ratio_cap` = `--tis_cap`) at each objective's own
level: GRPO's a weight per token, PACS's a weight per response (algos/correction.py); sync runs keep the demo's
settings. Trains in process on one CPU device, without checkpoints or validation; the seeds are the demo's, so a
mode's run is the same each time (async's rollouts take their weights when they start, which is fixed by the step
they start at).
"""

import math
import os
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from pacs_jax.algos import registry
from pacs_jax.rewards import math as rewards_lib
from pacs_jax.trainer import loop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, also when loaded by path
from demo_runs import demo_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"sync": {}, "one_step_off": {"rollout.mode": "one_step_off", "rollout.max_staleness": 1},
         "async": {"rollout.mode": "async", "rollout.max_staleness": 2}}

_ALGORITHMS = flags.DEFINE_list("algorithms", ["pacs", "grpo"], "Objectives to train.")
_MODES = flags.DEFINE_list("modes", list(MODES), "Rollout modes to run (sync first: the others compare with it).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", 300, "Give up on a run after this many steps.")
_WINDOW = flags.DEFINE_integer("window", 10, "Steps the running mean covers.")
_TARGET = flags.DEFINE_float("target", 0.9, "The running mean to reach.")
_SLACK = flags.DEFINE_float("slack", 1.25, "An off-policy mode may take at most this many times sync's steps.")
_MAX_DROPPED = flags.DEFINE_float("max_dropped", 0.05, "The largest share of responses dropped as too stale.")
_TIS_CAP = flags.DEFINE_float("tis_cap", 2.0, "The rollout correction's cap in the off-policy modes (<= 0: off).")
_PACS_REFERENCE = flags.DEFINE_string("pacs_reference", "", "pacs.reference_policy (frozen | rollout); '': the demo's.")


def run(name: str, mode: str, workdir: str) -> dict:
  """Trains until the trailing window's mean reward reaches the target: the step (None if never), the rewards,
  whether every loss and reward was finite, the responses dropped and sampled, and the seconds."""
  cfg = demo_config(name)
  cfg.update_from_flattened_dict(MODES[mode])
  if mode != "sync" and registry.get(name).supports_rollout_correction:
    cfg.rollout.tis_imp_ratio_cap = _TIS_CAP.value
  if _PACS_REFERENCE.value and "reference_policy" in cfg.get(name, {}):  # PACS's setting
    cfg[name].reference_policy = _PACS_REFERENCE.value
  cfg.steps = _MAX_STEPS.value  # (how far the overlapped modes start rollouts ahead)
  trainer = loop.Trainer(cfg, workdir, devices=jax.devices()[:1])
  out = {"reached": None, "rewards": [], "finite": True, "dropped": 0.0, "sampled": 0, "staleness": []}
  start = time.perf_counter()
  try:
    with rewards_lib.RewardScorer(num_workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s) as scorer:
      for step in range(1, _MAX_STEPS.value + 1):
        row = trainer.train_one_step(next(trainer.data_iter), scorer)
        out["rewards"].append(row["accuracy/all"])  # the verifier's mean over the step's responses
        out["finite"] &= all(math.isfinite(row[k]) for k in ("loss", "reward/mean"))
        out["dropped"] += row.get("rollout/dropped", 0.0)
        out["sampled"] += cfg.train.batch_prompts * cfg.rollout.n
        out["staleness"].append(row["rollout/staleness_mean"])
        if step >= _WINDOW.value and np.mean(out["rewards"][-_WINDOW.value:]) >= _TARGET.value:
          out["reached"] = step
          break
  finally:  # what `Trainer.run` lets go of (it never ran)
    if trainer.next_rollout:
      trainer.next_rollout.close()
    trainer.checkpointer.close()
    trainer.lock.release()
  out["seconds"] = time.perf_counter() - start
  return out


def main(argv):
  del argv
  print(f"{'objective':<10} {'mode':<13} {'steps to ' + str(_TARGET.value):>12} {'vs sync':>8} "
        f"{'staleness':>9} {'dropped':>8} {'finite':>6} {'seconds':>8}", flush=True)
  failures = []
  for name in _ALGORITHMS.value:
    sync_steps = None
    for mode in _MODES.value:
      with tempfile.TemporaryDirectory() as workdir:
        r = run(name, mode, workdir)
      reached = r["reached"]
      if mode == "sync":
        sync_steps = reached
      ratio = reached / sync_steps if reached and sync_steps else float("nan")
      dropped = r["dropped"] / max(r["sampled"], 1)
      print(f"{name:<10} {mode:<13} {reached if reached else '> ' + str(_MAX_STEPS.value):>12} "
            f"{ratio:>8.2f} {np.mean(r['staleness']):>9.2f} {dropped:>8.3f} {str(r['finite']):>6} "
            f"{r['seconds']:>8.0f}", flush=True)
      if not r["finite"]:
        failures.append(f"{name} {mode}: a loss or reward was not finite")
      if dropped > _MAX_DROPPED.value:
        failures.append(f"{name} {mode}: {dropped:.1%} of the responses dropped as too stale")
      if mode != "sync" and (reached is None or sync_steps is None or reached > _SLACK.value * sync_steps):
        failures.append(f"{name} {mode}: {reached or 'never'} steps against sync's {sync_steps} "
                        f"(at most {_SLACK.value}x)")
  for failure in failures:
    print("FAIL:", failure, flush=True)
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  app.run(main)
