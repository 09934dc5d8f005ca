"""NVIDIA GPUs to compile for without one: XLA's target description of each GPU this project knows (a text
`GpuTargetConfigProto` beside this file) and the abstract devices of a node or cluster of them.

jax's CUDA plugin compiles for such devices on a CPU host (`pip install -e ".[gpu-compile]"`): the memory
plan is the GPU's, but nothing is autotuned (no GPU to time kernels on), so kernel choices and times are not.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import math
import shutil

import jax

# hardware.gpu_target -> its target description (a file of this package).
TARGETS = {"h100-sxm-80gb": "h100-sxm-80gb.txtpb"}


def target_config(target: str) -> str:
  """The text GpuTargetConfigProto of a GPU named in TARGETS."""
  if target not in TARGETS:
    raise ValueError(f"unknown GPU target {target!r}; known: {', '.join(TARGETS)}")
  return importlib.resources.files(__package__).joinpath(TARGETS[target]).read_text()


def topology_shape(topology: str) -> tuple[int, int, int]:
  """(slices, hosts per slice, GPUs per host) of a topology as jax's CUDA plugin names it: "1x1x8" is one
  8-GPU node, "1x2x8" two of them."""
  dims = topology.split("x")
  if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise ValueError(f'expected "<slices>x<hosts>x<gpus per host>" such as "1x1x8", got {topology!r}')
  return tuple(int(d) for d in dims)


def topology_gpus(topology: str) -> int:
  return math.prod(topology_shape(topology))


def topology_hosts(topology: str) -> int:
  slices, hosts, _ = topology_shape(topology)
  return slices * hosts


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is missing
    return False


def _require_cuda_plugin() -> None:
  """jax's CUDA plugin and ptxas (XLA looks in site-packages' nvidia/cuda_nvcc before PATH), or one clear error."""
  found = lambda *modules: any(_installed(m) for m in modules)
  missing = [what for what, ok in (("jax's CUDA plugin", found("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")),
                                   ("ptxas", found("nvidia.cuda_nvcc", "nvidia.cu13") or shutil.which("ptxas")))
             if not ok]
  if missing:
    raise RuntimeError(f"compiling for a GPU target needs {' and '.join(missing)}: pip install -e \".[gpu-compile]\"")
  # Without an explicit platform list jax initialises the plugin's GPU runtime, which fails on a machine
  # without one and leaves the plugin unregistered; on the CPU platform it registers for compiling only.
  if not jax.config.jax_platforms:
    try:
      jax.config.update("jax_platforms", "cpu")
    except RuntimeError as e:  # jax already started on its default platforms
      raise RuntimeError("compiling for a GPU target needs JAX_PLATFORMS=cpu (or cuda on a GPU machine) set before "
                         f"jax starts: {e}") from e


@functools.lru_cache(maxsize=None)
def devices(target: str, topology: str) -> tuple[jax.Device, ...]:
  """The abstract devices of `topology` (see `topology_shape`) GPUs of kind `target`: meshes are laid out and
  programs compiled for them on any machine with the CUDA plugin; nothing can run on them."""
  config = target_config(target)
  topology_shape(topology)
  _require_cuda_plugin()
  from jax.experimental import topologies
  try:
    desc = topologies.get_topology_desc(platform="cuda", target_config=config, topology=topology)
  except Exception as e:  # the plugin raises JaxRuntimeError for a target description it cannot parse
    raise ValueError(f"jax's CUDA plugin cannot make {topology} {target} devices: {e}") from e
  return tuple(desc.devices)
