"""Process-level setup before the first jax computation: the platform on hosts without accelerators, multi-host
init and persistent compile cache."""

from __future__ import annotations

import glob
import os

import jax
import ml_collections

from pacs_jax import sharding


def accelerator_present(dev_dir: str = "/dev") -> bool:
  """A TPU (/dev/accel<n>, or /dev/vfio/<n> on v5p and later) or NVIDIA GPU (/dev/nvidia<n>) device node."""
  patterns = ("accel[0-9]*", "vfio/[0-9]*", "nvidia[0-9]*")
  return any(glob.glob(os.path.join(dev_dir, p)) for p in patterns)


def prefer_cpu_without_accelerators(environ=os.environ, dev_dir: str = "/dev") -> bool:
  """With JAX_PLATFORMS unset on a host with no accelerator, runs on the CPU directly (returns True): otherwise jax
  starts every installed plugin first, and libtpu (the test extra) and the CUDA plugin print their failures, a
  block of errors on each run. Training, evaluation and export only: --compile_only and --dry_run keep the plugins
  they compile for."""
  if environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or accelerator_present(dev_dir):
    return False
  jax.config.update("jax_platforms", "cpu")
  return True


def _multi_host_tpu_vm() -> bool:
  """TPU VM runtimes list every worker of the slice in TPU_WORKER_HOSTNAMES (comma-separated)."""
  return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def init(cfg: ml_collections.ConfigDict) -> None:
  """Starts jax.distributed from the config's flags, or auto-detected on TPU VMs; no-op on one machine."""
  d = cfg.distributed
  if d.coordinator_address:
    if jax.config.jax_platforms in (None, "", "cpu") and not os.environ.get("JAX_PLATFORMS", "").strip("cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk over gloo
    sharding.initialize_distributed(d.coordinator_address, d.num_processes or None,
                                    d.process_id if d.process_id >= 0 else None)
  elif _multi_host_tpu_vm():
    sharding.initialize_distributed()  # jax reads the coordinator and process ids from the TPU metadata
  # A persistent compile cache makes restarts (preemption, resume) skip recompiling.
  cache_dir = os.environ.get("PACS_JAX_COMPILATION_CACHE")
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Programs that compile in under 0.5 s are not worth a file, unless jax's own variable says otherwise.
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.5)))


def start_command_line() -> None:
  """What the evaluate, export and study command lines do after `errors.no_arguments_quiet_logs`: the CPU
  directly on hosts without accelerators, and the persistent compile cache named by PACS_JAX_COMPILATION_CACHE."""
  prefer_cpu_without_accelerators()
  if os.environ.get("PACS_JAX_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["PACS_JAX_COMPILATION_CACHE"])
