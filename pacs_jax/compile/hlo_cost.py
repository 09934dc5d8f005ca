"""Loop-aware costs of a compiled XLA program, from its HLO text.

XLA's `cost_analysis()` counts the body of a while loop once: a scan over 36 layers, 8 micro-batches or
16 decode steps is one iteration in its flops, bytes and `optimal_seconds`. Here the trip count of each
loop is read from the compiled HLO (its `known_trip_count` where the backend records one; otherwise the
loop's condition `i < N` with the counter's start and step read from the loop's input and body), every
computation gets a multiplier (the product of the trip counts of the loops around it), and each
computation's own cost is counted:
  flops     2 x output elements x contracted size of every dot / convolution (fusion bodies included);
  kernel_flops  the matmul flops of Pallas kernels (custom calls XLA counts as none): the splash attention
            kernels' causal blocks (`flash.splash_kernel_flops`);
  bytes     operands read and results written by each top-level instruction, counting a dynamic slice as
            the slice and an in-place dynamic update as the update (as XLA does);
  cycles    the TPU compiler's per-instruction `estimated_cycles` (its detailed cost model);
  roofline  each top-level instruction's max(flops / FLOP rate, bytes / byte rate) at the rates behind XLA's
            `optimal_seconds` (`aot_measure.compiler_rates`), Pallas kernels (custom calls) left out as XLA
            leaves them: the per-instruction quantity that `optimal_seconds` sums.
Totals with loops applied are XLA's figure plus (multiplier - 1) x the loop bodies' own counts, and
`optimal_seconds` scaled by the roofline with and without the multipliers (by the cycles where the rates are
unknown). Scaling by the cycles instead weighs each loop body by the whole program's average cycles per roofline
second, which is not monotone in work: removing two passes over a [B, C, V] loop body (fewer cycles, fewer
bytes, same FLOPs) raised that figure by 4% while every per-instruction measure fell.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from pacs_jax.models import flash
from pacs_jax.compile.hlo_parse import Computation, Instruction, parse

ESTIMATED_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# Instructions that move no data of their own.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id", "replica-id",
         "while", "call", "conditional", "opt-barrier", "add-dependency", "domain"}


# ----------------------------------------------------------------------------------------------
# Trip counts


def _through_copies(comp: Computation, name: str) -> Instruction | None:
  instr = comp.instructions.get(name)
  while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands:
    instr = comp.instructions.get(instr.operands[0])
  return instr


def _constant(instr: Instruction | None) -> int | None:
  """The value of an integer scalar constant."""
  if instr is None or instr.opcode != "constant" or not instr.dims or instr.dims[0][1]:
    return None
  m = re.fullmatch(r"-?\d+", instr.operands[0]) if instr.operands else None
  return int(m.group(0)) if m else None


def _tuple_index(comp: Computation, name: str) -> int | None:
  """i when `name` is get-tuple-element(parameter, index=i) (through copies)."""
  instr = _through_copies(comp, name)
  if instr is None or instr.opcode != "get-tuple-element":
    return None
  m = re.search(r"index=(\d+)", instr.attrs)
  return int(m.group(1)) if m else None


def trip_count(computations: dict[str, Computation], caller: Computation, loop: Instruction) -> int | None:
  """Iterations of a while instruction: recorded by the backend, or read from `i < N` (N a constant), the
  counter's initial value in the loop's input tuple and its constant step in the body. With a condition of
  several terms (`i < N and any(active)`), N bounds the count. None if the loop has no such counter."""
  m = _TRIP.search(loop.attrs)
  if m:
    return int(m.group(1))
  called = dict(loop.called())
  cond, body = computations.get(called.get("condition", "")), computations.get(called.get("body", ""))
  if cond is None or body is None:
    return None
  init = _through_copies(caller, loop.operands[0]) if loop.operands else None
  best = None
  for cmp, where in _condition_compares(computations, cond):
    direction = re.search(r"direction=(\w+)", cmp.attrs)
    if not direction or direction.group(1) not in ("LT", "GT") or len(cmp.operands) != 2:
      continue
    a, b = (where(x) for x in (cmp.operands if direction.group(1) == "LT" else cmp.operands[::-1]))
    index, limit = _tuple_index(*a), _constant(_through_copies(*b))
    if index is None or limit is None:
      continue
    start = _constant(_through_copies(caller, init.operands[index])) if init is not None and init.opcode == "tuple" \
        and index < len(init.operands) else None
    step = _body_step(body, index, computations)
    if start is None or not step:
      continue
    n = max(0, -(-(limit - start) // step))
    best = n if best is None else min(best, n)
  return best


def _reader(comp: Computation, fused: Computation | None = None, fusion: Instruction | None = None):
  """operand name -> (computation, name) to read it in: in `comp`, or inside `fusion` (of `comp`) calling `fused`,
  where a fused parameter is read as the fusion's operand in `comp`."""
  def where(name):
    x = fused.instructions.get(name) if fused is not None else None
    if x is None:
      return comp, name
    if x.opcode == "parameter" and int(x.operands[0]) < len(fusion.operands):
      return comp, fusion.operands[int(x.operands[0])]
    return fused, name
  return where


