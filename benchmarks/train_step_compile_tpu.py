"""Ahead-of-time TPU compile of a config's train step (the trainer's own program: one mini-batch with its
micro-batches) from abstract weights and optimizer state: compile time on this host, per-chip memory, the
compiler's cost figures. `--compile_only` compiles every program of the run; this times the largest one.

  JAX_PLATFORMS=cpu python benchmarks/train_step_compile_tpu.py --config configs/qwen3b_v5p.py
"""

from __future__ import annotations

import argparse
import ast
import os
import time

import jax
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.train import aot_measure
from pacs_jax.train import programs as programs_lib

GB = 1e9


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/qwen3b_v5p.py")
  parser.add_argument("--topology", default="", help="TPU topology (default: the config's hardware.tpu_topology)")
  parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.remat=False")
  args = parser.parse_args()
  cfg = config_lib.load_config_file(args.config, {k: _literal(v) for k, v in (a.split("=", 1) for a in args.set)})
  topology = args.topology or cfg.hardware.tpu_topology
  devices = sharding.tpu_topology_devices(topology)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
  graphdef, critic_graphdef, state = programs_lib.abstract_train_state(cfg, mesh)
  optimizer, critic_optimizer = programs_lib.make_optimizers(cfg)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  engine = programs_lib.make_engine(cfg, nnx.merge(graphdef, state.params), mesh, eos_ids=(0,))
  progs = programs_lib.make_programs(cfg, graphdef, critic_graphdef, optimizer, critic_optimizer, state_shardings,
                                     engine.param_shardings)
  batch = programs_lib.minibatch_shapes(cfg, mesh)
  with jax.set_mesh(mesh), aot_measure.persistent_cache_off():
    start = time.perf_counter()
    lowered = progs.train_step.lower(state, batch)
    lower_s = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start - lower_s
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  print(f"{args.config}: {cfg.model.preset} (remat={cfg.model.remat}, {cfg.algorithm}) on {topology} "
        f"({len(devices)} chips), mesh {dict(mesh.shape)}, mini-batch {batch['input_ids'].shape}, "
        f"load average {os.getloadavg()[0]:.1f}")
  print(f"train step: lower {lower_s:.1f} s, compile {compile_s:.1f} s; per chip: arguments "
        f"{mem.argument_size_in_bytes / GB:.2f} GB, outputs {mem.output_size_in_bytes / GB:.2f} GB, temporaries "
        f"{mem.temp_size_in_bytes / GB:.2f} GB; optimal_seconds {cost.get('optimal_seconds', float('nan')):.3f} "
        "(while bodies counted once)")


if __name__ == "__main__":
  main()
