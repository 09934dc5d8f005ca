"""What every process of a multi-host run exchanges: all-gathers, agreement flags, each process's share of the rows.

With one process every function is the identity (no collective is entered).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from pacs_jax.storage import lock as workdir_lock


def _multihost_utils():
  from jax.experimental import multihost_utils  # only multi-process runs need it
  return multihost_utils


def gather_rows(rows: np.ndarray) -> np.ndarray:
  """[local_rows, ...] on each process -> [Σ local_rows, ...], processes in order."""
  if jax.process_count() == 1:
    return rows
  return np.asarray(_multihost_utils().process_allgather(rows, tiled=True))


def sum_over_processes(values: np.ndarray) -> np.ndarray:
  """Element-wise sum of every process's `values`."""
  if jax.process_count() == 1:
    return values
  return np.asarray(_multihost_utils().process_allgather(values)).sum(0)


def any_process(flags: Sequence[bool]) -> tuple[bool, ...]:
  """Each flag, true if it is true on any process (every process must call this at the same point)."""
  if jax.process_count() == 1:
    return tuple(bool(f) for f in flags)
  gathered = _multihost_utils().process_allgather(np.asarray(flags, np.int32))
  return tuple(bool(f) for f in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))


def from_process_0(flag: bool) -> bool:
  """Process 0's `flag`, on every process."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(_multihost_utils().broadcast_one_to_all(np.int32(flag)))


def gather_prompts(local: list[list[int]], max_len: int) -> list[list[int]]:
  """Every process runs the same (global) rollout, so all need the global prompt list, processes in order."""
  if jax.process_count() == 1:
    return local
  padded = np.full((len(local), max_len), -1, np.int32)  # [local prompts, max_len]
  for i, p in enumerate(local):
    padded[i, :len(p)] = p
  return [[t for t in row if t >= 0] for row in gather_rows(padded)]


def gather_strings(local: list[str]) -> list[str]:
  """Every process's strings (each process the same number), processes in order."""
  if jax.process_count() == 1:
    return list(local)
  data = [list(s.encode("utf-8")) for s in local]
  longest = int(gather_rows(np.asarray([max((len(d) for d in data), default=0)], np.int32)).max())
  return [bytes(row).decode("utf-8") for row in gather_prompts(data, longest)]


def process_count() -> int:
  return jax.process_count()


def process_offset(num_local: int) -> int:
  """Where this process's share of `num_local` items starts in the global order (processes in order)."""
  return jax.process_index() * num_local


def local_share(completions: list, num_local_prompts: int) -> list:
  """The completions of this process's prompts (of a global rollout), their prompt indices made local."""
  start = jax.process_index() * num_local_prompts
  local = [c for c in completions if start <= c.prompt_index < start + num_local_prompts]
  for c in local:
    c.prompt_index -= start
  return local


def process_file_name(step: int, suffix: str) -> str:
  """`<step><suffix>`, or `<step>.process<i><suffix>` when several processes write their own share."""
  return f"{step}{suffix}" if jax.process_count() == 1 else f"{step}.process{jax.process_index()}{suffix}"


def lock_workdir(workdir: str, stale_after_s: float) -> workdir_lock.WorkdirLock:
  """Process 0 takes the workdir lock; every process learns whether it could (and all stop if not)."""
  lock = workdir_lock.WorkdirLock(workdir, stale_after_s)
  error = None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except workdir_lock.WorkdirLocked as e:
      error = e
  if from_process_0(error is not None) and error is None:
    raise workdir_lock.WorkdirLocked(f"process 0 could not lock {workdir}: another trainer uses it")
  if error is not None:
    raise error
  return lock
