"""Real concurrency of `rollout.mode="one_step_off"` on split devices (issue 33, acceptance 5).

  python benchmarks/overlap.py [--steps=10] [--max_new_tokens=32] [--batch_prompts=16] [--rollout_devices=4]

On CPU with 8 virtual devices, the demo's tiny model (configs/tiny_cpu.py) split 4/4 (`rollout.devices=4`: the
rollout on devices 4-7, the trainer on 0-3), with a response length at which the rollout and the update take
similar times. Runs `sync` and `one_step_off` (staleness 1) on that split, and prints, over the steps after the
first two (which compile): each phase's wall time (`timing/rollout_wall_s`: a rollout from its start to its last
response, on whichever thread ran it; `timing/update_wall_s`: from the scored responses to the new weights and
metrics on the host, a blocking point), the fraction of the shorter phase that ran while the other did
(`timing/overlap_fraction`: one_step_off's rollout of step k+1 beside step k's update) and the step times
(`timing/step_s`) of both modes. Exits 1 when one_step_off's median overlap is under 50% of the shorter phase.

Virtual CPU devices share the host's cores (2 here): the phases run at once, but on the same cores, so the step time
gains little; the overlap is real concurrency (two threads, each blocked on its own devices), not speed-up.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
THRESHOLD = 0.5

_STEPS = flags.DEFINE_integer("steps", 10, "Training steps of each run (the first two compile and are not counted).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "rollout.max_new_tokens (sets the rollout's length).")
_BATCH = flags.DEFINE_integer("batch_prompts", 16, "train.batch_prompts (x rollout.n 8 responses).")
_ROLLOUT_DEVICES = flags.DEFINE_integer("rollout_devices", 4, "rollout.devices: the rollout's share of the 8.")
_ALGORITHM = flags.DEFINE_string("algorithm", "grpo", "The objective (grpo: the rollout correction applies).")


def run(mode: str, workdir: str) -> tuple[list[dict], float]:
  """(metrics rows, seconds) of one run in this process."""
  from pacs_jax import config as config_lib
  from pacs_jax.trainer import loop
  overrides = {"steps": _STEPS.value, "eval_every": 0, "checkpoint.every": 10_000, "checkpoint.async_save": False,
               "rollout.max_new_tokens": _MAX_NEW.value, "train.batch_prompts": _BATCH.value,
               "train.mini_batch_prompts": _BATCH.value // 2, "rollout.devices": _ROLLOUT_DEVICES.value,
               "rollout.mode": mode, "health.patience": 0, "mesh.fsdp": -1}
  if mode == "one_step_off":
    overrides["rollout.tis_imp_ratio_cap"] = 2.0
  import importlib.util
  spec = importlib.util.spec_from_file_location("tiny_cpu", os.path.join(ROOT, "configs", "tiny_cpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config(_ALGORITHM.value)
  for key, value in overrides.items():
    config_lib.set_field(cfg, key, value)
  start = time.perf_counter()
  loop.Trainer(cfg, workdir).run()
  seconds = time.perf_counter() - start
  import json
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()], seconds


def median(rows: list[dict], key: str) -> float:
  return float(np.median([r[key] for r in rows]))


def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  import jax
  assert jax.device_count() == 8, jax.devices()
  measured = {}
  with tempfile.TemporaryDirectory() as tmp:
    for mode in ("sync", "one_step_off"):
      rows, seconds = run(mode, os.path.join(tmp, mode))
      counted = [r for r in rows if r["step"] > 2]
      measured[mode] = counted
      print(f"{mode:>12}: step_s {median(counted, 'timing/step_s'):.3f}  rollout_wall_s "
            f"{median(counted, 'timing/rollout_wall_s'):.3f}  "
            f"update_wall_s {median(counted, 'timing/update_wall_s'):.3f}"
            f"  overlap {median(counted, 'timing/overlap_fraction'):.0%} of the shorter phase  "
            f"(push {median(counted, 'weights/push_s') * 1e3:.1f} ms, "
            f"{median(counted, 'weights/push_bytes') / 1e6:.2f} MB)"
            f"  [{len(counted)} steps of {len(rows)}, run {seconds:.0f} s]", flush=True)
  overlap = median(measured["one_step_off"], "timing/overlap_fraction")
  sync_s, off_s = median(measured["sync"], "timing/step_s"), median(measured["one_step_off"], "timing/step_s")
  print(f"one_step_off overlaps {overlap:.0%} of the shorter phase (need >= {THRESHOLD:.0%}); step time "
        f"{off_s:.3f} s against sync's {sync_s:.3f} s ({sync_s / off_s:.2f}x) on {os.cpu_count()} host cores")
  return 0 if overlap >= THRESHOLD else 1


if __name__ == "__main__":
  sys.exit(app.run(main) or 0)
