"""One program compiled ahead of time and the compiler's figures for it: memory per chip, cost with loop trip
counts applied (`hlo_cost`), compile time."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import math
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pacs_jax.compile import hlo_cost

GB = 1e9


def per_chip_bytes(tree: Any) -> float:
  """Bytes one device holds of a tree of ShapeDtypeStructs (unsharded leaves: whole)."""
  total = 0.0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


@dataclasses.dataclass
class ProgramReport:
  name: str
  phase: str  # "rollout" | "update"
  calls: float  # calls per training step (rollout programs: an upper bound, every response at full length)
  model_flops: float  # per call and chip: 2 N (forward) or 6 N (forward + backward) per token / chips
  compile_s: float = 0.0
  load_average: float = 0.0  # the host's 1-minute load average after compiling (compile times depend on it)
  argument: float = 0.0  # bytes per chip
  output: float = 0.0
  alias: float = 0.0
  temp: float = 0.0
  resident: float = 0.0  # bytes of its arguments / outputs the phase holds anyway (counted once, in `resident`)
  flops: float | None = None  # per call, loop trip counts applied
  bytes_accessed: float | None = None
  optimal_s: float | None = None
  raw_flops: float | None = None  # the compiler's count, each loop body once
  raw_bytes: float | None = None
  raw_optimal_s: float | None = None
  uncosted: int = 0  # instructions the compiler gave no time estimate (left out of optimal_s)
  cycles: float = 0.0  # the compiler's estimated cycles, loops applied (once: raw_cycles)
  raw_cycles: float = 0.0
  loops: list = dataclasses.field(default_factory=list)  # hlo_cost.Loop
  custom_calls: list = dataclasses.field(default_factory=list)  # kernels called by name (cuDNN attention, Pallas)
  error: str = ""  # the compiler's message when the program does not compile (e.g. out of memory)

  @property
  def peak(self) -> float:
    """Everything the program holds at once per chip: arguments, outputs not aliased to them, temporaries."""
    return self.argument + self.output - self.alias + self.temp

  @property
  def extra(self) -> float:
    """What running it adds to the phase's resident bytes."""
    return max(0.0, self.peak - self.resident)


@contextlib.contextmanager
def persistent_cache_off():
  """Compile-only executables cannot be loaded back from jax's persistent cache (libtpu has no client to load
  them into), and a cached compile would hide the compile time: the cache is off while compiling."""
  from jax.experimental.compilation_cache import compilation_cache
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # jax decides once per process whether the cache is used
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return cost or compiled_module_cost(compiled)


def compiled_module_cost(compiled) -> dict:
  """XLA's HLO cost analysis (flops, bytes accessed; no time) of a compiled program, run by the CPU client.

  For backends whose compile-only client has no cost analysis (jax's CUDA plugin: "UNIMPLEMENTED:
  GetCostAnalysis"): the analysis reads only the optimized module, so any client can run it. jax has no public
  call for it; this is the one place that uses the private one. {} when it is unavailable."""
  try:
    from jax._src.lib import _jax
    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  except Exception:  # a jax without these internals: no cost figures rather than no report
    return {}
  # The CPU's cost model times nothing of a GPU program: its seconds are left out, never reported.
  return {k: v for k, v in cost.items() if "seconds" not in k}


# PACS_JAX_AOT_MEMO=1 (the tests set it): a program compiled ahead of time is kept for the process and a second
# compile of the same program (its text, shardings' devices and target) reuses it with its first compile time. The
# persistent cache cannot hold these (`persistent_cache_off`); a process that compiles a config's programs again
# (another test of the same config, the update at several length profiles) then pays once. Off by default: a 7B's
# executables would stay in host memory.
MEMO_ENV = "PACS_JAX_AOT_MEMO"
MEMO_SIZE = 64  # programs kept, least recently compiled dropped first
_MEMO: collections.OrderedDict[str, tuple[Any, float]] = collections.OrderedDict()


def program_key(lowered) -> str | None:
  """What a compiled program depends on: its text, the devices of its shardings and mesh in order, and the
  backend (a compile-only TPU topology or CUDA target, or the host's); None when jax does not expose them."""
  args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
  if not isinstance(args, dict) or "in_shardings" not in args:
    return None
  def named(assignment) -> list | None:
    return None if assignment is None else [(d.platform, d.device_kind, d.id) for d in assignment if d is not None]

  devices = [named(getattr(s, "_device_assignment", None))
             for s in (*args["in_shardings"], *args.get("out_shardings", ()))]
  mesh_devices = getattr(args.get("context_mesh"), "devices", None)  # (an empty mesh outside `jax.set_mesh`)
  devices.append(named(getattr(mesh_devices, "flat", None)))
  backend = args.get("backend")
  text = lowered.as_text()
  extra = repr((devices, getattr(backend, "platform", None), getattr(backend, "platform_version", None),
                os.environ.get("XLA_FLAGS", ""), getattr(lowered, "out_tree", None)))
  return hashlib.sha256(text.encode() + extra.encode()).hexdigest()


