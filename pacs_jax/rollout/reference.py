"""What a dense KV cache (every slot L rows of its own) would read and hold for a rollout the paged cache ran: the
reference figures tests and benchmarks compare page budgets with. Nothing in the rollout uses it.

The dense cache read a window of its first rows per slot and step, the window the smallest power of two from
`min_window` (or L itself) that holds every busy slot for the call's steps, and held B x L rows.
Shapes: B slots, L cache rows per slot.
"""

from __future__ import annotations

import numpy as np

from pacs_jax.rollout import budget as budget_lib
from pacs_jax.rollout.engine import Engine


class _Recording:
  """An engine's page policy that also records the (rows, busy) of each call it picks a page budget for."""

  def __init__(self, policy: budget_lib.PagePolicy):
    self.policy, self.calls = policy, []

  def __getattr__(self, name):
    return getattr(self.policy, name)

  def page_budget(self, rows, busy):
    self.calls.append((np.array(rows), np.array(busy)))
    return self.policy.page_budget(rows, busy)


class DenseReference:
  """Counts, while installed on `engine` (a context manager), the KV rows a dense windowed cache would have read
  in the decode calls `scheduler.generate` makes."""

  def __init__(self, engine: Engine, min_window: int):
    self.engine = engine
    self.windows = budget_lib.pow2_ladder(min_window, engine.cache_length)
    self.steps: list[int] = []  # decode steps of each call (iterations that emitted a token)
    self._recording = _Recording(engine.policy)

  def __enter__(self) -> DenseReference:
    decode = type(self.engine).decode.__get__(self.engine)

    def counted(*args):
      state, out = decode(*args)
      self.steps.append(int(np.asarray(out.emitted).any(axis=0).sum()))
      return state, out

    self.engine.policy, self.engine.decode = self._recording, counted
    return self

  def __exit__(self, *exc) -> None:
    self.engine.policy = self._recording.policy
    del self.engine.decode

  @property
  def calls(self) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows [B], busy [B]) of each decode call, as the scheduler passed them."""
    return self._recording.calls

  def window(self, rows: np.ndarray, busy: np.ndarray) -> int:
    """The dense window (rows a slot reads per step) that holds every busy slot for a call's steps."""
    need = int(np.minimum(rows + self.engine.steps_per_call, self.engine.cache_length)[busy].max())
    return next(w for w in self.windows if w >= need)

  @property
  def rows_read(self) -> int:
    """KV rows the dense cache would have read, summed over steps and slots (per layer)."""
    B = self.engine.max_concurrent_decodes
    return sum(n * B * self.window(rows, busy) for (rows, busy), n in zip(self.calls, self.steps))

  @property
  def rows_per_step(self) -> float:
    return self.rows_read / max(sum(self.steps), 1)

  @property
  def rows_held(self) -> int:
    """B x L: every slot's rows, allocated whether used or not."""
    return self.engine.max_concurrent_decodes * self.engine.cache_length
