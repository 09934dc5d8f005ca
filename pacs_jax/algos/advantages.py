"""Advantage estimators registered by name (as tunix's rl/algo_core.py): a group baseline is one function
`estimator(values [B], group_size) -> [B]` and a `register` call, and an objective names the one it uses.

Shapes: B responses = U prompts × n samples (`group_size`), rows of one prompt contiguous.
"""

from __future__ import annotations

from typing import Callable

import jax

from pacs_jax.algos import groups as groups_lib

# estimator(values [B], group_size) -> advantages [B]. Gradients flow through it (PACS differentiates its score
# through the baseline); an objective whose values are constants stops their gradient before the call.
Estimator = Callable[[jax.Array, int], jax.Array]
_ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
  """A decorator: makes the function the estimator named `name`; returns it unchanged."""

  def add(fn: Estimator) -> Estimator:
    _ESTIMATORS[name] = fn
    return fn

  return add


def names() -> tuple[str, ...]:
  return tuple(sorted(_ESTIMATORS))


def get(name: str) -> Estimator:
  try:
    return _ESTIMATORS[name]
  except KeyError:
    raise KeyError(f"unknown advantage estimator {name!r}; registered: {', '.join(names())}") from None


@register("grpo")
def grpo(values: jax.Array, group_size: int) -> jax.Array:
  """A_i = (x_i − mean_j x_j) / (std_j x_j + eps) over i's group (std unbiased, ddof=1, eps 1e-6)."""
  return groups_lib.mean_std_normalise(groups_lib.split_groups(values, group_size), True).reshape(-1)


@register("drgrpo")
def group_mean(values: jax.Array, group_size: int) -> jax.Array:
  """A_i = x_i − mean_j x_j over i's group (Dr. GRPO: GRPO without the std)."""
  return groups_lib.mean_std_normalise(groups_lib.split_groups(values, group_size), False).reshape(-1)


@register("rloo")
def rloo(values: jax.Array, group_size: int) -> jax.Array:
  """A_i = x_i − mean_{j≠i} x_j (leave-one-out baseline, as PACS scores r̂)."""
  return groups_lib.rloo(groups_lib.split_groups(values, group_size)).reshape(-1)


@register("naive")
def naive(values: jax.Array, group_size: int) -> jax.Array:
  """A_i = x_i: no baseline."""
  return values
