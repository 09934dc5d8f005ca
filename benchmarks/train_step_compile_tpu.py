"""Ahead-of-time TPU compile of a config's train step (the trainer's own program: one mini-batch with its
micro-batches) and log-prob pass from abstract weights and optimizer state: compile time on this host, per-chip
memory, bytes accessed, the compiler-optimal time and the FLOPs with loop trip counts and Pallas kernels counted
(next to the model's 6N per token), and where the estimated cycles go (top loops and instructions), so a
regression shows at a glance. `--compile_only` compiles every program of the run; these are the largest.

  JAX_PLATFORMS=cpu python benchmarks/train_step_compile_tpu.py --config configs/qwen3b_v5p.py
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import re

import jax

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.models import flash
from pacs_jax.compile import aot
from pacs_jax.compile import aot_measure
from pacs_jax.compile import hlo_cost
from pacs_jax.compile import hotspots
from pacs_jax.trainer import programs as programs_lib

GB = 1e9
# MaxText 0.2.5's train step for the shapes of configs/qwen3b_v5p.py (benchmarks/reference/maxtext_train_step.sh).
REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference",
                         "maxtext-0.2.5_qwen2.5-3b_v5p-2x4x4.hlo.gz")


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _abstract(cfg, topology: str):
  """(mesh, abstract state, abstract frozen part (empty in a full run), abstract policy, programs, mini-batch shapes,
  tokens per mini-batch per chip) of the run on a TPU topology (default: the config's)."""
  devices = sharding.tpu_topology_devices(topology or cfg.hardware.tpu_topology)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
  frozen, base = aot.lora_run_base(cfg, mesh)
  state, policy, _, progs = aot.abstract_run(cfg, mesh, (frozen, base))
  tokens = cfg.train.mini_batch_prompts * cfg.rollout.n * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
  # Packed, the rows of a full-length step (a padded micro-batch's m; the released configs' top rung is larger, for
  # merged short micro-batches): the same work as the padded step and MaxText's, which the ratios compare.
  full = programs_lib.batch_layout(cfg, mesh).m if cfg.train.packing else 0
  return mesh, state, base, policy, progs, programs_lib.minibatch_shapes(cfg, mesh, full), tokens / len(devices)


def _compile(name: str, model_flops: float, mesh, lower):
  report = aot_measure.ProgramReport(name, "update", 1, model_flops)
  with jax.set_mesh(mesh), aot_measure.persistent_cache_off():
    return report, aot_measure.measure(report, lower, lambda c: 0.0)


def compile_train_step(cfg, topology: str = ""):
  """(ProgramReport, compiled executable, mesh, mini-batch shapes) of the config's train step compiled for a
  TPU topology (default: the config's). The report's `flops` counts loops and Pallas kernels; `model_flops`
  is 6 N per token (forward + backward, N the matmul parameters; twice with a critic) per chip."""
  mesh, state, base, policy, progs, batch, tokens = _abstract(cfg, topology)
  critic = 2.0 if progs.value_fn is not None else 1.0
  report, compiled = _compile("train_step", 6.0 * aot.matmul_params(policy) * tokens * critic, mesh,
                              lambda: progs.train_step.lower(state, batch, programs_lib.ends_step_shape(mesh), base))
  return report, compiled, mesh, batch


def compile_logprob_pass(cfg, topology: str = ""):
  """(ProgramReport, compiled) of the config's log-prob pass (reference / old log-probs) on one mini-batch;
  `model_flops` is 2N per token (forward only)."""
  mesh, state, base, policy, progs, batch, tokens = _abstract(cfg, topology)
  return _compile("logprobs", 2.0 * aot.matmul_params(policy) * tokens, mesh,
                  lambda: progs.logprob_fn.lower(state.params, batch, base))


def timings(loops: hlo_cost.LoopCosts, raw_optimal_s: float) -> dict[str, float]:
  """A program's time figures, loop trip counts applied: XLA's optimal_seconds scaled by the roofline (the
  figure this benchmark bounds), the compiler's estimated cycles, and optimal_seconds scaled by the cycles
  (what hlo_cost did before: not monotone in work, see its docstring)."""
  return {"optimal_s": aot_measure.loops_applied_seconds(loops, raw_optimal_s),
          "cycles": loops.total("cycles"),
          "scaled_by_cycles_s": aot_measure.loops_applied_seconds(loops, raw_optimal_s, "cycles")}


def describe_timings(name: str, t: dict[str, float]) -> str:
  return (f"{name}: optimal_seconds {t['optimal_s']:.2f} (scaled by the roofline; by the cycles: "
          f"{t['scaled_by_cycles_s']:.2f}), estimated cycles {t['cycles'] / 1e9:.2f} G")


def costs(compiled) -> hlo_cost.LoopCosts:
  """The loop-aware costs of a compiled program at its chip's rates (read once per program)."""
  return hlo_cost.analyse(compiled.as_text(), aot_measure.compiler_rates(compiled))


def describe(report, compiled, loops: hlo_cost.LoopCosts, hbm_gb) -> str:
  """Per chip: compiler-optimal seconds, bytes accessed, FLOPs against the model's, peak; then the hotspots."""
  return (f"{report.name} per chip, loop trip counts applied: optimal_seconds {report.optimal_s:.2f} (Pallas kernels "
          f"get no time in the compiler's cost model), bytes accessed {report.bytes_accessed / 1e12:.2f} TB, "
          f"{report.flops / 1e12:.0f} TFLOP compiled ({loops.total('kernel_flops') / 1e12:.0f} in Pallas kernels) / "
          f"{report.model_flops / 1e12:.0f} model = {report.flops / report.model_flops:.3f}x, peak "
          f"{report.peak / GB:.2f} GB" + (f" of {hbm_gb:g}" if hbm_gb else "") + f"; compile {report.compile_s:.0f} s\n"
          + f"  {describe_timings('time', timings(loops, report.raw_optimal_s))}\n"
          + hotspots.format_hotspots(compiled.as_text()))


def reference_timings(path: str, rates) -> dict[str, float]:
  """The time figures of a reference program's compiled HLO (`.hlo` or `.hlo.gz`) beside its cost analysis
  (`<path without .hlo[.gz]>.json`: XLA's optimal_seconds, flops, bytes accessed, memory), at our chip's rates."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    loops = hlo_cost.analyse(f.read(), rates)
  with open(re.sub(r"\.hlo(\.gz)?$", ".json", path)) as f:
    cost = json.load(f)
  return timings(loops, cost["optimal_seconds"]) | {"bytes": cost["bytes accessed"] + loops.total("bytes")
                                                   - loops.total("bytes", weighted=False)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/qwen3b_v5p.py")
  parser.add_argument("--topology", default="", help="TPU topology (default: the config's hardware.tpu_topology)")
  parser.add_argument("--max_ratio", type=float, default=1.25,
                      help="exit 1 when compiled FLOPs exceed this many times the model's 6N per token")
  parser.add_argument("--max_seconds", type=float, default=0.0,
                      help="exit 1 when the train step's optimal_seconds (loops applied) exceed this (0: no bound)")
  parser.add_argument("--max_bytes_tb", type=float, default=0.0,
                      help="exit 1 when the train step's bytes accessed per chip (loops applied) exceed this many TB")
  parser.add_argument("--max_peak_gb", type=float, default=0.0,
                      help="exit 1 when the train step's peak memory per chip exceeds this many GB")
  parser.add_argument("--logprobs", action=argparse.BooleanOptionalAction, default=True,
                      help="also compile the log-prob pass and compare its optimal_seconds with the train step's")
  parser.add_argument("--max_logprob_ratio", type=float, default=0.4,
                      help="exit 1 when the log-prob pass takes more than this share of the train step")
  parser.add_argument("--reference", default="",
                      help="a peer's compiled train step for the same shapes (.hlo[.gz] beside its cost analysis "
                           f".json) to print side by side, e.g. {os.path.relpath(REFERENCE)} for configs/qwen3b_v5p.py")
  parser.add_argument("--max_reference_ratio", type=float, default=0.0,
                      help="exit 1 when the train step's optimal_seconds exceed this many times the reference's")
  parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.remat_policy=nothing")
  args = parser.parse_args()
  cfg = config_lib.load_config_file(args.config, {k: _literal(v) for k, v in (a.split("=", 1) for a in args.set)})
  topology = args.topology or cfg.hardware.tpu_topology
  report, compiled, mesh, batch = compile_train_step(cfg, topology)
  if compiled is None:
    raise SystemExit(f"train step does not compile: {report.error[:2000]}")
  mc = config_lib.preset_model_config(cfg)
  print(f"{args.config}: {cfg.model.preset} (attention {flash.resolve(mc.attention_impl, 'tpu', mc.dtype)}, remat={mc.remat} "
        f"policy {mc.remat_policy!r}, {cfg.algorithm}) on {topology} ({mesh.size} chips), mesh {dict(mesh.shape)}, "
        f"mini-batch {batch['input_ids'].shape}, load average {os.getloadavg()[0]:.1f}")
  print(f"train step: compile {report.compile_s:.1f} s; per chip: arguments {report.argument / GB:.2f} GB, outputs "
        f"{report.output / GB:.2f} GB, aliased {report.alias / GB:.2f} GB, temporaries {report.temp / GB:.2f} GB, "
        f"peak {report.peak / GB:.2f} GB" + (f" of {cfg.hardware.hbm_gb:g} GB" if cfg.hardware.hbm_gb else ""))
  loops = costs(compiled)
  print(describe(report, compiled, loops, cfg.hardware.hbm_gb))
  failures = []
  if report.flops > args.max_ratio * report.model_flops:
    failures.append(f"compiled FLOPs are {report.flops / report.model_flops:.3f}x the model's, above --max_ratio "
                    f"{args.max_ratio}")
  if args.max_seconds and report.optimal_s > args.max_seconds:
    failures.append(f"train step optimal_seconds {report.optimal_s:.2f} above --max_seconds {args.max_seconds}")
  if args.max_bytes_tb and report.bytes_accessed > args.max_bytes_tb * 1e12:
    failures.append(f"train step bytes accessed {report.bytes_accessed / 1e12:.2f} TB above --max_bytes_tb "
                    f"{args.max_bytes_tb}")
  if args.max_peak_gb and report.peak > args.max_peak_gb * GB:
    failures.append(f"train step peak {report.peak / GB:.2f} GB above --max_peak_gb {args.max_peak_gb}")
  if args.reference:
    ours = timings(loops, report.raw_optimal_s)
    ref = reference_timings(args.reference, aot_measure.compiler_rates(compiled))
    print(f"reference {os.path.basename(args.reference)} (same chip rates): {describe_timings('time', ref)}, "
          f"bytes accessed {ref['bytes'] / 1e12:.2f} TB\n  train step / reference: optimal_seconds "
          f"{ours['optimal_s'] / ref['optimal_s']:.3f}, estimated cycles {ours['cycles'] / ref['cycles']:.3f}, "
          f"scaled by cycles {ours['scaled_by_cycles_s'] / ref['scaled_by_cycles_s']:.3f}, bytes "
          f"{report.bytes_accessed / ref['bytes']:.3f}")
    if args.max_reference_ratio and ours["optimal_s"] > args.max_reference_ratio * ref["optimal_s"]:
      failures.append(f"train step optimal_seconds {ours['optimal_s']:.2f} above --max_reference_ratio "
                      f"{args.max_reference_ratio} x the reference's {ref['optimal_s']:.2f}")
  if args.logprobs:
    lp, lp_compiled = compile_logprob_pass(cfg, topology)
    if lp_compiled is None:
      raise SystemExit(f"log-prob pass does not compile: {lp.error[:2000]}")
    print(describe(lp, lp_compiled, costs(lp_compiled), cfg.hardware.hbm_gb))
    ratio = lp.optimal_s / report.optimal_s
    print(f"log-prob pass / train step, optimal_seconds: {ratio:.3f} (the forward's share is about 1/3)")
    if ratio > args.max_logprob_ratio:
      failures.append(f"log-prob pass is {ratio:.3f}x the train step, above --max_logprob_ratio {args.max_logprob_ratio}")
  if failures:
    raise SystemExit("; ".join(failures))


if __name__ == "__main__":
  main()
