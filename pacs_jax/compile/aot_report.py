"""A `--compile_only` report: every program's memory and cost per chip, the resident total per phase, and the fits
verdict; `format_report` prints it."""

from __future__ import annotations

import dataclasses
import os
import re

from pacs_jax.compile.aot_measure import GB, ProgramReport
from pacs_jax.compile.target import Target


@dataclasses.dataclass
class Report:
  config_name: str
  target: Target
  mesh_shape: dict
  programs: list[ProgramReport]
  resident: dict[str, dict[str, float]]  # phase -> {part: bytes per chip}
  notes: list[str]
  # The update phase per step at length profiles, padded and packed (`aot.update_at_profiles`)
  profiles: list[dict] = dataclasses.field(default_factory=list)
  # The rollout with its paged attention kernel at length profiles (`aot_rollout.rollout_at_profiles`)
  rollout_costs: list = dataclasses.field(default_factory=list)
  packed: bool = False  # the run's update runs packed rows (`train.packing`): its cost follows the profile

  def phase_total(self, phase: str) -> tuple[float, ProgramReport | None]:
    """(resident + the largest program's extra bytes, that program) of a phase."""
    progs = [p for p in self.programs if p.phase == phase and not p.error]
    largest = max(progs, key=lambda p: p.extra, default=None)
    return sum(self.resident[phase].values()) + (largest.extra if largest else 0.0), largest

  @property
  def failed(self) -> list[ProgramReport]:
    return [p for p in self.programs if p.error]

  def problems(self) -> list[str]:
    """Why the run would not fit (empty when it fits or no memory limit is known)."""
    unit = self.target.unit
    out = [_compile_problem(p, self.target.description, unit) for p in self.failed]
    hbm = self.target.hbm_bytes
    if hbm:
      for p in self.programs:
        if not p.error and p.peak > hbm:
          out.append(f"{p.name} needs {p.peak / GB:.2f} GB per {unit} by itself (> {hbm / GB:g} GB)")
      for phase in self.resident:
        total, largest = self.phase_total(phase)
        if total > hbm:
          out.append(f"{phase} phase needs {total / GB:.2f} GB per {unit} > {hbm / GB:g} GB (resident "
                     f"{sum(self.resident[phase].values()) / GB:.2f} GB + {largest.name if largest else '-'} "
                     f"{(largest.extra if largest else 0) / GB:.2f} GB)")
    return out

  @property
  def fits(self) -> bool:
    return not self.problems()


_UNITS = {"K": 1e3 / GB, "M": 1e6 / GB, "G": 1.0, "T": 1e3}


def _compile_problem(p: ProgramReport, where: str, unit: str = "chip") -> str:
  """One failed program: XLA's out-of-memory figure (`Used 160.5G of 95.74G hbm`, `... (96.20G) exceeds available
  HBM (95.74G)`) as GB per chip, else its error."""
  m = (re.search(r"Used ([\d.]+)([KMGT])? of ([\d.]+)([KMGT])? hbm", p.error) or
       re.search(r"\(([\d.]+)([KMGT])?\) exceeds available HBM \(([\d.]+)([KMGT])?\)", p.error))
  if m:
    used, cap = float(m.group(1)) * _UNITS[m.group(2) or "G"], float(m.group(3)) * _UNITS[m.group(4) or "G"]
    return f"{p.name} ({p.phase}) needs {used:.2f} GB per {unit}, more than the {cap:.2f} GB XLA can use on {where}"
  return f"{p.name} ({p.phase}) does not compile for {where}: {p.error.splitlines()[0][:400]}"


def _gb(x: float | None) -> str:
  return "-" if x is None else f"{x / GB:.2f}"


def step_seconds(report: Report, phase: str | None = None, prefix: str = "") -> float:
  """The compiler's optimal seconds per training step: Σ calls x optimal seconds per call."""
  return sum(p.calls * (p.optimal_s or 0.0) for p in report.programs
             if (phase is None or p.phase == phase) and p.name.startswith(prefix))


def kernel_lines(report: Report) -> list[str]:
  """Which programs call which kernels by name (cuDNN attention, Pallas kernels): the attention path the config's
  dtype and target selected, seen in the compiled programs."""
  programs: dict[str, list[str]] = {}
  for p in report.programs:
    if p.custom_calls:
      names = programs.setdefault(", ".join(p.custom_calls), [])
      name = p.name.split("[")[0]
      names += [name] if name not in names else []
  return [f"custom calls {calls}: {', '.join(names)}" for calls, names in programs.items()]


