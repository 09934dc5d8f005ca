"""`--dry_run`: builds the model and optimizer abstractly on an abstract mesh of the target size and reports
an estimate of per-device memory (params, optimizer state, reference model, rollout weights, KV cache, activations;
a LoRA run's frozen base apart from its adapters, whose Adam moments are the optimizer state, and no reference copy).

Weights and optimizer state are exact (their shapes and PartitionSpecs are the ones training uses);
activations are a formula's estimate of the train step's peak with per-layer remat. The compiler's own
figures come from `--compile_only` (`pacs_jax.compile.aot`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.algos import algorithms
from pacs_jax.models import flash, lora
from pacs_jax.models import families
from pacs_jax.models.model_config import ModelConfig
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import train_state as state_lib

GB = 1e9


def abstract_mesh(cfg: ml_collections.ConfigDict, num_devices: int) -> AbstractMesh:
  sizes = sharding.mesh_sizes(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, num_devices)
  return AbstractMesh(tuple(sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES)


def _shard_bytes(shape, dtype, spec: PartitionSpec, mesh_shape: dict[str, int]) -> float:
  parts = 1
  for axis in spec:
    if axis is None:
      continue
    for a in (axis if isinstance(axis, tuple) else (axis,)):
      parts *= mesh_shape[a]
  return math.prod(shape) * jnp.dtype(dtype).itemsize / parts


def tree_bytes_per_device(tree: Any, specs: Any, mesh_shape: dict[str, int]) -> float:
  leaves = jax.tree.leaves(tree)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return sum(_shard_bytes(x.shape, x.dtype, s, mesh_shape) for x, s in zip(leaves, spec_leaves, strict=True))


def _values(state: nnx.State, dtype=None) -> Any:
  return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, dtype or v.dtype), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_bytes_per_device(state: nnx.State, mesh: AbstractMesh, mode: str, dtype=None) -> float:
  """Bytes per device of an abstract nnx.State in `mode`'s layout (in `dtype`, default its own)."""
  return tree_bytes_per_device(_values(state, dtype), sharding.state_specs(state, mesh, mode), dict(mesh.shape))


def trained_and_frozen(cfg: ml_collections.ConfigDict, mc: ModelConfig) -> tuple[nnx.State, nnx.State | None]:
  """The policy's trained parameters and its frozen ones, abstract, split as the trainer splits them
  (`adapters.abstract_policy`): all and None, or a LoRA run's adapters and base."""
  _, params, base, _ = adapters_lib.abstract_policy(lambda: families.causal_lm(mc, rngs=nnx.Rngs(0)),
                                                    config_lib.lora_spec(cfg))
  return params, base if jax.tree.leaves(base) else None


