"""Ahead-of-time TPU compile of a config's train step (the trainer's own program: one mini-batch with its
micro-batches) from abstract weights and optimizer state: compile time on this host, per-chip memory, and the
FLOPs with loop trip counts and Pallas kernels counted, next to the model's 6N per token. `--compile_only`
compiles every program of the run; this one is the largest.

  JAX_PLATFORMS=cpu python benchmarks/train_step_compile_tpu.py --config configs/qwen3b_v5p.py
"""

from __future__ import annotations

import argparse
import ast
import os

import jax

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.models import flash
from pacs_jax.train import aot
from pacs_jax.train import aot_measure
from pacs_jax.train import hlo_cost
from pacs_jax.train import programs as programs_lib

GB = 1e9


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def compile_train_step(cfg, topology: str = ""):
  """(ProgramReport, compiled executable, mesh, mini-batch shapes) of the config's train step compiled for a
  TPU topology (default: the config's). The report's `flops` counts loops and Pallas kernels; `model_flops`
  is 6 N per token (forward + backward, N the matmul parameters; twice with a critic) per chip."""
  devices = sharding.tpu_topology_devices(topology or cfg.hardware.tpu_topology)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
  state, policy, _, progs = aot.abstract_run(cfg, mesh)
  batch = programs_lib.minibatch_shapes(cfg, mesh)
  tokens = cfg.train.mini_batch_prompts * cfg.rollout.n * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
  critic = 2.0 if progs.value_fn is not None else 1.0
  report = aot_measure.ProgramReport("train_step", "update", 1,
                                     6.0 * aot.matmul_params(policy) / len(devices) * tokens * critic)
  with jax.set_mesh(mesh), aot_measure.persistent_cache_off():
    compiled = aot_measure.measure(report, lambda: progs.train_step.lower(state, batch), lambda c: 0.0)
  return report, compiled, mesh, batch


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/qwen3b_v5p.py")
  parser.add_argument("--topology", default="", help="TPU topology (default: the config's hardware.tpu_topology)")
  parser.add_argument("--max_ratio", type=float, default=1.25,
                      help="exit 1 when compiled FLOPs exceed this many times the model's 6N per token")
  parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.remat_policy=nothing")
  args = parser.parse_args()
  cfg = config_lib.load_config_file(args.config, {k: _literal(v) for k, v in (a.split("=", 1) for a in args.set)})
  topology = args.topology or cfg.hardware.tpu_topology
  report, compiled, mesh, batch = compile_train_step(cfg, topology)
  if compiled is None:
    raise SystemExit(f"train step does not compile: {report.error[:2000]}")
  mc = config_lib.preset_model_config(cfg)
  kernel_tflop = hlo_cost.analyse(compiled.as_text()).total("kernel_flops") / 1e12
  print(f"{args.config}: {cfg.model.preset} (attention {flash.resolve(mc.attention_impl, 'tpu', mc.dtype)}, remat={mc.remat} "
        f"policy {mc.remat_policy!r}, {cfg.algorithm}) on {topology} ({mesh.size} chips), mesh {dict(mesh.shape)}, "
        f"mini-batch {batch['input_ids'].shape}, load average {os.getloadavg()[0]:.1f}")
  print(f"train step: compile {report.compile_s:.1f} s; per chip: arguments {report.argument / GB:.2f} GB, outputs "
        f"{report.output / GB:.2f} GB, aliased {report.alias / GB:.2f} GB, temporaries {report.temp / GB:.2f} GB, "
        f"peak {report.peak / GB:.2f} GB" + (f" of {cfg.hardware.hbm_gb:g} GB" if cfg.hardware.hbm_gb else ""))
  print(f"train step per chip, loop trip counts applied: {report.flops / 1e12:.0f} TFLOP compiled (of which "
        f"{kernel_tflop:.0f} in Pallas kernels) / {report.model_flops / 1e12:.0f} TFLOP model (6N per token) = "
        f"{report.flops / report.model_flops:.3f}x; optimal_seconds {report.optimal_s:.2f} (the compiler's cost model "
        "gives Pallas kernels no time)")
  if report.flops > args.max_ratio * report.model_flops:
    raise SystemExit(f"compiled FLOPs are {report.flops / report.model_flops:.3f}x the model's, above "
                     f"--max_ratio {args.max_ratio}")


if __name__ == "__main__":
  main()
