"""Ahead-of-time TPU compile of a config's train step (one mini-batch with its micro-batches) from abstract
weights and optimizer state: compile time on this host, per-chip memory, the compiler's cost figures.

  JAX_PLATFORMS=cpu python benchmarks/train_step_compile_tpu.py --config configs/qwen3b_v5p.py --topology v5p:2x4x4
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.models import qwen2
from pacs_jax.train import state as state_lib
from pacs_jax.train import step as step_lib

GB = 1e9


def abstract_train_state(cfg, mc: qwen2.Qwen2Config, optimizer, mesh):
  """(graphdef, TrainState of ShapeDtypeStructs in the train-mode shardings): nothing is allocated."""
  model = nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(mc, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)
  shardings = sharding.state_shardings(params, mesh, "train")
  is_var = lambda x: isinstance(x, nnx.Variable)
  params = jax.tree.map(lambda v, sh: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)), params,
                        shardings, is_leaf=is_var)
  opt_state = jax.eval_shape(optimizer.init, params)
  replicated = NamedSharding(mesh, P())
  opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, params,
                                        transform_non_params=lambda _: replicated)
  opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(s, "sharding", replicated)),
                           opt_state, opt_shardings)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  return graphdef, state_lib.TrainState(step=step, params=params, opt_state=opt_state, rng=rng)


def abstract_minibatch(cfg, mesh) -> dict:
  """One mini-batch [k micro-batches, m rows, ...], rows over (data, fsdp)."""
  micro = cfg.train.micro_batch_prompts or cfg.train.mini_batch_prompts
  k, m = cfg.train.mini_batch_prompts // micro, micro * cfg.rollout.n
  P_, R = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
  sh = lambda ndim: NamedSharding(mesh, P(None, sharding.BATCH_AXES, *([None] * (ndim - 2))))
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh(len(shape)))
  return {"input_ids": sds((k, m, P_ + R), jnp.int32), "attention_mask": sds((k, m, P_ + R), jnp.int32),
          "response_mask": sds((k, m, R), jnp.float32), "rewards": sds((k, m), jnp.float32),
          "ref_logprobs": sds((k, m, R), jnp.float32)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/qwen3b_v5p.py")
  parser.add_argument("--topology", default="v5p:2x4x4")
  parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0 = keep)")
  parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.remat=False")
  args = parser.parse_args()
  cfg = config_lib.load_config_file(args.config, {k: _literal(v) for k, v in (a.split("=", 1) for a in args.set)})
  if cfg.algorithm != "pacs":
    raise SystemExit("this quick benchmark builds PACS mini-batches only")
  from jax.experimental import topologies
  devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology, chip_config_name="default",
                                         chips_per_host_bounds=(2, 2, 1), num_slices=1).devices
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
  mc = config_lib.preset_model_config(cfg)
  if args.layers:
    mc = mc.replace(num_hidden_layers=args.layers)
  optimizer = state_lib.make_optimizer(cfg.train, cfg.train.lr, cfg.steps)
  graphdef, state = abstract_train_state(cfg, mc, optimizer, mesh)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  step = jax.jit(step_lib.make_train_step(cfg, graphdef, optimizer), in_shardings=(state_shardings, None),
                 out_shardings=(state_shardings, None), donate_argnums=(0,))
  batch = abstract_minibatch(cfg, mesh)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = step.lower(state, batch)
  lower_s = time.perf_counter() - start
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start - lower_s
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  print(f"{args.config}: {cfg.model.preset} ({mc.num_hidden_layers} layers, remat={mc.remat}) on {args.topology} "
        f"({len(devices)} chips), mesh {dict(mesh.shape)}, mini-batch {batch['input_ids'].shape}")
  print(f"train step: lower {lower_s:.1f} s, compile {compile_s:.1f} s; per chip: arguments "
        f"{mem.argument_size_in_bytes / GB:.2f} GB, outputs {mem.output_size_in_bytes / GB:.2f} GB, temporaries "
        f"{mem.temp_size_in_bytes / GB:.2f} GB; optimal_seconds {cost.get('optimal_seconds', float('nan')):.3f} "
        "(while bodies counted once)")


def _literal(text: str):
  import ast
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


if __name__ == "__main__":
  main()
