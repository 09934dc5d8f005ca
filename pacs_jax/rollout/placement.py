"""Split devices (`rollout.devices` > 0): the rollout on a device group of its own, the trainer on the rest.

`split_devices` cuts the device list (the trainer gets the first devices, the rollout the last `rollout.devices`:
on a TPU slice two blocks of chips along its first axis, e.g. v5p:2x4x4 split 16/16 into two 1x4x4 halves, each
host (2x2x1 chips) holding 2 chips of each; on one GPU host two sets of GPUs; on CPU two sets of virtual devices;
with several processes and no chip coordinates (CPU, GPU), each process's last `rollout.devices / processes`).
`rollout_mesh` lays the rollout group out as (data 1, fsdp = devices / tensor, tensor = the trainer's tensor size):
sample mode keeps weights whole along fsdp and splits them over tensor only, so with the same tensor size every
weight shard the rollout needs already exists on the trainer's mesh in the trainer's sample layout.

`SplitRollout` wraps the in-process engine on that mesh (`local.LocalRollout`): its `weight_shardings` are that
sample layout *on the trainer's mesh* (the trainer's `to_sample_params` writes into it), and `set_weights` pushes
them to the rollout's devices by `jax.device_put` to the rollout's shardings, shard by shard, device to device
(`device_to_device` checks no shard has to be assembled on the host), timed and counted (`PushStats`).

Several processes: every process holds devices of both groups (`process_layout` refuses a layout that does not:
v5p:4x4x4 split 32/32 along its first axis gives each group whole hosts) and runs both groups' programs on its own
devices. jax 0.10.2's `device_put` refuses a reshard between two device sets spanning several processes
(jax/_src/dispatch.py, `_device_put_sharding_impl`: "For a cross-host reshard in multi-controller JAX, input and
target sharding should have the same set of devices"; its cross-host transfer needs different process sets and a
runtime that supports it), so the push there is `local_copy`: each process copies the shards its rollout devices
need from the same shards on its own trainer devices (`device_to_device` per process), single-device copies
device to device, and assembles them with `jax.make_array_from_single_device_arrays`; nothing crosses hosts.
The rollouts there run between the updates, not beside them (`trainer/overlap.py`, `Overlapped`, says why).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding

from pacs_jax import sharding
from pacs_jax.rollout import interface

MULTI_PROCESS = ("with several processes every process needs devices in both groups (the weight push copies each "
                 "shard from the trainer's devices of its own host: jax's device_put refuses a cross-host reshard "
                 "between different device sets)")


def split_devices(devices: Sequence, rollout_devices: int) -> tuple[list, list]:
  """(trainer's devices, rollout's devices): the last `rollout_devices` go to the rollout (0: ([all], []))."""
  devices = list(devices)
  if not rollout_devices:
    return devices, []
  processes = sorted({d.process_index for d in devices})
  if all(getattr(d, "coords", None) is not None for d in devices):  # TPU chips: blocks along the first axis
    devices = sorted(devices, key=lambda d: tuple(d.coords))
  elif len(processes) > 1 and rollout_devices % len(processes) == 0:  # each process's last share
    share = rollout_devices // len(processes)
    local = [[d for d in devices if d.process_index == p] for p in processes]
    return [d for ds in local for d in ds[:len(ds) - share]], [d for ds in local for d in ds[len(ds) - share:]]
  return devices[:len(devices) - rollout_devices], devices[len(devices) - rollout_devices:]


def process_layout(trainer_devices: Sequence, rollout_devices: Sequence) -> str | None:
  """Why a split spanning several processes cannot run (None: it can, or it is on one process)."""
  trainer = collections.Counter(d.process_index for d in trainer_devices)
  rollout = collections.Counter(d.process_index for d in rollout_devices)
  processes = sorted(set(trainer) | set(rollout))
  if len(processes) < 2 or not rollout:
    return None
  missing = [p for p in processes if not trainer[p] or not rollout[p]]
  if missing:
    return (f"{MULTI_PROCESS}; processes {missing[:4]} of {len(processes)} hold devices of one group only "
            f"(rollout devices per process: {dict(sorted(rollout.items()))})")
  if len(set(rollout.values())) > 1:
    return (f"{MULTI_PROCESS} and the same number of each; rollout devices per process: "
            f"{dict(sorted(rollout.items()))}")
  return None


def check(rollout_devices: int, num_devices: int | None, trainer_tensor: int | None, num_processes: int) -> str | None:
  """Why `rollout.devices` cannot be laid out (None: it can). `trainer_tensor`: the trainer mesh's tensor size."""
  if not isinstance(rollout_devices, int) or rollout_devices < 0:
    return f"must be an integer >= 0 (0 = the rollout shares the trainer's devices), got {rollout_devices!r}"
  if not rollout_devices:
    return None
  if rollout_devices % num_processes:
    return (f"{rollout_devices} devices do not divide among the {num_processes} processes ({MULTI_PROCESS}, the "
            "same number on each)")
  if num_devices is not None and rollout_devices >= num_devices:
    return f"{rollout_devices} of {num_devices} devices leaves none for the trainer"
  if trainer_tensor is not None and rollout_devices % trainer_tensor:
    return (f"{rollout_devices} devices do not hold whole copies of the weights split over the trainer's "
            f"mesh.tensor={trainer_tensor} (the push copies each tensor shard as it is)")
  return None


