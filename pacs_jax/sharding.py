"""Device mesh (data, fsdp, tensor), per-mode PartitionSpec tables, activation constraints, multi-host init.

Parameters carry logical axis names (`logical_axes` metadata, set where they are created); a mode's
table maps those names to mesh axes. Train mode shards weights over fsdp and tensor; sample mode keeps
weights whole along fsdp (no per-token all-gathers while decoding) and shards them over tensor only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (or tuple of axes, or None = replicated), per mode. "layers", the leading axis
# of the stacked decoder layers, is never sharded: the layer scan slices one layer per step on every device.
# "lora_rank", a LoRA adapter's rank axis (`pacs_jax.models.lora`), is never sharded either: a few to a few hundred
# wide, it is the contracted axis of (x A) B, and splitting it would all-reduce every update.
PARAM_RULES: dict[str, dict[str, Any]] = {
    "train": {
        "vocab": "tensor", "embed": "fsdp", "q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
        "head_dim": None, "norm": None, "value": None, "layers": None, "lora_rank": None,
    },
    "sample": {
        "vocab": "tensor", "embed": None, "q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
        "head_dim": None, "norm": None, "value": None, "layers": None, "lora_rank": None,
    },
}

# Activations are laid out the same way in both modes: batch over (data, fsdp), heads / mlp / vocab
# over tensor.
ACTIVATION_RULES: dict[str, Any] = {
    "batch": BATCH_AXES, "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
}


def mesh_sizes(data: int, fsdp: int, tensor: int, num_devices: int) -> dict[str, int]:
  """{axis: size} of a ('data', 'fsdp', 'tensor') mesh on `num_devices` devices; one size may be -1 (= the
  remaining devices). ValueError when the sizes do not fit the devices."""
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise ValueError(f"mesh: at most one of data/fsdp/tensor may be -1, got {sizes}")
  known = math.prod(v for v in sizes.values() if v != -1)
  if any(v == 0 or v < -1 for v in sizes.values()):
    raise ValueError(f"mesh: sizes must be positive or -1, got {sizes}")
  if free:
    if num_devices % known:
      raise ValueError(f"mesh: {num_devices} devices are not divisible by {sizes} (product of the others {known})")
    sizes[free[0]] = num_devices // known
  total = math.prod(sizes.values())
  if total != num_devices:
    raise ValueError(f"mesh: data*fsdp*tensor = {total} but there are {num_devices} devices ({sizes})")
  return sizes


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh; one size may be -1 (= the remaining devices). See `device_grid`."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_sizes(data, fsdp, tensor, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  # Auto axes: XLA's partitioner propagates shardings from parameters and our constraints.
  return Mesh(device_grid(shape, devices), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def device_grid(shape: tuple[int, int, int], devices: Sequence[jax.Device]) -> np.ndarray:
  """Devices as a [data, fsdp, tensor] array.

  `mesh_utils` lays the axes onto the physical network (on a TPU torus, tensor, the most communicating
  axis, on neighbouring chips), splitting a physical axis where no whole one fits: (1, 32, 2) on a v5p-128
  (4x4x4) needs that, and `jax.make_mesh` refuses it. The batch shards (data x fsdp) are then ordered by
  process, so each host's devices hold one contiguous block of rows: a host feeds whole prompt groups
  (`make_array_from_process_local_data` places a host's rows at its devices' shards, in shard order).
  """
  try:
    grid = mesh_utils.create_device_mesh(shape, list(devices), allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError) as e:
    raise ValueError(f"mesh: (data, fsdp, tensor) = {shape} cannot be laid out on these {len(devices)} "
                     f"{devices[0].device_kind} devices: {e}") from e
  rows = grid.reshape(-1, shape[-1])  # [data * fsdp, tensor]: the devices holding each batch shard
  hosts = [{d.process_index for d in row} for row in rows]
  if any(len(h) > 1 for h in hosts):
    per_host = len(devices) // len(set().union(*hosts))
    raise ValueError(f"mesh: tensor={shape[-1]} spans devices of more than one process ({per_host} devices per "
                     "process here): each batch shard must live on one host, which feeds its rows")
  order = sorted(range(len(rows)), key=lambda i: min(hosts[i]))  # stable: keeps the physical order within a host
  return rows[order].reshape(shape)


# Chips per host of multi-host TPU slices (x, y, z): 4 chips per VM on v4, v5p, and multi-host v5e / v6e.
_TPU_CHIPS_PER_HOST_BOUNDS = (2, 2, 1)
TPU_CHIPS_PER_HOST = math.prod(_TPU_CHIPS_PER_HOST_BOUNDS)


def topology_chips(topology: str) -> int:
  """Chips of a TPU topology name: "v5p:4x4x4" -> 64."""
  dims = topology.partition(":")[2].split("x")
  if not topology.count(":") == 1 or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise ValueError(f'expected "<generation>:<dims>" such as "v5p:4x4x4", got {topology!r}')
  return math.prod(int(d) for d in dims)


def _prepare_compile_only_libtpu() -> None:
  """libtpu defaults for compiling on a machine without TPUs: several processes may load it (parallel tests,
  a run beside a compile), and it need not look for TPU workers in the cloud metadata."""
  import glob
  import os
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return  # a TPU VM: its runtime knows its own topology
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


@functools.lru_cache(maxsize=None)
def tpu_topology_devices(topology: str) -> tuple[jax.Device, ...]:
  """The abstract devices of a TPU slice, e.g. "v5p:4x4x4" (a v5p-128: 64 chips, 16 hosts).

  They need no TPU: meshes are built and programs compiled for them on any machine with libtpu
  (`pip install "jax[tpu]"`); nothing can run on them.
  """
  import importlib.util
  if importlib.util.find_spec("libtpu") is None:
    raise RuntimeError(f"compiling for the TPU topology {topology!r} needs libtpu: pip install 'jax[tpu]'")
  _prepare_compile_only_libtpu()
  from jax.experimental import topologies
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name="default",
                                        chips_per_host_bounds=_TPU_CHIPS_PER_HOST_BOUNDS, num_slices=1)
  except Exception as e:  # libtpu raises JaxRuntimeError for names it does not know
    raise ValueError(f"TPU topology {topology!r} is not one libtpu knows (e.g. 'v5p:2x4x4', 'v5p:4x4x4'): {e}") from e
  return tuple(desc.devices)


def _axis_size(mesh_shape: dict[str, int], axis) -> int:
  if axis is None:
    return 1
  axes = axis if isinstance(axis, tuple) else (axis,)
  return math.prod(mesh_shape.get(a, 1) for a in axes)


def spec_for(logical_axes: Sequence[str | None], rules: dict[str, Any], mesh_shape: dict[str, int],
             shape: Sequence[int] | None = None) -> P:
  """PartitionSpec for one array. A dimension the mesh axes don't divide stays replicated."""
  out, used = [], set()
  for i, name in enumerate(logical_axes):
    axis = rules.get(name) if name is not None else None
    axes = axis if isinstance(axis, tuple) else ((axis,) if axis else ())
    axes = tuple(a for a in axes if a in mesh_shape and a not in used)
    if shape is not None and axes and shape[i] % _axis_size(mesh_shape, axes):
      axes = ()
    used.update(axes)
    out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
  return P(*out)


