"""Checks of the `env` block (defaults.py: the environment a response is a conversation with): each raises
ConfigError in one line naming the field, and the modes a conversation rollout does not run in are refused here."""

from __future__ import annotations

from typing import Callable

import ml_collections

ENVS = ("single_turn", "python_tool")  # env.name
LOCAL_ENGINE = "local"  # rollout.engine of the in-process engine, the one that continues a slot after a turn


def validate_env(c: ml_collections.ConfigDict, check: Callable[[bool, str, str], None], num_processes: int,
                 sampling_rounds: Callable[[], int]) -> None:
  """`check(ok, field, message)` raises naming config.<field>. `sampling_rounds()`: the objective's rollouts per
  step (more than 1: dynamic sampling)."""
  validate_block(c.env, check)
  e = c.env
  if e.name == "single_turn":
    return
  tool = f"env.name={e.name!r}"
  check(c.rollout.mode == "sync", "rollout.mode",
        f"{tool} runs with 'sync' only: an overlapped rollout ({c.rollout.mode}) samples on a background worker "
        "that does not run conversations (its environment and sandbox are the step's own)")
  check(c.rollout.devices == 0, "rollout.devices",
        f"{tool} runs on shared devices only: the split rollout does not continue a slot after a tool's turn")
  check(c.rollout.engine == LOCAL_ENGINE, "rollout.engine",
        f"{tool} needs the in-process engine ('local'), the one that continues a slot after a tool's turn")
  check(num_processes == 1, "env.name",
        f"{tool} runs on one process: the conversation rollout reads this process's data rows, not every process's")
  check(sampling_rounds() == 1, "env.name",
        f"{tool} takes one rollout per step; {c.algorithm} samples dynamically (its refills are not conversations)")


def validate_block(e: ml_collections.ConfigDict, check: Callable[[bool, str, str], None]) -> None:
  """The `env` block's own fields (training's and evaluation's): the name, the turns and the sandbox's limits."""
  check(e.name in ENVS, "env.name", f"must be one of {' | '.join(ENVS)}, got {e.name!r}")
  check(isinstance(e.max_turns, int) and e.max_turns >= 1, "env.max_turns",
        f"must be an integer >= 1, got {e.max_turns!r}")
  for field in ("cpu_seconds", "wall_seconds", "memory_mb", "output_bytes"):
    check(e[field] > 0, f"env.{field}", f"must be positive (a sandbox limit), got {e[field]!r}")
  check(isinstance(e.workers, int) and e.workers >= 1, "env.workers", f"must be an integer >= 1, got {e.workers!r}")