def _compile(lower: Callable[[], Any]) -> tuple[Any, float]:
  """`lower().compile()` and the seconds it took (for a program `_MEMO` holds: the first compile's)."""
  start = time.perf_counter()
  lowered = lower()
  key = program_key(lowered) if os.environ.get(MEMO_ENV) == "1" else None
  if key is not None and key in _MEMO:
    _MEMO.move_to_end(key)
    return _MEMO[key]
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  if key is not None:
    _MEMO[key] = (compiled, seconds)
    while len(_MEMO) > MEMO_SIZE:
      _MEMO.popitem(last=False)
  return compiled, seconds


def measure(report: ProgramReport, lower: Callable[[], Any], resident: Callable[[Any], float],
            unknown_trips: float = 1, rare: dict[str, tuple[float, float]] | None = None) -> Any:
  """Compiles one program and fills `report`; returns the compiled executable (None if it failed). A loop of no
  fixed trip count is counted `unknown_trips` times, a `rare` conditional as `hlo_cost.analyse` says."""
  start = time.perf_counter()
  try:
    compiled, report.compile_s = _compile(lower)
  except Exception as e:  # XLA's out-of-memory (RESOURCE_EXHAUSTED) or any compile error: reported, not raised
    report.compile_s = time.perf_counter() - start
    report.error = f"{type(e).__name__}: {e}"
    return None
  report.load_average = os.getloadavg()[0]
  mem = compiled.memory_analysis()
  report.argument, report.output = float(mem.argument_size_in_bytes), float(mem.output_size_in_bytes)
  report.alias, report.temp = float(mem.alias_size_in_bytes), float(mem.temp_size_in_bytes)
  report.resident = resident(compiled)
  cost = _cost(compiled)
  text = compiled.as_text()
  loops = hlo_cost.analyse(text, compiler_rates(compiled) if cost.get("optimal_seconds") else None, unknown_trips,
                           rare)
  report.custom_calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
  report.loops = loops.loops
  report.raw_flops, report.raw_bytes = cost.get("flops"), cost.get("bytes accessed")
  report.raw_optimal_s = cost.get("optimal_seconds")
  if report.raw_optimal_s is not None and report.raw_optimal_s < 0:
    # The TPU cost model counts -1 s for each instruction it cannot cost (seen: an all-gather of a bool
    # vector, as the engine's replicated `active` flags): keep the costed part, below 1 s for these programs.
    report.uncosted = -math.floor(report.raw_optimal_s)
    report.raw_optimal_s -= math.floor(report.raw_optimal_s)
  if report.raw_flops is not None:
    # Pallas kernels' matmuls are not in the compiler's count: added with their loops applied.
    report.flops = report.raw_flops + loops.total("flops") - loops.total("flops", weighted=False) \
        + loops.total("kernel_flops")
  if report.raw_bytes is not None:
    report.bytes_accessed = report.raw_bytes + loops.total("bytes") - loops.total("bytes", weighted=False)
  once = loops.total("cycles", weighted=False)
  report.cycles, report.raw_cycles = loops.total("cycles"), once
  if report.raw_optimal_s is not None:
    report.optimal_s = loops_applied_seconds(loops, report.raw_optimal_s)
  return compiled


def loops_applied_seconds(loops: hlo_cost.LoopCosts, raw_optimal_s: float, field: str = "") -> float:
  """XLA's `optimal_seconds` (each loop body counted once) with the loops' trip counts applied: scaled by the
  per-instruction roofline with and without the multipliers (the quantity it sums), or by `field`; by the
  estimated cycles where the roofline is unknown."""
  field = field or ("roofline" if loops.total("roofline", weighted=False) else "cycles")
  once = loops.total(field, weighted=False)
  return raw_optimal_s * (loops.total(field) / once if once else 1.0)


_RATES: dict[str, tuple[float, float] | None] = {}


def compiler_rates(compiled) -> tuple[float, float] | None:
  """(FLOP/s, bytes/s) behind XLA's `optimal_seconds` on the chip a program was compiled for, read from two
  one-instruction programs compiled for one of its devices: a matmul (bound by FLOPs) and an add (bound by
  bytes). On v5p with libtpu 0.0.42.1: 338.5 TFLOP/s and 2.35 TB/s. None without a device or a time estimate."""
  device = next((next(iter(s.device_set)) for s in jax.tree.leaves(compiled.input_shardings)), None)
  return None if device is None else device_rates(device)


def device_rates(device) -> tuple[float, float] | None:
  """`compiler_rates` of one device's kind (computed once per kind)."""
  if device.device_kind not in _RATES:
    mesh = jax.sharding.Mesh(np.array([device]), ("one",))  # inside the caller's mesh context: its own
    square = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, P()))
    rates = []
    for fn in (jnp.matmul, jnp.add):
      with persistent_cache_off(), jax.set_mesh(mesh):
        cost = _cost(jax.jit(fn).lower(square, square).compile())
      seconds = cost.get("optimal_seconds") or 0.0
      rates.append((cost.get("flops", 0.0) if fn is jnp.matmul else cost.get("bytes accessed", 0.0)) / seconds
                   if seconds > 0 else 0.0)
    _RATES[device.device_kind] = tuple(rates) if all(rates) else None
  return _RATES[device.device_kind]


def outputs_of(compiled) -> Any:
  """The compiled program's outputs as ShapeDtypeStructs in the shardings it produces them in."""
  return jax.tree.map(lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
                      compiled.out_info, compiled.output_shardings)