def format_report(report: Report) -> str:
  unit = report.target.unit
  timed = any(p.optimal_s is not None for p in report.programs)
  lines = [f"compile only: {report.config_name} for {report.target.description}, mesh {report.mesh_shape}",
           f"per {unit}; flops, bytes{' and optimal time' if timed else ''} per call with loop trip counts applied "
           "(the compiler's own figures count each loop body once)", ""]
  head = (f"{'program':<30}{'compile s':>10}{'args GB':>9}{'out GB':>8}{'temp GB':>9}{'peak GB':>9}"
          f"{'TFLOP':>10}{'model':>10}{'GB r/w':>9}{'opt ms':>10}{'calls':>8}  loops")
  lines.append(head)
  for p in report.programs:
    if p.error:
      lines.append(f"{p.name:<30}{p.compile_s:>10.1f}  DOES NOT COMPILE: {p.error.splitlines()[0][:300]}")
      continue
    loops = ",".join(str(loop.trip_count if loop.trip_count is not None else "?") for loop in p.loops[:6])
    loops += ",…" if len(p.loops) > 6 else ""
    tflop = "-" if p.flops is None else f"{p.flops / 1e12:.3f}"
    model = f"{p.model_flops / 1e12:.3f}" if p.model_flops else "-"
    opt = "-" if p.optimal_s is None else f"{p.optimal_s * 1e3:.2f}"
    lines.append(f"{p.name:<30}{p.compile_s:>10.1f}{_gb(p.argument):>9}{_gb(p.output):>8}{_gb(p.temp):>9}"
                 f"{_gb(p.peak):>9}{tflop:>10}{model:>10}{_gb(p.bytes_accessed):>9}{opt:>10}{p.calls:>8.0f}  {loops}")
  lines.append("")
  lines.append(f"resident per {unit} (GB)")
  phases = list(report.resident)
  parts = list(dict.fromkeys(k for ph in phases for k in report.resident[ph]))
  lines.append(f"  {'':<34}" + "".join(f"{ph:>12}" for ph in phases))
  for part in parts:
    lines.append(f"  {part:<34}" + "".join(
        f"{_gb(report.resident[ph][part]) if part in report.resident[ph] else '-':>12}" for ph in phases))
  largest = {ph: report.phase_total(ph) for ph in phases}
  lines.append(f"  {'+ largest program (temporaries etc.)':<34}" + "".join(
      f"{_gb(largest[ph][1].extra if largest[ph][1] else 0.0):>12}" for ph in phases))
  lines.append(f"  {'  which':<34}" + "".join(f"{(largest[ph][1].name if largest[ph][1] else '-')[:11]:>12}"
                                             for ph in phases))
  lines.append(f"  {'total':<34}" + "".join(f"{_gb(largest[ph][0]):>12}" for ph in phases))
  lines.append("")
  train = next((p for p in report.programs if p.name == "train_step" and not p.error), None)
  if train is not None:
    lines.append(f"train step compile: {train.compile_s:.1f} s on this host ({os.cpu_count()} cores, load average "
                 f"{train.load_average:.1f})")
  if timed:
    rollout_s, update_s = step_seconds(report, "rollout"), step_seconds(report, "update")
    lines.append(f"compiler's optimal time per step: update {update_s:.1f} s, rollout {rollout_s:.1f} s (upper bound: "
                 "every response at max_new_tokens)")
  model = sum(p.calls * p.model_flops for p in report.programs)
  compiled = sum(p.calls * (p.flops or 0.0) for p in report.programs)
  update = "4N (LoRA: no weight gradient)" if "adapters" in report.resident.get("update", {}) else "6N"
  lines.append(f"FLOPs per step per {unit}: compiled {compiled / 1e15:.2f} PFLOP, model ({update} / 2N per token) "
               f"{model / 1e15:.2f} PFLOP")
  lines += kernel_lines(report)
  lines += profile_lines(report)
  lines += rollout_lines(report)
  lines += rl_step_lines(rl_step_estimates(report), shared=True)
  lines += [f"note: {n}" for n in report.notes]
  problems = report.problems()
  hbm = report.target.hbm_bytes
  if problems:
    memory_only = all(f"GB per {unit}" in p for p in problems)
    lines.append(f"DOES NOT FIT in {hbm / GB:g} GB per {unit}:" if memory_only and hbm else "DOES NOT COMPILE:")
    lines += [f"  {p}" for p in problems]
  elif hbm:
    totals = ", ".join(f"{ph} {largest[ph][0] / GB:.2f} GB ({100 * largest[ph][0] / hbm:.0f}%)" for ph in phases)
    lines.append(f"fits in {hbm / GB:g} GB per {unit}: {totals}")
  else:
    lines.append("no memory limit known (hardware.hbm_gb = 0): no verdict")
  return "\n".join(lines)