def _fused(computations: dict[str, Computation], instr: Instruction) -> Computation | None:
  return computations.get(dict(instr.called()).get("calls", "")) if instr.opcode == "fusion" else None


def _condition_compares(computations: dict[str, Computation], cond: Computation):
  """(compare, its operands' reader) of a loop condition: its own compares and those fused into its fusions
  (XLA's GPU compiler fuses `i < N and ...` into one kernel)."""
  for instr in cond.instructions.values():
    if instr.opcode == "compare":
      yield instr, _reader(cond)
    fused = _fused(computations, instr)
    for cmp in (i for i in (fused.instructions.values() if fused else ()) if i.opcode == "compare"):
      yield cmp, _reader(cond, fused, instr)


def _body_step(body: Computation, index: int, computations: dict[str, Computation] | None = None) -> int | None:
  """The constant added to tuple element `index` on each iteration (the add may be fused, as on GPU)."""
  root = body.root
  if root.opcode != "tuple" or index >= len(root.operands):
    return None
  update = _through_copies(body, root.operands[index])
  where = _reader(body)
  fused = _fused(computations or {}, update) if update is not None else None
  if fused is not None:
    update, where = fused.root, _reader(body, fused, update)
  if update is None or update.opcode != "add":
    return None
  for x, y in (update.operands, update.operands[::-1]):
    if _tuple_index(*where(x)) == index:
      return _constant(_through_copies(*where(y)))
  return None


# ----------------------------------------------------------------------------------------------
# Costs


def _dot_flops(comp: Computation, instr: Instruction) -> float:
  out = math.prod(instr.dims[0][1]) if instr.dims else 0
  lhs = comp.instructions.get(instr.operands[0]) if instr.operands else None
  rhs = comp.instructions.get(instr.operands[1]) if len(instr.operands) > 1 else None
  if instr.opcode == "dot":
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
    if lhs is None or not m:
      return 0.0
    dims = lhs.dims[0][1]
    contracted = math.prod(dims[int(d)] for d in m.group(1).split(",") if d)
    return 2.0 * out * contracted
  # convolution: each output element takes (input features per group) x (valid window taps) multiply-adds.
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
  if lhs is None or rhs is None or not m:
    return 0.0
  lhs_labels, kernel_labels, out_labels = m.groups()
  kernel, lhs_dims, out_dims = rhs.dims[0][1], lhs.dims[0][1], instr.dims[0][1]
  window = _window(instr.attrs)
  taps = 1.0
  for k in range(len(kernel_labels) - 2):  # spatial dims "0", "1", ...
    d = str(k)
    taps *= _valid_taps(lhs_dims[lhs_labels.index(d)], out_dims[out_labels.index(d)],
                        {key: v[k] for key, v in window.items()}, kernel[kernel_labels.index(d)])
  return 2.0 * out * kernel[kernel_labels.index("i")] * taps


