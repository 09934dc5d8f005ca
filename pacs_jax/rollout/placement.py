"""Split devices (`rollout.devices` > 0): the rollout on a device group of its own, the trainer on the rest.

`split_devices` cuts the device list (the trainer gets the first devices, the rollout the last `rollout.devices`:
on a TPU slice two blocks of chips along its first axis, e.g. v5p:4x4x4 split 32/32 into two 2x4x4 sub-slices of
whole hosts; on one GPU host two sets of GPUs; on CPU two sets of virtual devices). `rollout_mesh` lays the
rollout group out as (data 1, fsdp = devices / tensor, tensor = the trainer's tensor size): sample mode keeps
weights whole along fsdp and splits them over tensor only, so with the same tensor size every weight shard the
rollout needs already exists on the trainer's mesh in the trainer's sample layout.

`SplitRollout` wraps the in-process engine on that mesh (`local.LocalRollout`): its `weight_shardings` are that
sample layout *on the trainer's mesh* (the trainer's `to_sample_params` writes into it), and `set_weights` pushes
them to the rollout's devices by `jax.device_put` to the rollout's shardings, shard by shard, device to device
(`device_to_device` checks no shard has to be assembled on the host), timed and counted (`PushStats`).

One process only: with several, a push crosses hosts (jax's cross-host `device_put` needs the same sharding on
both sides and a runtime that supports it) and the rollout would be driven by the rollout hosts' processes alone,
its prompts and responses exchanged with the trainer's; `check` refuses it, naming this.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding

from pacs_jax import sharding
from pacs_jax.rollout import local

MULTI_PROCESS = ("split devices run on one process for now: a weight push across hosts needs jax's cross-host "
                 "device_put (the same sharding on both sides, a runtime that supports it) and a rollout driven by "
                 "the rollout hosts' processes alone, its prompts and responses exchanged with the trainer's")


def split_devices(devices: Sequence, rollout_devices: int) -> tuple[list, list]:
  """(trainer's devices, rollout's devices): the last `rollout_devices` go to the rollout (0: ([all], []))."""
  devices = list(devices)
  if not rollout_devices:
    return devices, []
  if all(getattr(d, "coords", None) is not None for d in devices):  # TPU chips: blocks along the first axis, so
    devices = sorted(devices, key=lambda d: tuple(d.coords))      # each group is a sub-slice of whole hosts
  return devices[:len(devices) - rollout_devices], devices[len(devices) - rollout_devices:]


def check(rollout_devices: int, num_devices: int | None, trainer_tensor: int | None, num_processes: int) -> str | None:
  """Why `rollout.devices` cannot be laid out (None: it can). `trainer_tensor`: the trainer mesh's tensor size."""
  if not isinstance(rollout_devices, int) or rollout_devices < 0:
    return f"must be an integer >= 0 (0 = the rollout shares the trainer's devices), got {rollout_devices!r}"
  if not rollout_devices:
    return None
  if num_processes != 1:
    return f"{MULTI_PROCESS}; got {num_processes} processes"
  if num_devices is not None and rollout_devices >= num_devices:
    return f"{rollout_devices} of {num_devices} devices leaves none for the trainer"
  if trainer_tensor is not None and rollout_devices % trainer_tensor:
    return (f"{rollout_devices} devices do not hold whole copies of the weights split over the trainer's "
            f"mesh.tensor={trainer_tensor} (the push copies each tensor shard as it is)")
  return None


def rollout_mesh(devices: Sequence, tensor: int) -> jax.sharding.Mesh:
  """The rollout group's mesh: slots over fsdp (= devices / tensor), weights split over `tensor`."""
  return sharding.make_mesh(1, -1, tensor, devices=devices)


def device_to_device(source: NamedSharding, target: NamedSharding, shape) -> bool:
  """Whether every shard of `target` is a whole shard of `source` (jax then copies it device to device; otherwise
  device_put assembles the array on the host first)."""
  held = {tuple((s.start, s.stop) for s in index) for index in source.devices_indices_map(tuple(shape)).values()}
  wanted = {tuple((s.start, s.stop) for s in index) for index in target.devices_indices_map(tuple(shape)).values()}
  return wanted <= held


@dataclasses.dataclass
class PushStats:
  """Weight pushes since the last `take()`: how many, the bytes written on the rollout's devices, the seconds
  from the weights being ready on the trainer's devices to their copies being ready on the rollout's."""
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
  pushed = jax.block_until_ready(jax.device_put(params, target_shardings))
  seconds = time.perf_counter() - start
  if stats is not None:
    nbytes = sum(shard.data.nbytes for leaf in jax.tree.leaves(pushed) for shard in leaf.addressable_shards)
    stats.add(nbytes, seconds)
  return pushed


class SplitRollout:
  """`interface.Rollout` over the in-process engine on the rollout group's mesh, fed from the trainer's mesh.

  `inner`: a `LocalRollout` on `rollout_mesh(...)`; `trainer_mesh`: the trainer's. `stats` counts every push by
  this rollout and its forks. Refuses (ValueError) a layout whose push would go through the host.
  """

  def __init__(self, inner: local.LocalRollout, trainer_mesh: jax.sharding.Mesh, stats: PushStats | None = None):
    self._inner = inner
    self.eos_ids = inner.eos_ids
    self.trainer_mesh = trainer_mesh
    self.stats = PushStats() if stats is None else stats
    self._staging = jax.tree.map(lambda s: NamedSharding(trainer_mesh, s.spec), inner.weight_shardings)
    if stats is None:  # a fork shares the checked layout
      shapes = inner.ahead_of_time().abstract_params()
      bad = [jax.tree_util.keystr(path) for (path, x), src, dst in zip(
          jax.tree_util.tree_flatten_with_path(shapes)[0], jax.tree.leaves(self._staging),
          jax.tree.leaves(inner.weight_shardings)) if not device_to_device(src, dst, x.shape)]
      if bad:
        raise ValueError(f"the rollout mesh {dict(inner.ahead_of_time().mesh.shape)} splits weights unlike the "
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
