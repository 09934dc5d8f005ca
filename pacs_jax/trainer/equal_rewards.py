"""A run that cannot learn says so: when every group's rewards are equal, group-relative methods (PACS, GRPO)
see no difference to learn from, and PPO's advantages carry only the critic's error."""

from __future__ import annotations

from absl import logging

EQUAL_STEPS = 3  # consecutive steps of all-equal groups before the warning


def why(mean_reward: float) -> str:
  if mean_reward <= 0.0:
    return "the model never solves a problem (every reward 0)"
  return "each problem is solved by all of its responses or by none"


class EqualRewardsWatch:
  """Warns once when `reward/mixed_groups` (packing.rollout_metrics) has been 0 for EQUAL_STEPS steps in a row,
  saying why (the mean reward) and what to change; again after a step with signal, should it return. A streak of
  every reward 1 is the task solved, not a fault: said once in the run, as information."""

  def __init__(self, algorithm: str, steps: int = EQUAL_STEPS):
    self.algorithm, self.steps, self.streak, self.said_solved = algorithm, steps, 0, False

  def observe(self, step: int, row: dict) -> str | None:
    """The warning (or the solved line), logged, at the step that completes a streak; else None."""
    if row.get("reward/mixed_groups", 1.0) > 0.0:
      self.streak = 0
      return None
    self.streak += 1
    if self.streak != self.steps:
      return None
    if row.get("reward/mean", 0.0) >= 1.0:
      if self.said_solved:
        return None
      self.said_solved = True
      message = (f"steps {step - self.steps + 1}-{step}: every response solved its problem: the task is solved "
                 f"(nothing is left for {self.algorithm} to learn from it; a harder task or a stop here)")
      logging.info("%s", message)
      return message
    message = (f"steps {step - self.steps + 1}-{step}: every group's rewards were equal: "
               f"{why(row.get('reward/mean', 0.0))}, so {self.algorithm} has nothing to learn from; use problems "
               "the base model solves sometimes, more responses per prompt (rollout.n), longer responses "
               "(rollout.max_new_tokens) or a stronger base model")
    logging.warning("%s", message)
    return message