def _window(attrs: str) -> dict[str, list]:
  """A convolution's window attributes: size, stride, pad (lo, hi), lhs_dilate, rhs_dilate per spatial dim."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  out: dict[str, list] = {}
  for item in (m.group(1).split() if m else []):
    key, _, value = item.partition("=")
    if key == "pad":
      out[key] = [tuple(int(x) for x in v.split("_")) for v in value.split("x")]
    elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
      out[key] = [int(v) for v in value.split("x")]
  return out


def _valid_taps(n_in: int, n_out: int, w: dict, kernel_size: int) -> float:
  """Mean window taps per output position that land on an input element (not padding, not a dilation hole):
  XLA writes batched matmuls as convolutions whose batch dims are windows over dilated inputs."""
  size, stride = w.get("size", kernel_size), w.get("stride", 1)
  lo, _ = w.get("pad", (0, 0))
  d_in, d_k = w.get("lhs_dilate", 1), w.get("rhs_dilate", 1)
  if size == 1 and lo == 0 and d_in == 1:
    return 1.0
  pos = np.arange(n_out)[:, None] * stride + np.arange(size)[None, :] * d_k - lo  # [out, taps] in the dilated input
  valid = (pos >= 0) & (pos <= (n_in - 1) * d_in) & (pos % d_in == 0)
  return float(valid.sum()) / max(n_out, 1)


def _kernel_flops(comp: Computation, instr: Instruction) -> float:
  """Matmul flops of a Pallas TPU kernel call, by kernel (its instruction is named after the kernel's scope):
  splash attention from its query operand (the first floating-point one); other kernels count none."""
  if 'custom_call_target="tpu_custom_call"' not in instr.attrs or not instr.name.startswith(flash.SPLASH_KERNELS):
    return 0.0
  floats = [o.dims[0][1] for o in (comp.instructions.get(n) for n in instr.operands)
            if o is not None and o.dims and o.dims[0][0] in ("bf16", "f32", "f16")]
  # The fused backward kernel returns dq beside dk and dv (3 results); the separate dkv kernel returns 2.
  fused_dq = "_dkv" in instr.name and len(instr.dims) == 3
  return flash.splash_kernel_flops(instr.name, floats[0], fused_dq) if floats else 0.0


_SLICING = ("dynamic-slice", "slice", "gather")
_UPDATING = ("dynamic-update-slice", "scatter")
_VIEWS = ("bitcast", "reshape", "get-tuple-element")


def _param_bytes_read(computations, fused: Computation, param: Instruction, full: float, depth: int = 0) -> float:
  """Bytes a fused computation reads of one parameter: the slices taken of it, nothing when it is the
  buffer of an in-place update, all of it otherwise (nested fusions and views followed)."""
  read = 0.0
  for user in (u for u in fused.instructions.values() if param.name in u.operands):
    if user.opcode in _SLICING and user.operands[0] == param.name:
      read += user.nbytes
    elif user.opcode in _UPDATING and user.operands[0] == param.name:
      pass  # updated in place: read only where written
    elif user.opcode in _VIEWS and depth < 8:
      read += _param_bytes_read(computations, fused, user, full, depth + 1)
    elif user.opcode == "fusion" and depth < 8:
      inner = computations.get(dict(user.called()).get("calls", ""))
      for pos in (i for i, o in enumerate(user.operands) if o == param.name):
        inner_param = inner.parameter(pos) if inner is not None else None
        read += full if inner_param is None else _param_bytes_read(computations, inner, inner_param, full, depth + 1)
    else:
      return full
  return min(read, full)


def _operand_bytes_read(computations, comp: Computation, instr: Instruction) -> float:
  """Bytes an instruction reads: a dynamic slice reads its slice, an in-place update does not read the
  buffer it updates; inside a fusion the same rules apply to each fused parameter's uses."""
  operands = [comp.instructions.get(o) for o in instr.operands]
  if instr.opcode in _SLICING:
    return instr.nbytes + sum(o.nbytes for o in operands[1:] if o is not None)
  if instr.opcode in _UPDATING:
    return sum(o.nbytes for o in operands[1:] if o is not None)
  if instr.opcode != "fusion":
    return sum(o.nbytes for o in operands if o is not None)
  fused = computations.get(dict(instr.called()).get("calls", ""))
  total = 0.0
  for i, operand in enumerate(operands):
    if operand is None:
      continue
    param = fused.parameter(i) if fused is not None else None
    total += operand.nbytes if param is None else _param_bytes_read(computations, fused, param, operand.nbytes)
  return total


def _written_bytes(computations, instr: Instruction) -> float:
  """Bytes an instruction writes: a fusion whose root is an in-place dynamic update writes the update."""
  if instr.opcode == "fusion":
    fused = computations.get(dict(instr.called()).get("calls", ""))
    if fused is not None:
      roots = [fused.root]
      if fused.root.opcode == "tuple":
        roots = [fused.instructions[o] for o in fused.root.operands if o in fused.instructions]
      total = 0.0
      for r in roots:
        if r.opcode in ("dynamic-update-slice", "scatter"):
          update = fused.instructions.get(r.operands[1 if r.opcode == "dynamic-update-slice" else 2])
          total += update.nbytes if update is not None else 0.0
        else:
          total += r.nbytes
      return total
  return instr.nbytes


@dataclasses.dataclass
class Own:
  """One computation's own cost (called computations excluded)."""
  flops: float = 0.0
  kernel_flops: float = 0.0
  bytes: float = 0.0
  cycles: float = 0.0
  roofline: float = 0.0  # seconds (0 without the chip's rates)


def _instruction_bytes(computations, comp: Computation, instr: Instruction) -> float:
  if instr.opcode in _FREE:
    return 0.0
  if instr.opcode.endswith("-start"):  # an asynchronous pair reads at its start and writes at its done
    return _operand_bytes_read(computations, comp, instr)
  if instr.opcode.endswith("-done"):
    return instr.nbytes
  if instr.opcode in _UPDATING:
    update = comp.instructions.get(instr.operands[1 if instr.opcode == "dynamic-update-slice" else 2])
    return _operand_bytes_read(computations, comp, instr) + (update.nbytes if update is not None else 0.0)
  return _operand_bytes_read(computations, comp, instr) + _written_bytes(computations, instr)


def _instruction_flops(computations, comp: Computation, instr: Instruction) -> float:
  """Dot / convolution flops of an instruction, a fusion's fused dots included (Pallas kernels: none)."""
  if instr.opcode in ("dot", "convolution"):
    return _dot_flops(comp, instr)
  if instr.opcode != "fusion":
    return 0.0
  return sum(_instruction_flops(computations, fused, i)
             for _, name in instr.called() if (fused := computations.get(name)) is not None
             for i in fused.instructions.values())


def own_costs(computations: dict[str, Computation], rates: tuple[float, float] | None = None) -> dict[str, Own]:
  """Each computation's own costs; `rates` (FLOP/s, bytes/s) adds the per-instruction roofline."""
  out = {}
  for comp in computations.values():
    own = Own()
    for instr in comp.instructions.values():
      if instr.opcode in ("dot", "convolution"):
        own.flops += _dot_flops(comp, instr)
      elif instr.opcode == "custom-call":
        own.kernel_flops += _kernel_flops(comp, instr)
      m = ESTIMATED_CYCLES.search(instr.attrs)
      if m:
        own.cycles += float(m.group(1))
      nbytes = _instruction_bytes(computations, comp, instr)
      own.bytes += nbytes
      if rates is not None and instr.opcode not in _FREE and instr.opcode != "custom-call":
        own.roofline += max(_instruction_flops(computations, comp, instr) / rates[0], nbytes / rates[1])
    out[comp.name] = own
  return out


@dataclasses.dataclass
class Loop:
  computation: str  # the while's body
  trip_count: int | None  # None: unknown (counted once)
  multiplier: float  # iterations of the body per program call (the enclosing loops' counts included)


@dataclasses.dataclass
class LoopCosts:
  loops: list[Loop]
  multipliers: dict[str, float]  # computation -> times it runs per call (fusion bodies: their caller's)
  own: dict[str, Own]
  top_level: set[str]  # computations whose instructions are scheduled (not fusion / reducer bodies)

  def total(self, field: str, weighted: bool = True) -> float:
    """A cost summed over computations, each counted `multiplier` times (or once); bytes and cycles are
    counted in top-level computations only (a fusion's traffic is its instruction's operands and result)."""
    names = self.top_level if field in ("bytes", "cycles", "roofline") else self.multipliers
    return sum(getattr(self.own[c], field) * (self.multipliers[c] if weighted else 1) for c in names if c in self.own)

  @property
  def unknown_trip_counts(self) -> int:
    return sum(loop.trip_count is None for loop in self.loops)


def analyse(hlo_text: str, rates: tuple[float, float] | None = None, unknown_trips: float = 1,
            rare: dict[str, tuple[float, float]] | None = None) -> LoopCosts:
  """Loop-aware costs of a compiled program; `rates` (FLOP/s, bytes/s per chip) adds the roofline. A loop whose
  trip count is not in the program (it depends on the data) is counted `unknown_trips` times (once unless the
  caller knows its expected count); a conditional whose op_name holds a key of `rare`, {key: (weight, trips)}, has
  its branches counted `weight` times and the loops of unknown count in them `trips` times (else: every branch once)."""
  computations, entry = parse(hlo_text)
  multipliers: dict[str, float] = {}
  top_level: set[str] = set()
  loops: list[Loop] = []

  def visit(name: str, mult: float, scheduled: bool, unknown: float):
    comp = computations.get(name)
    if comp is None:
      return
    multipliers[name] = multipliers.get(name, 0) + mult
    if scheduled:
      top_level.add(name)
    for instr in comp.instructions.values():
      called = instr.called()
      if instr.opcode == "while":
        n = trip_count(computations, comp, instr)
        body = dict(called)
        loops.append(Loop(body.get("body", ""), n, mult * (n if n is not None else unknown)))
        for part in ("body", "condition"):
          visit(body.get(part, ""), mult * (n if n is not None else unknown), True, unknown)
      elif instr.opcode in ("call", "conditional", "async-start", "call-start"):
        weight, inner = next((w for key, w in (rare or {}).items() if instr.opcode == "conditional"
                              and f"{key}/" in instr.attrs), (1, unknown))
        for _, c in called:
          visit(c, mult * weight, True, inner)
      elif instr.opcode == "fusion":
        for _, c in called:
          visit(c, mult, False, unknown)  # dots inside fusions count as flops; traffic is the fusion's own
      # Reducers / comparators (to_apply) are per-element scalar functions: no dots, no traffic of their own.

  visit(entry, 1, True, unknown_trips)
  return LoopCosts(loops=loops, multipliers=multipliers, own=own_costs(computations, rates), top_level=top_level)
