"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"), as verl's docs/algo/grpo.md configures it: GRPO
with no std normalisation of the group advantage and no length normalisation of the loss.

    A_i = R_i − mean_j R_j             (norm_adv_by_std_in_grpo = False)
    loss = mean_i Σ_t m_t ℓ_t / R      (loss_agg_mode = "seq-mean-token-sum-norm", R the max response length)

with ℓ verl's clipped-ratio token loss (dual clip), no KL loss. A named preset: its settings hold the clip ratios
and the entropy coefficient only; the two normalisations cannot be turned back on.

Shapes: B responses = U prompts × n samples, R response positions.
"""

from __future__ import annotations

import dataclasses

from pacs_jax.algos import algorithms
from pacs_jax.algos.grpo import ClipSettings, GrpoFamily
from pacs_jax.algos.settings import setting

LOSS_AGG_MODE = "seq-mean-token-sum-norm"


@dataclasses.dataclass(frozen=True)
class DrGrpoSettings(ClipSettings):
  """Dr. GRPO: GRPO's clip ratios (0.2) and dual clip; the normalisations are the preset's, not settings."""
  clip_ratio_c: float = setting(3.0, "dual clip for negative advantages: a token's loss is at most −A·c")

  def check(self, check):
    super().check(check)
    check(self.clip_ratio_c > 1, "clip_ratio_c", f"must be > 1 (the dual clip's bound), got {self.clip_ratio_c}")


class DrGrpo(GrpoFamily):
  """Dr. GRPO on the shared loop: today's verl normalises the loss over the global mini-batch (mean over its rows
  of each response's token sum / R), where the released PACS recipe's GRPO sums each verl micro-batch."""

  settings_class = DrGrpoSettings

  def norm_adv_by_std(self, settings):
    return False

  def loss_agg_mode(self, settings):
    return LOSS_AGG_MODE


algorithms.register("drgrpo", DrGrpo())
