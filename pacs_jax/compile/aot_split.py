"""`--compile_only` for split devices (`rollout.devices` = k > 0, issue 33): the update programs compiled for the
trainer's group (the target's first devices, `cfg.mesh` laid out on them) and the rollout programs for the rollout's
(the last k: slots over fsdp, weights over the trainer's tensor size, as `rollout/placement.py` lays it out), each
checked to fit its group's memory, then the estimated step times: `sync` (rollout, push, update one after the other)
and overlapped (`one_step_off`: the next rollout and its push beside the update, the longer of the two).

The rollout's estimate assumes every response runs to `rollout.max_new_tokens` (the compiler's optimal times of
the decode calls that takes: the worst case). With a measured distribution whose mean is a fraction f of the
maximum, continuous batching refills the slots responses free, so the decode calls shrink about in proportion, down
to one wave's worth (the longest response still runs to its end): decode x max(f, 1 / waves); shorter responses
also read fewer KV pages per call, so that is still an upper bound. The report prints f = 1, 1/2 and 1/4.

The push's time is estimated from the rollout weights per rollout chip over the interconnect (`ICI_RECEIVE`: half of
a chip's ICI bandwidth receiving), not compiled; without a known bandwidth it is left out.
"""

from __future__ import annotations

import copy
import dataclasses

import ml_collections

from pacs_jax import sharding
from pacs_jax.compile import aot, aot_report
from pacs_jax.compile.aot_measure import GB
from pacs_jax.compile.aot_report import Report, format_report, step_seconds
from pacs_jax.compile.target import Target, TargetUnavailable, target
from pacs_jax.rollout import placement

# Bytes per second one chip receives over ICI: half its total ICI bandwidth (v5p: 4,800 Gbps per chip, Google's
# published figure), the other half left to sending.
ICI_RECEIVE = {"v5p": 4800e9 / 8 / 2}
FRACTIONS = (1.0, 0.5, 0.25)


@dataclasses.dataclass
class SplitReport:
  trainer: Report
  rollout: Report
  waves: int  # rollout waves of slots per step (every response at max length)
  push_bytes: float  # rollout weights per rollout chip
  push_s: float | None  # estimated

  @property
  def fits(self) -> bool:
    return self.trainer.fits and self.rollout.fits

  def rollout_s(self, fraction: float = 1.0) -> float:
    """The rollout's optimal seconds with responses a mean `fraction` of max_new_tokens long (module docstring)."""
    decode = step_seconds(self.rollout, "rollout", "decode")
    return step_seconds(self.rollout, "rollout") - decode + decode * max(fraction, 1.0 / self.waves)

  def estimates(self) -> list[dict]:
    """The whole RL step at the length profiles (`aot_report.rl_step_estimates`): the rollout with its kernel."""
    return aot_report.rl_step_estimates(self.trainer, self.rollout, self.push_s or 0.0)

  def step_s(self, fraction: float = 1.0) -> tuple[float, float]:
    """(sync, overlapped) optimal seconds per step."""
    update, rollout, push = step_seconds(self.trainer, "update"), self.rollout_s(fraction), self.push_s or 0.0
    return rollout + push + update, max(rollout + push, update)


def group(cfg: ml_collections.ConfigDict, tgt: Target, which: str) -> tuple[ml_collections.ConfigDict, Target]:
  """The config and target of one group ("trainer" or "rollout") of `cfg`'s split of `tgt`."""
  trainer_devices, rollout_devices = placement.split_devices(tgt.devices, cfg.rollout.devices)
  devices = tuple(trainer_devices if which == "trainer" else rollout_devices)
  sub = copy.deepcopy(cfg)
  sub.rollout.devices = 0
  if which == "rollout":
    tensor = sharding.mesh_sizes(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, len(trainer_devices))["tensor"]
    sub.mesh.data, sub.mesh.fsdp, sub.mesh.tensor = 1, -1, tensor
  hosts = len({d.process_index for d in devices})
  return sub, Target(devices, f"{tgt.description}, the {which}'s {len(devices)} {tgt.unit}s ({hosts} hosts)",
                     tgt.hbm_bytes, hosts, tgt.unit)


