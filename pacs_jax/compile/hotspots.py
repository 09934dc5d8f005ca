"""Where a compiled program's cycles go: its costliest loops and instructions by the compiler's estimated cycles,
loop trip counts applied (`hlo_cost`); where a regression shows first."""

from __future__ import annotations

import dataclasses
import re

from pacs_jax.compile import hlo_cost
from pacs_jax.compile.hlo_parse import Computation, Instruction, parse


@dataclasses.dataclass
class Hotspot:
  share: float  # of the program's estimated cycles, loops applied
  runs: int  # times it runs per program call
  kind: str  # "loop" (its body and everything called from it) or an instruction's opcode
  what: str  # the traced operation (op_name metadata), shortened
  shape: str  # result type


def _op_name(instr: Instruction) -> str:
  m = re.search(r'op_name="([^"]*)"', instr.attrs)
  name = m.group(1) if m else instr.name
  return "/".join(p for p in name.split("/") if p not in ("while", "body", "closed_call", "checkpoint"))[-90:]


def hotspots(hlo_text: str, top: int = 8) -> tuple[list[Hotspot], list[Hotspot]]:
  """The `top` loops (cycles of their body and all it calls, loops applied) and the `top` instructions
  (fusions, collectives, kernels) by the compiler's estimated cycles: where a regression shows first."""
  computations, entry = parse(hlo_text)
  costs = hlo_cost.analyse(hlo_text)
  total = costs.total("cycles") or 1.0
  inclusive: dict[str, float] = {}

  def cycles_in(name: str, depth: int = 0) -> float:
    if name in inclusive or depth > 64:
      return inclusive.get(name, 0.0)
    comp = computations.get(name)
    own = costs.own[name].cycles * costs.multipliers.get(name, 0) if name in costs.top_level else 0.0
    for instr in (comp.instructions.values() if comp else ()):
      if instr.opcode in ("while", "call", "conditional"):
        own += sum(cycles_in(c, depth + 1) for _, c in instr.called())
    inclusive[name] = own
    return own

  loops, instrs = [], []
  for comp_name in costs.top_level:
    comp = computations.get(comp_name)
    mult = costs.multipliers.get(comp_name, 0)
    for instr in (comp.instructions.values() if comp else ()):
      if instr.opcode == "while":
        body = dict(instr.called()).get("body", "")
        trip = hlo_cost.trip_count(computations, comp, instr)
        loops.append(Hotspot(cycles_in(body) / total, costs.multipliers.get(body, 0), f"trip {trip}",
                             f"{_op_name(instr)} [{_main_dot(computations.get(body))}]", ""))
      m = hlo_cost.ESTIMATED_CYCLES.search(instr.attrs)
      if m and mult:
        instrs.append(Hotspot(float(m.group(1)) * mult / total, mult, instr.opcode, _op_name(instr),
                              instr.shape.split("{")[0][:60]))
  by_share = lambda h: -h.share
  return sorted(loops, key=by_share)[:top], sorted(instrs, key=by_share)[:top]


def _main_dot(body: Computation | None) -> str:
  """The einsum of a loop body's costliest instruction that traces to one (names the loop: layers, chunks)."""
  best, label = -1.0, "?"
  for instr in (body.instructions.values() if body else ()):
    m, op = hlo_cost.ESTIMATED_CYCLES.search(instr.attrs), re.search(r'op_name="[^"]*?/([A-Za-z,]+->[A-Za-z]+)/', instr.attrs)
    if m and op and float(m.group(1)) > best:
      best, label = float(m.group(1)), op.group(1)
  return label


def format_hotspots(hlo_text: str, top: int = 8) -> str:
  loops, instrs = hotspots(hlo_text, top)
  lines = ["  top loops (share of estimated cycles, loops applied; runs per call):"]
  lines += [f"    {h.share:6.1%}  x{h.runs:<6d} {h.kind:9s} {h.what}" for h in loops]
  lines += ["  top instructions:"]
  lines += [f"    {h.share:6.1%}  x{h.runs:<6d} {h.kind:10s} {h.shape:28s} {h.what}" for h in instrs]
  return "\n".join(lines)
