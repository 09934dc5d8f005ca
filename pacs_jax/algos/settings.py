"""An algorithm's own settings: one typed, frozen dataclass per algorithm with each field's default, its one-line
documentation and the checks of its values (tunix's per-algorithm configs). The run config's `cfg.<algorithm>`
block is built from it (`block`), and the algorithm reads it back typed (`from_block`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable

import ml_collections

# check(condition, field, message): config validation's error reporter (raises naming the field).
Check = Callable[[bool, str, str], None]


def setting(default: Any, doc: str) -> Any:
  """A settings field: its default and its one-line documentation (`Settings.docs`)."""
  return dataclasses.field(default=default, metadata={"doc": doc})


def _type_ok(value: Any, kind: type) -> bool:
  if kind is float:  # an int is a float setting's value too; a bool is neither
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, kind)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The settings of an algorithm that has none. Subclasses declare their fields with `setting(default, doc)` and
  check their values in `check`."""

  def check(self, check: Check) -> None:
    """Checks the values beyond their types; `check(ok, field, message)` names the field within the block."""

  @classmethod
  def docs(cls) -> dict[str, str]:
    """{field: its one-line documentation}."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

  @classmethod
  def block(cls) -> ml_collections.ConfigDict:
    """The defaults as a run config's settings block (field order kept)."""
    return ml_collections.ConfigDict({f.name: f.default for f in dataclasses.fields(cls)})

  @classmethod
  def from_block(cls, block: ml_collections.ConfigDict | dict | None) -> Settings:
    """The settings a run config's block holds (the defaults when it has none); unknown fields are refused by
    `validate`, ignored here."""
    if block is None:
      return cls()
    values = dict(block.items())
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def validate(cls, block: ml_collections.ConfigDict | None, check: Check) -> None:
    """Checks `block`: no field the class lacks, each value of its field's type, then the class's `check`."""
    known = {f.name for f in dataclasses.fields(cls)}
    for name in ([] if block is None else list(block.keys())):
      check(name in known, name, f"is not a setting of this algorithm (its settings: {', '.join(sorted(known))})")
    settings = cls.from_block(block)
    kinds = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      value, kind = getattr(settings, f.name), kinds[f.name]
      check(_type_ok(value, kind), f.name, f"must be a {kind.__name__}, got {value!r}")
    settings.check(check)


def choice(check: Check, value, choices: tuple, field: str) -> None:
  """`check` that `value` is one of `choices` (the message lists them)."""
  check(value in choices, field, f"{' | '.join(choices)}, got {value!r}")
