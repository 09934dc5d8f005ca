"""Rewards named in the config (`reward.fn = "package.module:function"`): the name's function, or why there is none.
A module-level function is pickled by reference, so the name is also how a worker process finds it."""

from __future__ import annotations

import importlib
from typing import Callable

# The built-in reward: math-verify, and the synthetic tasks' verifier for their data sources (rewards/math.py).
BUILTIN = "pacs_jax.rewards.math:checked_score_for"


def _lookup(name: str) -> tuple[Callable | None, str | None]:
  """(the function `name` names, None), or (None, why it names none)."""
  module_name, colon, attribute = name.partition(":") if isinstance(name, str) else ("", "", "")
  if not colon or not module_name or not attribute:
    return None, f'must be "package.module:function", got {name!r}'
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001 -- a module that raises on import names no reward either
    return None, f"cannot import {module_name!r} ({type(e).__name__}: {e})"
  fn = getattr(module, attribute, None)
  if fn is None:
    return None, f"module {module_name!r} has no {attribute!r}"
  if not callable(fn):
    return None, f"{name!r} is not callable (a value of type {type(fn).__name__})"
  return fn, None


def problem(name: str) -> str | None:
  """Why `name` names no reward function (it cannot be imported, or is not callable), or None when it does."""
  return _lookup(name)[1]


def resolve(name: str) -> Callable:
  """The reward function `name` ("package.module:function") names; ValueError saying why when there is none."""
  fn, why = _lookup(name)
  if fn is None:
    raise ValueError(f"reward {name!r}: {why}")
  return fn
