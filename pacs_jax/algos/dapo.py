"""DAPO (Yu et al. 2025, verl's DAPO recipe): GRPO advantages under a decoupled clip (clip-higher), token-level loss
aggregation, overlong reward shaping and dynamic sampling (groups whose verdicts all agree are dropped and the batch
refilled from new prompts; the loop's refill is trainer/dynamic_sampling.py).

Shapes: B responses = U prompts × n samples (`group_size`), contiguous rows; R response positions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pacs_jax.algos import algorithms
from pacs_jax.algos.grpo import LOSS_AGG_MODES, ClippedRatioSettings, GrpoFamily
from pacs_jax.algos.settings import setting


def overlong_penalty(lengths: np.ndarray, *, max_response_len: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
  """[B] response lengths -> [B] penalties ≤ 0 added to the rewards (verl's DAPORewardManager, overlong_buffer):

    min(−(ℓ − (R_max − L_buf)) / L_buf · factor, 0)

  0 up to R_max − L_buf tokens, then falling linearly to −factor at R_max (= rollout.max_new_tokens).
  `buffer_len` 0: no penalty.
  """
  if buffer_len <= 0:
    return np.zeros(lengths.shape, np.float32)
  exceed = np.asarray(lengths, np.float32) - np.float32(max_response_len - buffer_len)
  return np.minimum(-exceed / np.float32(buffer_len) * np.float32(penalty_factor), np.float32(0.0))


def keep_groups(scores: np.ndarray, group_size: int) -> np.ndarray:
  """[B] verdicts, rows prompt-major -> [U] the groups dynamic sampling keeps: those whose verdicts differ (std > 0),
  or a group of one (the DAPO recipe's filter_groups on the `acc` metric). A group whose responses all agree has
  zero GRPO advantage and so gives no gradient."""
  groups = np.asarray(scores, np.float64).reshape(-1, group_size)  # [U, n]
  return (np.std(groups, axis=-1) > 0) | (group_size == 1)


@dataclasses.dataclass(frozen=True)
class DapoSettings(ClippedRatioSettings):
  """DAPO as verl's recipe runs it (recipe/dapo/run_dapo_qwen2.5_32b.sh): GRPO advantages (std-normalised), no KL."""
  clip_ratio_high: float = setting(0.28, "ε_high of the decoupled clip (clip-higher; ε_low stays 0.2)")
  clip_ratio_c: float = setting(10.0, "dual clip for negative advantages (the recipe's 10)")
  loss_agg_mode: str = setting("token-mean", "token-level loss: " + " | ".join(LOSS_AGG_MODES))
  # The recipe's 4096 of a 20480-token budget (R_max = rollout.max_new_tokens here); verl's default is off.
  overlong_buffer_len: int = setting(0, "L_buf: the last tokens of the budget over which the penalty grows; 0 = off")
  overlong_penalty_factor: float = setting(1.0, "the penalty at the full budget (on verl's ±1 reward scale)")
  filter_groups: bool = setting(True, "dynamic sampling: drop groups whose verdicts all agree, refill the batch")
  max_num_gen_batches: int = setting(10, "rollouts a step may draw to fill its batch; 0 = no limit")

  def check(self, check):
    super().check(check)
    check(self.overlong_buffer_len >= 0, "overlong_buffer_len",
          f"must be >= 0 (0 = off), got {self.overlong_buffer_len}")
    check(self.overlong_penalty_factor >= 0, "overlong_penalty_factor",
          f"must be >= 0, got {self.overlong_penalty_factor}")
    check(self.max_num_gen_batches >= 0, "max_num_gen_batches",
          f"must be >= 0 (0 = no limit), got {self.max_num_gen_batches}")


class Dapo(GrpoFamily):
  """DAPO on the shared loop: the GRPO loss of today's verl (global token-mean over the mini-batch) on shaped
  rewards, with dynamic sampling."""

  settings_class = DapoSettings
  shapes_rewards = True  # the overlong penalty

  def validate(self, cfg, check, num_processes):
    buffer_len = self.settings(cfg).overlong_buffer_len
    check(buffer_len <= cfg.rollout.max_new_tokens, f"{self.name}.overlong_buffer_len",
          f"must be at most rollout.max_new_tokens={cfg.rollout.max_new_tokens}, got {buffer_len}")

  def norm_adv_by_std(self, settings):
    return True

  def shape_rewards(self, objective, scores, response_mask):
    s = objective.settings
    penalty = overlong_penalty(response_mask.sum(-1), max_response_len=objective.max_new_tokens,
                               buffer_len=s.overlong_buffer_len, penalty_factor=s.overlong_penalty_factor)
    return (scores + penalty).astype(np.float32)

  def sampling_rounds(self, objective):
    s = objective.settings
    return s.max_num_gen_batches if s.filter_groups else 1

  def keep_groups(self, objective, scores):
    if not objective.settings.filter_groups:
      return super().keep_groups(objective, scores)
    return keep_groups(scores, objective.group_size)


algorithms.register("dapo", Dapo())
