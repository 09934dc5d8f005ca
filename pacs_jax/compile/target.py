"""The machine `--compile_only` compiles for: a TPU topology's or a GPU target's abstract devices, or this machine's
own when they are the target."""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from pacs_jax import gpu_targets
from pacs_jax import sharding
from pacs_jax.compile.aot_measure import GB


class TargetUnavailable(RuntimeError):
  """The config's target backend cannot be compiled for on this machine."""


@dataclasses.dataclass
class Target:
  devices: tuple
  description: str  # e.g. "TPU v5p:2x4x4 (32 chips, 8 hosts)"
  hbm_bytes: float | None  # memory per chip, for the verdict (None: unknown, no verdict)
  num_processes: int
  unit: str = "chip"  # what the figures are per: "chip" (TPU, local devices) or "GPU" (a GPU target)


def target(cfg: ml_collections.ConfigDict) -> Target:
  """The devices to compile for: a TPU topology's or GPU target's abstract devices, or this machine's when they
  are the target."""
  h = cfg.hardware
  hbm = h.hbm_gb * GB if h.hbm_gb else None
  if h.tpu_topology:
    devices = sharding.tpu_topology_devices(h.tpu_topology)
    hosts = len({d.process_index for d in devices})
    return Target(devices, f"TPU {h.tpu_topology} ({len(devices)} chips, {hosts} hosts)", hbm, hosts)
  if h.gpu_target:
    devices = gpu_targets.devices(h.gpu_target, h.gpu_topology)
    hosts = len({d.process_index for d in devices})
    return Target(devices, f"{len(devices)} x {devices[0].device_kind} ({h.gpu_target} {h.gpu_topology}, {hosts} "
                           f"host{'s' if hosts > 1 else ''})", hbm, hosts, unit="GPU")
  local = jax.devices()
  wanted = h.num_devices or len(local)
  if (h.hbm_gb and local[0].platform == "cpu") or wanted > len(local):
    raise TargetUnavailable(
        f"config names no TPU topology (hardware.tpu_topology) nor GPU target (hardware.gpu_target) and its target ({wanted} devices"
        f"{f' of {h.hbm_gb:g} GB' if h.hbm_gb else ''}) is not this machine ({len(local)} {local[0].platform} "
        "devices): --compile_only compiles for the target's own backend, so run it on the target machine; "
        "--dry_run prints an estimate anywhere")
  if hbm is None:
    stats = local[0].memory_stats() or {}
    hbm = stats.get("bytes_limit")
  return Target(tuple(local[:wanted]), f"{wanted} local {local[0].platform} devices", hbm, h.num_processes or 1)