def profile_lines(report: Report) -> list[str]:
  """The update phase per step at each length profile, padded and packed (estimated cycles per chip, loops
  applied), each packed figure against the padded one and against its share of real tokens."""
  if not report.profiles:
    return []
  padded = next(p for p in report.profiles if p["layout"] == "padded")
  base = padded["cycles"] or float("nan")
  lines = [f"update phase per step by length profile (estimated cycles per {report.target.unit}, loops applied):",
           f"  padded (every profile: {padded['rows']} rows of P + R per micro-batch): {base / 1e9:.4g} G"]
  for p in report.profiles:
    if p["layout"] != "packed":
      continue
    ratio = p["cycles"] / base
    lines.append(f"  packed at {p['profile']} (prompts {p['mean_prompt']:.0f}, responses {p['mean_response']:.0f} tokens "
                 f"on average; real tokens {100 * p['real_share']:.1f}% of the padded rows): {p['merge']} micro-batches in "
                 f"{p['rows']} rows, {p['cycles'] / 1e9:.4g} G = {ratio:.3f}x padded, {ratio / p['real_share']:.2f}x the "
                 "real tokens' share")
  return lines


def rollout_lines(report: Report) -> list[str]:
  """The rollout per step at each length profile: the compiler's decode time plus the paged kernel's reads, beside
  the HBM roofline of the same work, in seconds and generated tokens per second per chip."""
  if not report.rollout_costs:
    return []
  lines = [f"rollout per step by length profile (decode with its paged attention kernel, per {report.target.unit}):"]
  sec = lambda x: f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.3g} ms"
  for c in report.rollout_costs:
    lines.append(
        f"  {c.profile}: {c.steps} decode steps ({c.mean_busy:.0f} slots busy on average), {sec(c.estimate_s)} = "
        f"{sec(c.outside_s)} outside the kernel + {sec(c.kernel_s)} in it ({c.kernel_bytes / GB:.3g} GB of live KV "
        f"rows); {c.tokens_per_s(c.estimate_s):,.0f} tokens/s per {report.target.unit}, roofline (weights and live KV "
        f"once per step) {c.tokens_per_s(c.roofline_s):,.0f}: {c.estimate_s / c.roofline_s:.2f}x its time")
    if len(c.rung_steps) > 1:  # the slot ladder: the tail's steps in fewer slots
      lines.append("    decode steps by slot rung: " + ", ".join(f"{b} slots {k}" for b, k in c.rung_steps.items()))
  return lines


def rl_step_estimates(trainer: Report, rollout: Report | None = None, push_s: float = 0.0) -> list[dict]:
  """The whole RL step per length profile, estimated seconds: [{profile, update_s, rollout_s, sync_s,
  overlapped_s}]. The update: the run's update phase (padded, or packed at the profile as the run packs) at its
  compiler time scaled by its estimated cycles (`profiles`); the rollout: the decode with its paged kernel
  (`rollout_costs`) plus the rollout's other programs (prefill, insert, ...) at their compiler times. `rollout`
  None: one slice runs both phases in turn (sync; one_step_off there is about the same, the rollout's host work
  beside the update its only gain), overlapped None; else the split's rollout group, the next rollout and its
  weight push (`push_s`) beside the update. [] where a figure is missing (a GPU compiled for without one, a packed
  update without `compile.length_profile`)."""
  source = rollout or trainer
  other = step_seconds(source, "rollout") - step_seconds(source, "rollout", "decode")
  updates = {p["profile"]: p["seconds"] for p in trainer.profiles if p.get("run") and p.get("seconds")}
  padded = None if trainer.packed else step_seconds(trainer, "update")  # the same at every profile
  out = []
  for cost in source.rollout_costs:
    update = updates.get(cost.profile, padded)
    if update is None:
      continue
    sample = cost.estimate_s + other
    out.append({"profile": cost.profile, "update_s": update, "rollout_s": sample,
                "sync_s": sample + push_s + update,
                "overlapped_s": None if rollout is None else max(sample + push_s, update)})
  return out


def rl_step_lines(estimates: list[dict], shared: bool) -> list[str]:
  if not estimates:
    return []
  if shared:
    return ["whole RL step by length profile (estimated seconds; sync, and one_step_off on these chips about the "
            "same):"] + [f"  {e['profile']}: update {e['update_s']:.1f} + rollout {e['rollout_s']:.1f} = "
                         f"{e['sync_s']:.1f} s" for e in estimates]
  lines = ["whole RL step by length profile (estimated seconds; rollout with its paged kernel, update at the "
           "profile's rows):", f"  {'profile':<12}{'update s':>10}{'rollout s':>11}{'sync s':>9}{'overlapped s':>14}"
           f"{'gain':>7}"]
  for e in estimates:
    lines.append(f"  {e['profile']:<12}{e['update_s']:>10.1f}{e['rollout_s']:>11.1f}{e['sync_s']:>9.1f}"
                 f"{e['overlapped_s']:>14.1f}{e['sync_s'] / e['overlapped_s']:>6.2f}x")
  return lines