def compile_split(cfg: ml_collections.ConfigDict, tgt: Target, log=lambda s: None) -> SplitReport:
  why = placement.check(cfg.rollout.devices, len(tgt.devices), None, 1)
  if why:
    raise ValueError(f"config.rollout.devices: {why}")
  trainer_cfg, trainer_tgt = group(cfg, tgt, "trainer")
  log(f"trainer group: {trainer_tgt.description}")
  trainer = aot.compile_run(trainer_cfg, trainer_tgt, log=log, group="trainer")
  rollout_cfg, rollout_tgt = group(cfg, tgt, "rollout")
  log(f"rollout group: {rollout_tgt.description}")
  rollout = aot.compile_run(rollout_cfg, rollout_tgt, log=log, group="rollout")
  slots = cfg.rollout.slots or cfg.train.batch_prompts * cfg.rollout.n
  waves = -(-(cfg.train.batch_prompts * cfg.rollout.n) // slots)
  push_bytes = rollout.resident["rollout"]["rollout weights"]
  bandwidth = next((b for kind, b in ICI_RECEIVE.items() if cfg.hardware.tpu_topology.startswith(kind)), None)
  return SplitReport(trainer, rollout, waves, push_bytes, push_bytes / bandwidth if bandwidth else None)


def format_split(report: SplitReport, num_processes: int) -> str:
  lines = ["== trainer group ==", format_report(report.trainer), "",
           "== rollout group ==", format_report(report.rollout),
           "", "split devices: estimated optimal seconds per step (the compiler's times; Pallas kernels untimed)"]
  update = step_seconds(report.trainer, "update")
  push = "not estimated" if report.push_s is None else f"{report.push_s:.3f} s"
  lines.append(f"  update {update:.1f} s on the trainer's {len(report.trainer.target.devices)}; weight push "
               f"{report.push_bytes / GB:.2f} GB per rollout chip, {push}")
  lines.append(f"  {'responses (mean / max_new_tokens)':<40}{'rollout s':>10}{'sync s':>9}{'overlapped s':>14}"
               f"{'gain':>7}")
  for fraction in FRACTIONS:
    sync, overlapped = report.step_s(fraction)
    label = "every one at max (worst case)" if fraction == 1.0 else f"{fraction:g} (floor: 1 of {report.waves} waves)"
    lines.append(f"  {label:<40}{report.rollout_s(fraction):>10.1f}{sync:>9.1f}{overlapped:>14.1f}"
                 f"{sync / overlapped:>6.2f}x")
  lines += aot_report.rl_step_lines(report.estimates(), shared=False)
  why = placement.process_layout(report.trainer.target.devices, report.rollout.target.devices)
  if why:
    lines.append(f"note: training on this split is refused ({num_processes} hosts): {why}")
  lines.append("both groups fit" if report.fits else "DOES NOT FIT (see the group reports above)")
  return "\n".join(lines)


def main(cfg: ml_collections.ConfigDict, config_name: str = "", log=print) -> int:
  """`--compile_only`: the split's report when `rollout.devices` > 0, else `aot.main`'s. Exit status 0 if every
  program fits its group, 1 if not, 2 if the target cannot be compiled for here."""
  if not cfg.rollout.devices:
    return aot.main(cfg, config_name, log)
  try:
    tgt = target(cfg)
  except (TargetUnavailable, RuntimeError, ValueError) as e:
    log(f"compile only: {e}")
    return 2
  report = compile_split(cfg, tgt, log=log)
  report.trainer.config_name = report.rollout.config_name = config_name
  log(format_split(report, tgt.num_processes))
  return 0 if report.fits else 1
