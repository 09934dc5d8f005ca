"""The rollout's layout chosen by its estimate with the paged kernel (issue 42, acceptance 3): tensor size and slots.

  JAX_PLATFORMS=cpu python benchmarks/rollout_layout.py --config configs/qwen3b_v5p.py \
      [--tensor=1,2] [--slots=1024,2048,4096] [--profile=rlvr]

For each layout (the rollout's `mesh.tensor`, fsdp the rest of the slice; `rollout.slots`), the rollout's programs
are compiled for the config's target (`aot.compile_run`, the rollout group: prefill, insert, decode at every page
budget; no validation programs) and costed at `max` and at `--profile` (`compile/rollout_cost.py`: the compiler's
decode time outside the paged attention kernel plus the kernel's live KV reads at the compiler's HBM rate, with
continuous batching's tail). Prints per layout: slots per chip, the rollout's memory per chip and whether it fits,
and at each profile the estimate, tokens/s per chip and its ratio to the HBM roofline of the same work; then the
layout with the shortest rollout at `--profile` among those that fit, against the config's own.

On a shared slice the rollout's tensor size is the trainer's (`mesh.tensor`): a layout of another tensor size
changes the update's mesh too (`--compile_only` of the config with it costs that); with `rollout.devices` the
rollout has its own group. Compile time: about 2 min per layout for qwen3b_v5p on a 2-core host.
"""

from __future__ import annotations

import copy
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_CONFIG = flags.DEFINE_string("config", "configs/qwen3b_v5p.py", "A config file with a TPU target.")
_TENSOR = flags.DEFINE_list("tensor", ["1", "2"], "The rollout's tensor sizes to try.")
_SLOTS = flags.DEFINE_list("slots", ["1024", "2048", "4096"], "rollout.slots to try (all chips together).")
_PROFILE = flags.DEFINE_string("profile", "rlvr", "compile.length_profile the choice is made at.")


def layout_costs(cfg, tgt, tensor: int, slots: int, log=lambda s: None) -> dict:
  """One layout's rollout: {tensor, slots, per_chip, gb, fits, costs: {profile: RolloutCost}}."""
  from pacs_jax.compile import aot
  from pacs_jax.compile.aot_measure import GB
  c = copy.deepcopy(cfg)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, tensor
  c.rollout.slots = slots
  c.train.packing_rows = 0  # the update's row budget, sized for the config's own mesh; no rollout program reads it
  c.compile.length_profile = _PROFILE.value
  report = aot.compile_run(c, tgt, validation=False, log=log, group="rollout")
  total, _ = report.phase_total("rollout")
  fits = not report.failed and (not tgt.hbm_bytes or total <= tgt.hbm_bytes)
  return {"tensor": tensor, "slots": slots, "per_chip": slots / len(tgt.devices), "gb": total / GB, "fits": fits,
          "costs": {cost.profile: cost for cost in report.rollout_costs}}


def main(_):
  from pacs_jax import config as config_lib
  from pacs_jax.compile.target import target
  cfg = config_lib.load_config_file(os.path.join(ROOT, _CONFIG.value) if not os.path.isabs(_CONFIG.value)
                                    else _CONFIG.value)
  tgt = target(cfg)
  own = (cfg.mesh.tensor, cfg.rollout.slots)
  print(f"rollout layouts of {_CONFIG.value} on {tgt.description} (config: tensor {own[0]}, {own[1]} slots), "
        f"costed at max and {_PROFILE.value}", flush=True)
  rows = []
  for tensor in (int(t) for t in _TENSOR.value):
    for slots in (int(s) for s in _SLOTS.value):
      print(f"compiling the rollout at tensor {tensor}, {slots} slots ...", flush=True)
      try:
        rows.append(layout_costs(cfg, tgt, tensor, slots))
      except config_lib.ConfigError as e:  # a layout the slice cannot hold: said, and the others go on
        print(f"  not a layout of this slice: {e}", flush=True)
  profiles = list(dict.fromkeys(p for r in rows for p in r["costs"]))
  head = f"{'tensor':>6}{'slots':>7}{'/chip':>7}{'GB/chip':>9}{'fits':>6}"
  head += "".join(f"{p + ' s':>12}{'tok/s/chip':>12}{'/roofline':>10}" for p in profiles)
  print(head)
  for r in rows:
    line = f"{r['tensor']:>6}{r['slots']:>7}{r['per_chip']:>7.0f}{r['gb']:>9.2f}{'yes' if r['fits'] else 'NO':>6}"
    for p in profiles:
      c = r["costs"].get(p)
      line += (f"{c.estimate_s:>12.2f}{c.tokens_per_s(c.estimate_s):>12,.0f}{c.estimate_s / c.roofline_s:>9.2f}x"
               if c else f"{'-':>12}{'-':>12}{'-':>10}")
    print(line)
  fitting = [r for r in rows if r["fits"] and _PROFILE.value in r["costs"]]
  if not fitting:
    print("no layout fits")
    return 1
  best = min(fitting, key=lambda r: r["costs"][_PROFILE.value].estimate_s)
  c = best["costs"][_PROFILE.value]
  mine = next((r for r in fitting if (r["tensor"], r["slots"]) == own), None)
  against = (f"; the config's {mine['costs'][_PROFILE.value].estimate_s:.2f} s"
             f" ({mine['costs'][_PROFILE.value].estimate_s / c.estimate_s:.2f}x)" if mine else "")
  print(f"chosen at {_PROFILE.value}: tensor {best['tensor']}, {best['slots']} slots ({best['per_chip']:.0f} per chip): "
        f"{c.estimate_s:.2f} s, {c.tokens_per_s(c.estimate_s):,.0f} tokens/s per chip, "
        f"{c.estimate_s / c.roofline_s:.2f}x its roofline{against}")
  return 0


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
