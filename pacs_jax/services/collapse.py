"""A run that collapses says so at once: a reward or validation accuracy that falls from a sustained level (its
trailing mean at least `LEVEL`) to at most `FRACTION` of it is one warning line naming the step, the drop and the
checkpoint to go back to, and the run's closing line repeats it (issue 44).

The reward is the verifier's mean over every response the step sampled (`sampling/score_mean` under dynamic
sampling, whose trained batch holds mixed groups by construction, else `reward/mean`); validation is
`val/accuracy/all`. Pure bookkeeping on metrics rows: the loop feeds it each step's row.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

from absl import logging

LEVEL = 0.9  # a sustained level: the trailing mean of the metric at least this
FRACTION = 0.5  # a collapse: one measurement at most this fraction of that mean
# The metrics watched: {name in the line: measurements the level averages over}. Validation runs every
# `eval_every` steps, so its window is a few evaluations, not ten.
REWARD, VALIDATION = "reward", "validation accuracy"
WINDOWS = {REWARD: 10, VALIDATION: 3}


def reward_of(row: dict) -> float | None:
  """The verifier's mean over every response the step sampled, or None in a row without one."""
  value = row.get("sampling/score_mean", row.get("reward/mean"))
  return None if value is None else float(value)


def falls(values: Sequence[float], window: int = 10, level: float = LEVEL, fraction: float = FRACTION) -> list[int]:
  """The indices i of a metric's measurements where it collapsed: mean(values[i - window:i]) >= level and
  values[i] <= fraction · that mean. After a fall the window starts over, so a run that stays down counts once."""
  out, trailing = [], collections.deque(maxlen=window)
  for i, value in enumerate(values):
    if len(trailing) == window and _fell(value, sum(trailing) / window, level, fraction):
      out.append(i)
      trailing.clear()
      continue
    trailing.append(value)
  return out


def _fell(value: float, mean: float, level: float, fraction: float) -> bool:
  return mean >= level and value <= fraction * mean


@dataclasses.dataclass(frozen=True)
class Collapse:
  step: int
  metric: str  # REWARD | VALIDATION
  level: float  # the trailing mean it fell from
  value: float  # what it fell to
  window: int  # measurements the level averaged
  checkpoint: int | None  # the newest checkpoint saved while the metric was at the level (None: none)

  def drop(self) -> str:
    return (f"{self.metric} fell from {self.level:.3g} (mean of the last {self.window} "
            f"{'steps' if self.metric == REWARD else 'evaluations'}) to {self.value:.3g}")

  def back_to(self) -> str:
    if self.checkpoint is None:
      return "no checkpoint was saved while it held (a rerun starts over)"
    return f"go back to the checkpoint of step {self.checkpoint}"

  def line(self) -> str:
    """The warning: `training collapsed at step N: reward fell from 0.98 (...) to 0.25; go back to ...`."""
    return f"training collapsed at step {self.step}: {self.drop()}; {self.back_to()}"


class Watch:
  """Follows a run's rows: `observe(step, row, last_saved)` warns (and returns the line) at a step where the reward or
  validation accuracy collapsed; `events` holds every collapse, for the closing line (`closing`)."""

  def __init__(self, level: float = LEVEL, fraction: float = FRACTION, windows: dict[str, int] | None = None):
    self.level, self.fraction = level, fraction
    self.windows = dict(WINDOWS if windows is None else windows)
    self.trailing = {name: collections.deque(maxlen=w) for name, w in self.windows.items()}
    self.healthy_checkpoint: dict[str, int | None] = {name: None for name in self.windows}
    self.events: list[Collapse] = []

  def observe(self, step: int, row: dict, last_saved: int | None) -> list[str]:
    """`last_saved`: the newest checkpoint saved before this step's row (none of this step's own)."""
    lines = []
    for name, value in ((REWARD, reward_of(row)), (VALIDATION, row.get("val/accuracy/all"))):
      if value is None or not math.isfinite(value):
        continue
      event = self._add(name, step, float(value), last_saved)
      if event is not None:
        self.events.append(event)
        logging.warning("%s", event.line())
        lines.append(event.line())
    return lines

  def _add(self, name: str, step: int, value: float, last_saved: int | None) -> Collapse | None:
    trailing, window = self.trailing[name], self.windows[name]
    mean = sum(trailing) / window if len(trailing) == window else None
    if mean is not None and _fell(value, mean, self.level, self.fraction):
      trailing.clear()  # the level must be reached again before another collapse counts
      return Collapse(step, name, mean, value, window, self.healthy_checkpoint[name])
    trailing.append(value)
    if value >= self.level:  # the policy measured here is at the level, and so were the checkpoints saved so far
      self.healthy_checkpoint[name] = last_saved
    return None


def closing(line: str, events: Sequence[Collapse]) -> str:
  """The run's closing line (`done at step N: ...`) saying, when the run collapsed, where and where to go back to:
  `done at step 300, but training collapsed at step 282 (reward fell from ... to ...; go back to ...): ...`."""
  if not events:
    return line
  first = events[0]
  more = f", and {len(events) - 1} more collapse(s) after it" if len(events) > 1 else ""
  head, sep, rest = line.partition(": ")
  return f"{head}, but training collapsed at step {first.step} ({first.drop()}{more}; {first.back_to()}){sep}{rest}"