def rollout_mesh(devices: Sequence, tensor: int) -> jax.sharding.Mesh:
  """The rollout group's mesh: slots over fsdp (= devices / tensor), weights split over `tensor`."""
  return sharding.make_mesh(1, -1, tensor, devices=devices)


def _key(index, shape) -> tuple:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _shards(sharding: NamedSharding, shape) -> dict[int, set]:
  """{process: the shards (index keys) its devices hold}."""
  out = collections.defaultdict(set)
  for device, index in sharding.devices_indices_map(tuple(shape)).items():
    out[device.process_index].add(_key(index, shape))
  return out


def device_to_device(source: NamedSharding, target: NamedSharding, shape) -> bool:
  """Whether every shard of `target` is a whole shard of `source` on the same process (jax then copies it device
  to device; otherwise device_put assembles the array on the host first, or, across processes, refuses)."""
  held = _shards(source, shape)
  return all(wanted <= held[p] for p, wanted in _shards(target, shape).items())


def local_copy(x: jax.Array, target: NamedSharding) -> jax.Array:
  """`x` in `target`'s layout, each of this process's target shards copied device to device from the same shard
  of `x` on this process (`device_to_device` must hold): the push across processes, no collective."""
  held = {_key(shard.index, x.shape): shard.data for shard in x.addressable_shards}
  wanted = target.addressable_devices_indices_map(x.shape)
  copies = jax.device_put([held[_key(index, x.shape)] for index in wanted.values()], list(wanted))
  return jax.make_array_from_single_device_arrays(x.shape, target, copies)


def _nbytes(x: jax.Array) -> int:
  """The bytes of `x`'s shards on all its devices (every process's)."""
  sizes = (math.prod(len(range(*s.indices(n))) for s, n in zip(index, x.shape))
           for index in x.sharding.devices_indices_map(x.shape).values())
  return sum(sizes) * x.dtype.itemsize


@dataclasses.dataclass
class PushStats:
  """Weight pushes since the last `take()`: how many, the bytes written on the rollout's devices (every process's),
  the seconds from the weights being ready on the trainer's devices to their copies being ready on the rollout's
  (this process's)."""
  pushes: int = 0
  bytes: int = 0
  seconds: float = 0.0
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def add(self, nbytes: int, seconds: float) -> None:
    with self.lock:
      self.pushes, self.bytes, self.seconds = self.pushes + 1, self.bytes + nbytes, self.seconds + seconds

  def take(self) -> dict[str, float]:
    """The metrics row's `weights/push_*` since the last take, then zero."""
    with self.lock:
      out = {"weights/pushes": float(self.pushes), "weights/push_bytes": float(self.bytes),
             "weights/push_s": self.seconds}
      self.pushes, self.bytes, self.seconds = 0, 0, 0.0
    return out


