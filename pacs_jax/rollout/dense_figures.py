"""What a dense KV cache (every slot L rows of its own) would have read and held in the decode calls of a rollout
the paged cache ran: the figures tests and benchmarks compare page budgets with. Nothing in the rollout uses it.

The dense cache read a window of its first rows per slot and step, the window the smallest power of two from
`min_window` (or L itself) that holds every busy slot for the call's steps, and held B x L rows.
Shapes: B slots, L cache rows per slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pacs_jax.rollout import budget as budget_lib
from pacs_jax.rollout.engine import Engine
from pacs_jax.rollout.decode_state import DecodeStats


@dataclasses.dataclass
class DenseFigures(DecodeStats):
  """The `DecodeStats` of a paged rollout (`scheduler.generate(stats=...)`) and, from the same decode calls, what a
  dense windowed cache would have read and held (`dense_rows_per_step`, `dense_rows_held`)."""
  slots: int = 1  # B
  cache_length: int = 1  # L
  steps_per_call: int = 1
  min_window: int = 1
  # (rows [B], busy [B], steps) of each decode call: the slots' filled rows as the call started, and its steps.
  calls: list[tuple[np.ndarray, np.ndarray, int]] = dataclasses.field(default_factory=list)

  @classmethod
  def of(cls, engine: Engine, min_window: int) -> DenseFigures:
    """Figures for a rollout on `engine` against a dense cache whose windows start at `min_window` rows."""
    return cls(slots=engine.max_concurrent_decodes, cache_length=engine.cache_length,
               steps_per_call=engine.steps_per_call, min_window=min_window)

  def add_call(self, rows: np.ndarray, busy: np.ndarray, steps: int, rows_per_step: int, rows_held: int) -> None:
    super().add_call(rows, busy, steps, rows_per_step, rows_held)
    self.calls.append((np.array(rows), np.array(busy), steps))

  def window(self, rows: np.ndarray, busy: np.ndarray) -> int:
    """The dense window (rows a slot reads per step) that holds every busy slot for a call's steps."""
    need = int(np.minimum(rows + self.steps_per_call, self.cache_length)[busy].max())
    return next(w for w in budget_lib.pow2_ladder(self.min_window, self.cache_length) if w >= need)

  @property
  def dense_rows_read(self) -> int:
    """KV rows the dense cache would have read, summed over steps and slots (per layer)."""
    return sum(steps * self.slots * self.window(rows, busy) for rows, busy, steps in self.calls)

  @property
  def dense_rows_per_step(self) -> float:
    return self.dense_rows_read / max(sum(steps for *_, steps in self.calls), 1)

  @property
  def dense_rows_held(self) -> int:
    """B x L: every slot's rows, allocated whether used or not."""
    return self.slots * self.cache_length
