"""A LoRA run's sampling weights, merged or unmerged, measured: the programs each choice runs in a training step's
rollout, compiled ahead of time for a config's target (`--compile_only`'s machinery: libtpu or jax's CUDA plugin, no
accelerator). docs/lora.md has the figures and the choice.

  merged    the trainer's `to_sample_params` forms W + scale · A B for every adapted kernel (fp32, full precision),
            once per policy update, in the compute dtype and the sample layout; prefill and decode run the base
            model's programs.
  unmerged  the rollout weights are the base (compute dtype, sample layout) and the adapters; every prefill and
            decode step adds scale · (x A) B beside each adapted projection.

Printed per program: memory per chip (arguments, temporaries, peak), compiled FLOPs and bytes, the compiler's
optimal time (TPU; nothing is timed for a GPU without one), calls per step (every response at full length) and
seconds per step.

  JAX_PLATFORMS=cpu python benchmarks/lora_sampling.py --config configs/qwen7b_lora_v5p8.py
  JAX_PLATFORMS=cpu python benchmarks/lora_sampling.py --config configs/qwen7b_lora_1gpu.py
"""

from __future__ import annotations

import argparse

import jax
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.compile import aot
from pacs_jax.compile.aot_measure import GB, ProgramReport, measure, per_chip_bytes, persistent_cache_off
from pacs_jax.compile.target import target
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.trainer import programs as programs_lib


def measure_both(cfg, log=print) -> list[ProgramReport]:
  """The merged run's to_sample_params, prefill (longest bucket) and decode (top page budget), and the unmerged
  equivalents, compiled for `cfg`'s target."""
  tgt = target(cfg)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=tgt.devices)
  frozen, base = aot.lora_run_base(cfg, mesh)
  state, merged_model, merged_engine, progs = aot.abstract_run(cfg, mesh, (frozen, base))
  graphdef, _, _ = programs_lib.abstract_train_state(cfg, mesh)
  unmerged_engine = programs_lib.make_rollout(cfg, nnx.merge(graphdef, state.params, base), mesh,
                                             eos_ids=(0,)).ahead_of_time()
  compute = config_lib.dtype(cfg.model.dtype)
  cast = lambda tree: jax.tree.map(lambda x: x.astype(compute), tree)
  unmerged_to_sample = jax.jit(lambda adapters, base: cast(nnx.state(nnx.merge(graphdef, adapters, base))),
                               out_shardings=unmerged_engine.param_shardings)
  to_sample = {"merged": progs.to_sample_params, "unmerged": unmerged_to_sample}
  B = merged_engine.max_concurrent_decodes
  n, P, R = cfg.rollout.n, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
  waves = -(-(cfg.train.batch_prompts * n) // B)
  rows = aot.prefill_rows(B, n, cfg.train.batch_prompts)
  sampling = sampling_lib.from_config(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
  reports = []

  def run(report, lower):
    log(f"compiling {report.name} ...")
    with jax.set_mesh(mesh), persistent_cache_off():
      measure(report, lower, lambda c: 0.0)
    log(f"  {report.compile_s:.1f} s {report.error.splitlines()[0][:300] if report.error else ''}")
    reports.append(report)

  for how, engine in (("merged", merged_engine), ("unmerged", unmerged_engine)):
    sample_params = engine.abstract_params(compute)
    run(ProgramReport(f"{how}: to_sample_params", "rollout", 1, 0.0),
        lambda: to_sample[how].lower(state.params, base))
    T = engine.prefill_buckets[-1]
    run(ProgramReport(f"{how}: prefill[B={rows},T={T}]", "rollout", waves * -(-cfg.train.batch_prompts // rows), 0.0),
        lambda: engine.lower_prefill(sample_params, rows, T))
    calls, top = aot.decode_calls(engine, P, R), engine.page_budgets[-1]
    run(ProgramReport(f"{how}: {aot.decode_name(top)}", "rollout", waves * sum(calls.values()), 0.0),
        lambda: engine.lower_decode(sample_params, engine.abstract_decode_state(), top, sampling))
    reports[-1].resident = per_chip_bytes(sample_params)  # the rollout weights
  return reports


def table(reports: list[ProgramReport], unit: str) -> str:
  lines = [f"{'program':<40}{'args GB':>9}{'temp GB':>9}{'peak GB':>9}{'TFLOP':>10}{'GB r/w':>9}{'opt ms':>10}"
           f"{'calls':>8}{'s/step':>9}"]
  for p in reports:
    if p.error:
      lines.append(f"{p.name:<40}  DOES NOT COMPILE: {p.error.splitlines()[0][:200]}")
      continue
    opt = "-" if p.optimal_s is None else f"{p.optimal_s * 1e3:.2f}"
    per_step = "-" if p.optimal_s is None else f"{p.optimal_s * p.calls:.1f}"
    lines.append(f"{p.name:<40}{p.argument / GB:>9.2f}{p.temp / GB:>9.2f}{p.peak / GB:>9.2f}"
                 f"{(p.flops or 0) / 1e12:>10.3f}{(p.bytes_accessed or 0) / GB:>9.1f}{opt:>10}{p.calls:>8.0f}"
                 f"{per_step:>9}")
  lines.append(f"(per {unit}; rollout weights: " + ", ".join(
      f"{p.name.split(':')[0]} {p.resident / GB:.2f} GB" for p in reports if p.resident) + ")")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="a LoRA config (lora.rank > 0)")
  args = parser.parse_args()
  cfg = config_lib.load_config_file(args.config)
  spec = config_lib.lora_spec(cfg)
  if spec is None:
    raise SystemExit(f"{args.config}: lora.rank is 0 (no adapters to merge)")
  with jax.default_matmul_precision("default"):  # the trainer's
    reports = measure_both(cfg)
  print(f"{args.config}: rank {spec.rank}, targets {', '.join(spec.targets)}, {cfg.rollout.slots} slots")
  print(table(reports, target(cfg).unit))


if __name__ == "__main__":
  main()
