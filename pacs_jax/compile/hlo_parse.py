"""HLO module text -> computations of instructions (name, result shape, opcode, operands, attributes)."""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # the result type, e.g. "bf16[8,128]{1,0}" or a tuple "(s32[], f32[4])"
  opcode: str
  operands: list[str]
  attrs: str
  root: bool = False

  @property
  def dims(self) -> list[tuple[str, list[int]]]:
    return [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _ARRAY.findall(self.shape)]

  @property
  def nbytes(self) -> float:
    return sum(_DTYPE_BYTES[t] * math.prod(d) for t, d in self.dims)

  def called(self) -> list[tuple[str, str]]:
    out = [(kind, name) for kind, name in _CALLED.findall(self.attrs)]
    for group in _BRANCHES.findall(self.attrs):
      out += [("branch", n) for n in _NAME.findall(group)]
    return out


@dataclasses.dataclass
class Computation:
  name: str
  instructions: dict[str, Instruction]

  @property
  def root(self) -> Instruction:
    return next(i for i in self.instructions.values() if i.root)

  def parameter(self, index: int) -> Instruction | None:
    return next((i for i in self.instructions.values() if i.opcode == "parameter" and i.operands == [str(index)]), None)


def _matching(text: str, start: int) -> int:
  """Index just past the bracket that closes text[start] ("(" or "{")."""
  open_, close = text[start], {"(": ")", "{": "}"}[text[start]]
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] == open_
    depth -= text[i] == close
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced HLO text near {text[start:start + 80]!r}")


def _parse_instruction(line: str) -> Instruction | None:
  body = line.strip()
  root = body.startswith("ROOT ")
  if root:
    body = body[5:]
  if not body.startswith("%") or " = " not in body:
    return None
  name, rest = body.split(" = ", 1)
  if rest.startswith("("):
    end = _matching(rest, 0)
  else:
    end = rest.index(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.index("(")
  opcode = rest[:paren]
  close = _matching(rest, paren)
  args = rest[paren + 1:close - 1]
  operands = [args.strip()] if opcode in ("parameter", "constant") else _NAME.findall(args)
  return Instruction(name=name[1:], shape=shape, opcode=opcode, operands=operands, attrs=rest[close:], root=root)


def parse(hlo_text: str) -> tuple[dict[str, Computation], str]:
  """(computations by name, the entry computation's name) of an HLO module's text."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if current is None:
      m = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
      if m:
        current = Computation(m.group(2), {})
        if m.group(1):
          entry = current.name
      continue
    if line.rstrip() == "}":  # not "}}, metadata=...": the tail of a Pallas kernel's multi-line attributes
      computations[current.name] = current
      current = None
      continue
    instr = _parse_instruction(line)
    if instr is not None:
      current.instructions[instr.name] = instr
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry
