"""Training health: a run that has died numerically or diverged stops at the step boundary, before it saves, in one
line naming the symptom, the step and the last healthy checkpoint (`config.health`).

Dead: for `health.patience` consecutive steps no update applied (every gradient non-finite), a gradient norm of
exactly 0 while the rewards within some group differ (so the objective has something to learn from; GRPO's
all-equal groups legitimately give none), or the entropy pinned at the uniform policy's ln V. Diverged, at once:
a parameter norm `health.max_param_growth` times its norm at the start, or one that moved by
`health.max_update_ratio` times itself in one step (non-finite norms included). Weights non-finite from the start
(a NaN base model or checkpoint) stop the run at its first step with a line saying so, not advising a lower rate.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections


class Unhealthy(Exception):
  """The run has died or diverged; the message is the one line to show."""


@dataclasses.dataclass(frozen=True)
class Symptom:
  name: str  # skipped_updates | zero_gradient | uniform_entropy | param_norm | update_norm (its change)
  text: str  # what was seen, for the line


def dead_symptoms(row: dict[str, float], skipped: int, updates: int, log_vocab: float, entropy_tol: float
                  ) -> list[Symptom]:
  """The dead-run symptoms of one step's metrics row (`skipped` of its `updates` updates were skipped)."""
  out = []
  if skipped >= updates:
    out.append(Symptom("skipped_updates", "no update applied (every gradient non-finite)"))
  if row["grad_norm"] == 0 and row["reward/mixed_groups"] > 0:
    out.append(Symptom("zero_gradient", f"gradient norm 0 while the rewards within {row['reward/mixed_groups']:.0%} "
                                        "of the groups differ"))
  if row["entropy"] >= log_vocab - entropy_tol:
    out.append(Symptom("uniform_entropy", f"entropy {row['entropy']:.4f} at the uniform policy's ln V = "
                                          f"{log_vocab:.4f}"))
  return out


def diverged_symptoms(row: dict[str, float], start_norm: float, previous_norm: float, max_growth: float,
                      max_ratio: float) -> list[Symptom]:
  """Exploding norms in one step's row: |θ| > max_growth |θ_start|, or ||θ| - |θ before the step|| > max_ratio |θ before
  the step| (the update's norm is at least that; 0 = off); a non-finite norm always counts."""
  out = []
  param_norm = row["param_norm"]
  update_norm = abs(param_norm - previous_norm)  # |Δθ| >= ||θ_t| - |θ_t-1|| (a lower bound, from the norms alone)
  if not math.isfinite(param_norm):
    out.append(Symptom("param_norm", f"parameter norm {param_norm} (it was {start_norm:.3g} at the start)"))
  elif max_growth and start_norm > 0 and param_norm > max_growth * start_norm:
    out.append(Symptom("param_norm", f"parameter norm {param_norm:.3g}, {param_norm / start_norm:.3g}x its "
                                     f"{start_norm:.3g} at the start (health.max_param_growth={max_growth:g})"))
  if math.isfinite(param_norm) and max_ratio and previous_norm > 0 and update_norm > max_ratio * previous_norm:
    out.append(Symptom("update_norm", f"the parameter norm moved by {update_norm:.3g} in one step, "
                                      f"{update_norm / previous_norm:.3g}x its {previous_norm:.3g} before it "
                                      f"(health.max_update_ratio={max_ratio:g})"))
  return out


class Monitor:
  """Follows a run's steps: `check(step, row, skipped)` raises Unhealthy at the first dead or diverged step;
  `saving_is_healthy` says whether a periodic save may happen now (not while a dead symptom lasts, so a dead state
  never replaces the last healthy checkpoint); `saved(step)` is told each save."""

  def __init__(self, cfg: ml_collections.ConfigDict, vocab_size: int, updates_per_step: int, start_norm: float,
               restored_step: int | None):
    self.h = cfg.health
    self.log_vocab, self.updates = math.log(vocab_size), updates_per_step
    self.start_norm = self.previous_norm = start_norm
    self.last_saved = self.restored = restored_step  # the newest healthy checkpoint; the one the run started from
    self.streaks: dict[str, int] = {}  # dead symptom -> consecutive steps
    self.suspect_since: int | None = None  # the first step of the current run of steps with a dead symptom

  @property
  def saving_is_healthy(self) -> bool:
    return self.suspect_since is None

  def saved(self, step: int) -> None:
    self.last_saved = step

  def check(self, step: int, row: dict[str, float], skipped: int) -> None:
    diverged = diverged_symptoms(row, self.start_norm, self.previous_norm, self.h.max_param_growth,
                                 self.h.max_update_ratio)
    self.previous_norm = row["param_norm"]
    # Non-finite weights at the start (a LoRA run's base: its adapters stay finite, every update is skipped) are no
    # learning rate's doing: say where they came from.
    if (diverged or skipped >= self.updates) and not math.isfinite(self.start_norm):
      raise Unhealthy(self.non_finite_start(step))
    if diverged:
      raise Unhealthy(self.line(step, diverged[0].text, "diverged", step))
    dead = dead_symptoms(row, skipped, self.updates, self.log_vocab, self.h.entropy_tolerance) if self.h.patience else []
    self.streaks = {s.name: self.streaks.get(s.name, 0) + 1 for s in dead}
    self.suspect_since = (self.suspect_since or step) if dead else None
    for symptom in dead:
      if self.streaks[symptom.name] >= self.h.patience:
        raise Unhealthy(self.line(step, f"{symptom.text} for {self.h.patience} steps", "died", self.suspect_since))

  def line(self, step: int, what: str, verb: str, first_bad: int) -> str:
    """`training <verb> at step N: <what>; stopped without saving; the last healthy checkpoint is step M ...`."""
    if self.last_saved is not None and self.last_saved < first_bad:
      healthy = f"the last healthy checkpoint is step {self.last_saved} (a rerun resumes from it: lower train.lr first)"
    else:
      healthy = f"no checkpoint before step {first_bad} (a rerun starts over: lower train.lr first)"
    return f"training {verb} at step {step}: {what}; stopped without saving; {healthy}"

  def non_finite_start(self, step: int) -> str:
    """`training stopped at step N: the weights were non-finite before any update ...` (a NaN base model or
    checkpoint: every gradient is non-finite, so no update applies, whatever train.lr is)."""
    source = (f"the checkpoint of step {self.restored}" if self.restored is not None
              else "the starting model (config.model)")
    return (f"training stopped at step {step}: the weights were non-finite before any update (parameter norm "
            f"{self.start_norm} at the start, from {source}), so no update can apply; stopped without saving; not "
            "a learning-rate problem: start from finite weights")