def push(params, target_shardings, stats: PushStats | None = None):
  """`params` (on the trainer's devices) copied into `target_shardings` (the rollout's), timed from the weights
  being ready to the copies being ready; counted in `stats`."""
  params = jax.block_until_ready(params)  # the push's clock starts when the weights exist
  start = time.perf_counter()
  if all(leaf.is_fully_addressable for leaf in jax.tree.leaves(params)):
    pushed = jax.device_put(params, target_shardings)
  else:  # several processes: each copies its own shards (module docstring)
    leaves, treedef = jax.tree.flatten(params)
    pushed = treedef.unflatten([local_copy(x, s) for x, s in zip(leaves, jax.tree.leaves(target_shardings),
                                                                  strict=True)])
  pushed = jax.block_until_ready(pushed)
  seconds = time.perf_counter() - start
  if stats is not None:
    stats.add(sum(_nbytes(leaf) for leaf in jax.tree.leaves(pushed)), seconds)
  return pushed


class SplitRollout:
  """`interface.Rollout` over an in-process engine on the rollout group's mesh, fed from the trainer's mesh.

  `inner`: a rollout (e.g. `LocalRollout`) on `rollout_mesh(...)`, used through the interface only; it needs an
  `ahead_of_time()` (its abstract weights) and `weight_shardings`. `trainer_mesh`: the trainer's. `stats` counts
  every push by this rollout and its forks. Refuses (ValueError) a layout whose push would go through the host.
  """

  def __init__(self, inner: interface.Rollout, trainer_mesh: jax.sharding.Mesh, stats: PushStats | None = None):
    self._inner = inner
    self.eos_ids = inner.eos_ids
    self.trainer_mesh = trainer_mesh
    self.stats = PushStats() if stats is None else stats
    self._staging = jax.tree.map(lambda s: NamedSharding(trainer_mesh, s.spec), inner.weight_shardings)
    if stats is None:  # a fork shares the checked layout
      engine = inner.ahead_of_time()
      if engine is None or inner.weight_shardings is None:
        raise ValueError(f"split devices (rollout.devices) push weights into an in-process engine's layout; "
                         f"{type(inner).__name__} has no ahead_of_time() or weight_shardings")
      shapes = engine.abstract_params()
      bad = [jax.tree_util.keystr(path) for (path, x), src, dst in zip(
          jax.tree_util.tree_flatten_with_path(shapes)[0], jax.tree.leaves(self._staging),
          jax.tree.leaves(inner.weight_shardings)) if not device_to_device(src, dst, x.shape)]
      if bad:
        rollout_mesh_shape = dict(jax.tree.leaves(inner.weight_shardings)[0].mesh.shape)
        raise ValueError(f"the rollout mesh {rollout_mesh_shape} splits weights unlike the "
                         f"trainer's {dict(trainer_mesh.shape)}: pushing {bad[:3]} would go through the host")

  @property
  def version(self) -> int:
    return self._inner.version

  @property
  def weight_shardings(self):
    """The engine's sample layout on the trainer's mesh: `to_sample_params` writes there, `set_weights` pushes."""
    return self._staging

  def set_weights(self, params, version: int) -> None:
    """Weights (an `nnx.State` or a module, on the trainer's devices) pushed to the rollout's devices."""
    state = nnx.state(params) if isinstance(params, nnx.Module) else params
    state = jax.device_put(state, self._staging)  # a no-op for weights already in the staging layout
    self._inner.set_weights(push(state, self._inner.weight_shardings, self.stats), version)

  def release(self) -> None:
    self._inner.release()

  def fork(self) -> SplitRollout:
    """Another rollout over the same engine and push counters, with weights of its own (`LocalRollout.fork`)."""
    return SplitRollout(self._inner.fork(), self.trainer_mesh, self.stats)

  def generate(self, prompts, **kwargs):
    return self._inner.generate(prompts, **kwargs)

  def ahead_of_time(self):
    return self._inner.ahead_of_time()


class Timed:
  """A rollout that logs each `generate` call's (start, end) on `time.perf_counter`'s clock in `intervals` (for
  the trainer's overlap metrics); everything else is `inner`'s. `updates`: the caller's log of update intervals."""

  def __init__(self, inner):
    self._inner = inner
    self.intervals: list[tuple[float, float]] = []
    self.updates: list[tuple[float, float]] = []

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def generate(self, prompts, **kwargs):
    start = time.perf_counter()
    try:
      return self._inner.generate(prompts, **kwargs)
    finally:
      self.intervals.append((start, time.perf_counter()))


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
  """Seconds two (start, end) intervals share."""
  return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
