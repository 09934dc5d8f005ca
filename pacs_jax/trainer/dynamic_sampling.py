"""Dynamic sampling (DAPO's filter_groups): a step keeps the prompt groups its algorithm keeps (`Algorithm.keep_groups`,
e.g. those whose verdicts differ) and draws rollouts of new prompts until it has `train.batch_prompts` of them or
its rounds run out (`Algorithm.sampling_rounds`); then it trains on the first `batch_prompts` kept groups, the
dropped ones filling what the last round left short. The batch always has `batch_prompts` groups, so the compiled
programs' shapes never change; a dropped group that fills it carries no loss (its responses' loss mask is 0), so it
gets exactly zero gradient whatever its shaped rewards (verl's recipe never trains on a dropped group).

Multi-host: every process runs each round's global rollout (so every process holds every completion), scores its
own share and learns the others' verdicts, answers and data sources by all-gathers; every process then makes the
same selection over the global groups, in global prompt order, and takes its contiguous share of it, exactly as
one process with the same global batch would. Every process draws the same number of rounds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np
from absl import logging

from pacs_jax.rollout import interface as rollout_interface
from pacs_jax.services import multihost
from pacs_jax.trainer import stages

Completion = rollout_interface.Completion


def round_seed(seed: int, round_index: int) -> int:
  """The sampling seed of a step's `round_index`-th rollout: the step's own for the first (as without dynamic
  sampling), one derived from it for each refill (the same seed would repeat the first round's draws)."""
  if round_index == 0:
    return seed
  return int(np.random.SeedSequence([seed, round_index]).generate_state(1)[0] % (2**31 - 1))


def select_groups(keeps: list[np.ndarray], batch_groups: int) -> tuple[list[tuple[int, int]], int]:
  """(round, group) pairs the batch trains on, from each round's [U] keep flags (groups in global prompt order):
  the first `batch_groups` kept ones in order; when fewer were kept (the rounds ran out), the dropped ones in order
  after them. Returns (pairs, how many are dropped ones: the filler)."""
  kept = [(r, int(g)) for r, keep in enumerate(keeps) for g in np.nonzero(keep)[0]]
  if len(kept) >= batch_groups:
    return kept[:batch_groups], 0
  dropped = [(r, int(g)) for r, keep in enumerate(keeps) for g in np.nonzero(~keep)[0]]
  filler = batch_groups - len(kept)
  return kept + dropped[:filler], filler


@dataclasses.dataclass
class Round:
  """One rollout of a step, seen globally: every process's prompts (processes in order) and completions (prompt-
  major, n per prompt), with each row's verdict, ground truth and data source."""
  prompts: list[list[int]]
  completions: list[Completion]
  scores: np.ndarray  # [rows] float32
  answers: list[str]
  data_sources: list[str]
  keep: np.ndarray  # [U] bool: the groups the algorithm keeps


def sample(first: dict[str, Any], draw: Callable[[], dict[str, Any]],
           generate: Callable[[list[list[int]], int], list[Completion]],
           score: Callable[[dict[str, Any], list[Completion]], stages.Scored],
           keep_groups: Callable[[np.ndarray], np.ndarray], decode: Callable[[list[int]], str], *, n: int, P: int,
           max_rounds: int, seed: int, step: int | None = None, empty: EmptySteps | None = None
           ) -> tuple[list[list[int]], list[Completion], stages.Scored, dict[str, float]]:
  """A step's dynamically sampled rollout: (this process's prompts, its completions (prompt indices into them),
  their `Scored`, the sampling metrics), as one plain rollout of the selected groups would give them, except that
  the filler (dropped groups) has loss mask 0 (`Completion.loss_mask`): no objective trains on it. A step that kept
  no group at all warns in one line (`step`: its number, for the line), once per run with the run's `empty`.

  `first`: the step's pipeline element; `draw()`: the next one (a refill); `generate(global prompts, seed)`: the
  global rollout; `score(element, completions)`: the verdicts of this process's completions of `element`;
  `keep_groups(global scores [rows]) -> [U]`; `decode(tokens)`: a response's text. `max_rounds` 0: no limit.
  """
  rounds: list[Round] = []
  stats: dict[str, int] = {}
  times = {"rollout": 0.0, "reward": 0.0}
  element = first
  while True:
    start = time.perf_counter()
    local_prompts = [ids.tolist() for ids in element["prompt_ids"]]
    prompts = multihost.gather_prompts(local_prompts, P)
    completions = generate(prompts, round_seed(seed, len(rounds)))
    times["rollout"] += time.perf_counter() - start
    start = time.perf_counter()
    offset = multihost.process_offset(len(local_prompts))
    local = [dataclasses.replace(c, prompt_index=c.prompt_index - offset) for c in completions
             if offset <= c.prompt_index < offset + len(local_prompts)]
    scored = score(element, local)
    for key, value in scored.stats.items():
      stats[key] = stats.get(key, 0) + value
    scores = multihost.gather_rows(np.asarray(scored.scores, np.float32))
    rounds.append(Round(prompts, completions, scores, multihost.gather_strings(scored.answers),
                        multihost.gather_strings(scored.data_sources), np.asarray(keep_groups(scores), bool)))
    times["reward"] += time.perf_counter() - start
    if sum(int(r.keep.sum()) for r in rounds) >= len(prompts) or len(rounds) == max_rounds:
      break
    element = draw()

  pairs, filler = select_groups([r.keep for r in rounds], len(prompts))
  if filler == len(pairs) and (empty is None or empty.first()):
    logging.warning("%s", no_kept_group(step, len(rounds), filler, once=empty is not None))
  share = len(pairs) // multihost.process_count()
  mine = pairs[multihost.process_offset(share):][:share]
  prompts, completions, rows = [], [], []
  for index, (r, g) in enumerate(mine):
    prompts.append(rounds[r].prompts[g])
    dropped = not rounds[r].keep[g]  # a filler group: trained on by nothing
    for row in range(g * n, (g + 1) * n):
      c = rounds[r].completions[row]
      if c.prompt_index != g:
        raise ValueError(f"round {r}: completion {row} belongs to prompt {c.prompt_index}, not {g} (not prompt-major)")
      untrained = {"loss_mask": np.zeros(len(c.tokens), np.float32)} if dropped else {}
      completions.append(dataclasses.replace(c, prompt_index=index, **untrained))
      rows.append((r, row))
  scored = stages.Scored(texts=[decode(c.tokens) for c in completions],
                         answers=[rounds[r].answers[row] for r, row in rows],
                         data_sources=[rounds[r].data_sources[row] for r, row in rows],
                         scores=np.asarray([rounds[r].scores[row] for r, row in rows], np.float32), stats=stats)
  metrics = {"sampling/rounds": float(len(rounds)),
             "sampling/kept_groups": float(sum(int(r.keep.sum()) for r in rounds)),
             "sampling/filler_groups": float(filler),
             # Every response the step sampled (the trained batch's `reward/mean` is biased towards mixed groups).
             "sampling/score_mean": float(np.mean(np.concatenate([r.scores for r in rounds]))),
             "timing/rollout_s": times["rollout"], "timing/reward_s": times["reward"]}
  return prompts, completions, scored, metrics


def no_kept_group(step: int | None, rounds: int, groups: int, once: bool = False) -> str:
  """The one line of a step whose rounds kept no group: its batch is all filler and carries no gradient."""
  where = f"step {step}" if step is not None else "a step"
  later = " (said once: `sampling/kept_groups` 0 marks every such step)" if once else ""
  return (f"{where}: dynamic sampling kept no group in {rounds} round(s) (every group's verdicts agree): its "
          f"{groups} dropped groups fill the batch and carry no gradient; use problems the model solves sometimes, "
          f"or more rounds (max_num_gen_batches){later}")


class EmptySteps:
  """A run's steps that kept no group: only the first is said (a solved task keeps none on most of its steps)."""

  def __init__(self):
    self.steps = 0

  def first(self) -> bool:
    """Counts one more such step; True for the run's first."""
    self.steps += 1
    return self.steps == 1
