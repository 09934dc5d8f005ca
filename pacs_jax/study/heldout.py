"""pass@k of a trainer's current policy on the study's held-out problems: n samples each through the trainer's own
rollout (`Trainer.current_policy`; conversations with the tool for the tool task), scored by the task's verifier,
pass@k by the project's unbiased estimator (`pacs_jax.eval.passk`)."""

from __future__ import annotations

import zlib

import numpy as np

from pacs_jax.data import prompts as prompts_lib
from pacs_jax.data import synthetic_tasks
from pacs_jax.eval import passk

OVERALL = "all"


# The tool task's held-out problems: distinct products drawn from their own stream. They are not kept out of training
# (a 30-step run draws 480 of the ~4,800 products): the tool computes the answer, so what pass@k measures is calling
# it and reading its output, not recall.
PRODUCTS_SEED = 7_919


def problems(task: synthetic_tasks.GradedSumTask | synthetic_tasks.ProductTask, count: int,
             terms: tuple[int, ...]) -> list[dict]:
  """The held-out problems (the same for every run and seed)."""
  if isinstance(task, synthetic_tasks.ProductTask):
    distinct = {r["problem"]: r for r in task.records(4 * count, seed=PRODUCTS_SEED)}
    return list(distinct.values())[:count]
  return task.held_out(count, seed=0, terms=terms)


def _prompts(trainer, records: list[dict]) -> tuple[list[list[int]], list[int]]:
  """The records' prompt token ids and their ids in the sampling randomness (from the problem text alone)."""
  prompt_ids = [ids.tolist() for ids in prompts_lib.encode_prompts(trainer.tokenizer, [r["problem"] for r in records],
                                                                  None)]
  return prompt_ids, [zlib.crc32(r["problem"].encode()) & 0x7FFFFFFF for r in records]


def correct_counts(trainer, records: list[dict], n: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
  """Correct samples out of `n` per problem [U] of the trainer's policy at its rollout temperature, and with the
  tool (`trainer.tools`) the samples per problem [U] that called it (else None); each problem's samples depend on
  (seed, problem text) alone."""
  if trainer.tools is not None:
    return _tool_counts(trainer, records, n, seed)
  task = synthetic_tasks.get_task(trainer.cfg.data.train)
  prompt_ids, seed_ids = _prompts(trainer, records)
  with trainer.current_policy() as sampler:
    completions = sampler.generate(prompt_ids, n=n, max_new_tokens=trainer.R, sampling=trainer.sampling, seed=seed,
                                   prompt_ids=seed_ids)
  counts = np.zeros(len(records), np.int64)
  for c in completions:
    text = trainer.tokenizer.decode(c.tokens, skip_special_tokens=True)
    counts[c.prompt_index] += int(task.score(text, records[c.prompt_index]["answer"]))
  return counts, None


def _tool_counts(trainer, records: list[dict], n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """`correct_counts` of conversations with the tool: each sample's episode reward (the run's scorer on its final
  turn), its sandbox opened for the evaluation and closed after."""
  from pacs_jax.rewards import pool

  cfg = trainer.cfg
  prompt_ids, seed_ids = _prompts(trainer, records)
  trainer.tools.open()
  try:
    with pool.RewardScorer(cfg.reward_workers, cfg.reward_timeout_s, score_fn=cfg.reward.fn) as scorer, \
        trainer.current_policy() as sampler:
      completions, _, episodes, _ = trainer.tools.scored(sampler, scorer, prompt_ids, records, n=n,
                                                         max_new_tokens=trainer.R, sampling=trainer.sampling,
                                                         seed=seed, seed_ids=seed_ids)
  finally:
    trainer.tools.close()
  counts, called = np.zeros(len(records), np.int64), np.zeros(len(records), np.int64)
  for c, e in zip(completions, episodes):
    counts[c.prompt_index] += int(e.reward > 0)
    called[c.prompt_index] += int(e.stats.tool_calls > 0)
  return counts, called


def pass_at_k(records: list[dict], counts: np.ndarray, n: int, by_terms: bool = True) -> dict[str, dict[int, float]]:
  """{OVERALL or "<k> terms": {k: mean pass@k}} over all problems and, `by_terms`, per number of terms."""
  groups = {OVERALL: list(counts)}
  for r, c in zip(records, counts if by_terms else ()):
    groups.setdefault(f"{synthetic_tasks.num_terms(r['problem'])} terms", []).append(c)
  return passk.pass_at_k_table(groups, n)
