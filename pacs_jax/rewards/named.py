"""Rewards named in the config (`reward.fn = "package.module:function"`): the name's function, or why there is none.
A module-level function is pickled by reference, so the name is also how a worker process finds it."""

from __future__ import annotations

from typing import Callable

from pacs_jax import plugins

# The built-in reward: math-verify, and the synthetic tasks' verifier for their data sources (rewards/math.py).
BUILTIN = "pacs_jax.rewards.math:checked_score_for"


def problem(name: str) -> str | None:
  """Why `name` names no reward function (it cannot be imported, or is not callable), or None when it does."""
  return plugins.lookup(name)[1]


def resolve(name: str) -> Callable:
  """The reward function `name` ("package.module:function") names; ValueError saying why when there is none."""
  fn, why = plugins.lookup(name)
  if fn is None:
    raise ValueError(f"reward {name!r}: {why}")
  return fn