def _logical_axes(var: nnx.Variable) -> tuple:
  axes = var.get_metadata().get("logical_axes")
  if axes is None:
    return (None,) * len(var.get_value().shape)
  return tuple(axes)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_specs(state: nnx.State, mesh: Mesh, mode: str = "train") -> Any:
  """PartitionSpec per variable of an (abstract or concrete) NNX state, by the mode's table."""
  if mode not in PARAM_RULES:
    raise ValueError(f"sharding mode must be one of {sorted(PARAM_RULES)}, got {mode!r}")
  rules, mesh_shape = PARAM_RULES[mode], dict(mesh.shape)
  return jax.tree.map(lambda v: spec_for(_logical_axes(v), rules, mesh_shape, v.get_value().shape), state,
                      is_leaf=_is_var)


def state_shardings(state: nnx.State, mesh: Mesh, mode: str = "train") -> Any:
  """NamedSharding per variable (a pytree matching `state`)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state, mesh, mode),
                      is_leaf=lambda x: isinstance(x, P))


def create_sharded(make_module, mesh: Mesh | None, mode: str = "train"):
  """Builds `make_module()` with every variable created directly in its sharding (no host copy).

  `make_module` is a zero-argument callable returning an NNX module (e.g. a lambda closing over a
  config and `nnx.Rngs`). Initialisation is one compiled program (eager init would dispatch, and
  compile, every initializer separately). Without a mesh the module lands on the default device.
  """
  abstract = nnx.eval_shape(make_module)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, mode) if mesh is not None else None

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.state(make_module())

  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    state = init()
  return nnx.merge(graphdef, state)


def reshard(tree: Any, shardings: Any) -> Any:
  """Moves arrays to new shardings (e.g. train-mode policy weights -> sample mode)."""
  return jax.device_put(tree, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Activation sharding constraint under the current mesh (`jax.set_mesh`); identity without one.

  With 8 simulated CPU devices the constraint is real: the compiled program's layouts follow it.
  """
  return _constrain_by(x, logical_axes, ACTIVATION_RULES)


def _constrain_by(x: jax.Array, logical_axes: Sequence[str | None], rules: dict[str, Any]) -> jax.Array:
  """`x` laid out by a rules table under the current mesh; identity without one (or on one device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.shape.values()) == 1:
    return x
  return jax.lax.with_sharding_constraint(x, spec_for(logical_axes, rules, dict(mesh.shape), x.shape))


def matmul_weight(w: jax.Array, logical_axes: Sequence[str | None], dtype) -> jax.Array:
  """A weight as a matmul reads it: cast to the compute dtype, then laid out as in sample mode (whole along
  fsdp, still split over tensor): FSDP's one all-gather per use, of the 16-bit copy, before a plain dot.

  Left to itself, XLA's partitioner meets a weight sharded over fsdp on the contracted axis (embed) beside
  activations whose rows are split over fsdp, and may compute the dot as a windowed-einsum loop instead: one
  weight shard per iteration, re-reading and re-writing the whole [B, T, F] partial result each time (a third
  of the 3B train step's cycles before this). Under a mesh without fsdp, or in sample mode, this is the
  layout the weight already has. Identity without a mesh (or on one device), as `constrain`.
  """
  return _constrain_by(w.astype(dtype), logical_axes, PARAM_RULES["sample"])


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Starts jax.distributed: from explicit flags, or auto-detected on TPU VMs / SLURM / etc."""
  if coordinator_address:
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
  else:
    jax.distributed.initialize()
