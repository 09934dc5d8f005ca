"""Functions named in a config as "package.module:name" (a reward, a rollout engine's factory): the named callable,
or one line saying why there is none. A module-level function is pickled by reference, so its name is also how a
worker process finds it."""

from __future__ import annotations

import importlib
from typing import Callable


def lookup(name: str, form: str = '"package.module:function"') -> tuple[Callable | None, str | None]:
  """(the callable `name` names, None), or (None, why it names none); `form`: what a name must look like, for the
  message."""
  module_name, colon, attribute = name.partition(":") if isinstance(name, str) else ("", "", "")
  if not colon or not module_name or not attribute:
    return None, f"must be {form}, got {name!r}"
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001 -- a module that raises on import names nothing either
    return None, f"cannot import {module_name!r} ({type(e).__name__}: {e})"
  fn = getattr(module, attribute, None)
  if fn is None:
    return None, f"module {module_name!r} has no {attribute!r}"
  if not callable(fn):
    return None, f"{name!r} is not callable (a value of type {type(fn).__name__})"
  return fn, None