def estimate(cfg: ml_collections.ConfigDict, num_devices: int) -> dict[str, float]:
  """Per-device bytes of each part of a training run on `num_devices` devices (a LoRA run's frozen `base`, then its
  `adapters` and their Adam moments, and no reference copy: the reference is the base)."""
  config_lib.validate(cfg, num_devices, cfg.hardware.num_processes or 1, check_paths=False)
  mesh = abstract_mesh(cfg, num_devices)
  mesh_shape = dict(mesh.shape)
  mc = config_lib.preset_model_config(cfg)
  params, base = trained_and_frozen(cfg, mc)
  train_specs = sharding.state_specs(params, mesh, "train")

  out = {}
  if base is not None:
    out["base"] = state_bytes_per_device(base, mesh, "train")
  trained = out["params" if base is None else "adapters"] = state_bytes_per_device(params, mesh, "train")
  optimizer = state_lib.make_optimizer(cfg.train, cfg.train.lr, cfg.steps)
  opt_state = jax.eval_shape(optimizer.init, _values(params))
  # Adam's moments are laid out like their parameters; counters and hyperparameters are scalars.
  opt_specs = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, train_specs,
                                                  transform_non_params=lambda _: PartitionSpec(),
                                                  is_leaf=lambda x: isinstance(x, PartitionSpec))
  out["optimizer"] = tree_bytes_per_device(opt_state, opt_specs, mesh_shape)
  algo = algorithms.of(cfg)
  out["reference"] = trained if algo.reference(cfg) is algorithms.Reference.FROZEN and base is None else 0.0
  if algo.has_critic:  # a critic of the same size (a LoRA run's: adapters on the policy's base), with its Adam state
    out["critic"] = trained + out["optimizer"]
  # Rollout weights: a sample-mode copy in the compute dtype while sampling (a LoRA run's: merged into the base).
  out["rollout_weights"] = state_bytes_per_device(params if base is None else base, mesh, "sample", mc.dtype)

  batch_shards = mesh_shape["data"] * mesh_shape["fsdp"]
  tensor = mesh_shape["tensor"]
  layers, K, H = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_size
  L = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
  slots = cfg.rollout.slots or cfg.train.batch_prompts * cfg.rollout.n
  kv_tensor = tensor if K % tensor == 0 else 1
  # The page pool of a batch shard (kv_pages = 0: every slot's pages and a null page).
  ps, pages = cfg.rollout.page_size, cfg.rollout.kv_pages
  rows = ps * (pages / batch_shards if pages else (slots / batch_shards) * -(-L // ps) + 1)
  out["kv_cache"] = rows * layers * 2 * (K / kv_tensor) * H * jnp.dtype(mc.dtype).itemsize
  out["activations"] = activation_bytes(cfg, mc, batch_shards, tensor, L)
  return out


def activation_bytes(cfg, mc: ModelConfig, batch_shards: int, tensor: int, T: int) -> float:
  """Peak of one micro-batch's forward + backward on a device (estimate).

  With remat, each layer keeps its input [m, T, D] and, with remat_policy "matmuls", its weight matmuls'
  outputs (q, k, v, o, gate, up, down) and the splash kernel's output and log-sum-exp; one layer at a time
  holds its internals: fp32 attention scores and probabilities [m, N/t, T or attention_chunk, T] (XLA
  attention; none with a flash kernel), q/k/v/out and the MLP's [m, T, F/t] activations; the log-prob head
  holds one chunk of fp32 logits [m, C, V/t] (and its gradient). A LoRA run's "matmuls" keeps each adapter's two
  matmul outputs too: x A [m, T, I] and (x A) B, as large as its projection's.
  """
  micro_prompts = cfg.train.micro_batch_prompts or cfg.train.mini_batch_prompts
  m = max(1.0, micro_prompts * cfg.rollout.n / batch_shards)
  b = jnp.dtype(mc.dtype).itemsize
  D, F, N, V = mc.hidden_size, mc.intermediate_size, mc.num_attention_heads, mc.vocab_size
  heads = N / tensor if N % tensor == 0 else N
  layers, K, H = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_size
  residuals = (layers if mc.remat else 0) * m * T * D * b
  per_layer_saved = (0 if mc.remat else layers) * m * T * (6 * D + 3 * F / tensor) * b
  if mc.remat and mc.remat_policy == "matmuls":
    per_layer_saved = layers * m * T * ((2 * heads + 2 * K / tensor) * H * b + 2 * D * b + 2 * F / tensor * b + heads * 4)
    spec = config_lib.lora_spec(cfg)
    if spec is not None:
      outputs = {"q": heads * H, "k": K / tensor * H, "v": K / tensor * H, "o": D, "gate": F / tensor,
                 "up": F / tensor, "down": D}
      per_layer_saved += layers * m * T * sum(outputs[t] + spec.rank for t in lora.validate(spec, mc)) * b
  target = "tpu" if cfg.hardware.tpu_topology else "gpu" if cfg.hardware.gpu_target else None  # else this backend
  flash_kernel = flash.resolve(mc.attention_impl, target, mc.dtype) != "xla"
  queries = 0 if flash_kernel else min(T, mc.attention_chunk or T)  # query rows whose fp32 scores are live at once
  attention = 2 * m * heads * queries * T * 4 + 4 * m * T * N * H / tensor * b
  mlp = 3 * m * T * F / tensor * b
  logits_chunk = 3 * m * 128 * V / tensor * 4
  return residuals + per_layer_saved + 2 * (attention + mlp) + logits_chunk + 4 * m * T * D * 4


# Parts held in one phase only: the rollout's weights and KV cache are freed before the update, whose activations
# live only in the train step (`--compile_only` counts the phases the same way).
ROLLOUT_ONLY, UPDATE_ONLY = ("rollout_weights", "kv_cache"), ("activations",)


def phase_totals(parts: dict[str, float]) -> dict[str, float]:
  """{phase: bytes per device} of an `estimate`: everything but the other phase's own parts."""
  return {"rollout": sum(v for k, v in parts.items() if k not in UPDATE_ONLY),
          "update": sum(v for k, v in parts.items() if k not in ROLLOUT_ONLY)}


def report(cfg: ml_collections.ConfigDict, num_devices: int, hbm_gb: float | None = None) -> str:
  parts = estimate(cfg, num_devices)
  phases = phase_totals(parts)
  total = max(phases.values())
  mesh = dict(abstract_mesh(cfg, num_devices).shape)
  lines = [f"dry run: {cfg.model.preset} on {num_devices} devices ({cfg.hardware.num_processes or 1} processes), mesh {mesh}",
           f"{'part':<18}{'GB / device':>12}"]
  lines += [f"{k:<18}{v / GB:>12.2f}" for k, v in parts.items()]
  lines += [f"{phase + ' phase':<18}{v / GB:>12.2f}" for phase, v in phases.items()]
  lines.append(f"{'total':<18}{total / GB:>12.2f}")
  if hbm_gb:
    verdict = "fits" if total / GB < hbm_gb else "DOES NOT FIT"
    lines.append(f"{verdict} in {hbm_gb:g} GB per device ({100 * total / GB / hbm_gb:.0f}%)")
  return "\n".join(lines)


def dry_run(cfg: ml_collections.ConfigDict) -> str:
  """`--dry_run`: the estimate, after laying the mesh out on the target's devices when libtpu can describe them;
  says plainly that it is an estimate and where the compiled figures come from."""
  import importlib.util
  topology = cfg.hardware.tpu_topology
  lines = []
  if topology and importlib.util.find_spec("libtpu") is not None:
    devices = sharding.tpu_topology_devices(topology)
    config_lib.validate(cfg, num_processes=cfg.hardware.num_processes or 1, devices=devices,
                        check_paths=False)
    lines.append(f"mesh laid out on the {len(devices)} chips of {topology}")
    lines.append(f"ESTIMATE (a formula; activations approximate). The compiler's figures for {topology}: rerun with "
                 "--compile_only (libtpu is installed; it compiles every program of the run, minutes on a small host)")
  elif cfg.hardware.gpu_target:
    lines.append(f"ESTIMATE (a formula; activations approximate). The compiler's figures for {cfg.hardware.gpu_target} "
                 f"{cfg.hardware.gpu_topology}: rerun with --compile_only (jax's CUDA plugin: pip install -e "
                 "'.[gpu-compile]'; no GPU needed)")
  else:
    why = "the config names no TPU topology" if not topology else "libtpu is not installed (pip install 'jax[tpu]')"
    lines.append(f"ESTIMATE (a formula; activations approximate): no compiled figures here, {why}")
  num_devices = cfg.hardware.num_devices or jax.device_count()
  lines.append(report(cfg, num_devices, cfg.hardware.hbm_gb or None))
  return "\n".join(lines)
