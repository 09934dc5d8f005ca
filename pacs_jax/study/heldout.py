"""pass@k of a trainer's current policy on the study's held-out problems: n samples each through the trainer's own
rollout (`Trainer.current_policy`), scored by the task's verifier, pass@k by the project's unbiased estimator
(`pacs_jax.eval.passk`)."""

from __future__ import annotations

import zlib

import numpy as np

from pacs_jax.data import prompts as prompts_lib
from pacs_jax.data import synthetic_tasks
from pacs_jax.eval import passk

OVERALL = "all"


def problems(task: synthetic_tasks.GradedSumTask, count: int, terms: tuple[int, ...]) -> list[dict]:
  """The held-out problems (the same for every run and seed)."""
  return task.held_out(count, seed=0, terms=terms)


def correct_counts(trainer, records: list[dict], n: int, seed: int) -> np.ndarray:
  """Correct samples out of `n` per problem [U] of the trainer's policy at its rollout temperature; each problem's
  samples depend on (seed, problem text) alone."""
  task = synthetic_tasks.get_task(trainer.cfg.data.train)
  prompt_ids = [ids.tolist() for ids in prompts_lib.encode_prompts(trainer.tokenizer, [r["problem"] for r in records],
                                                                  None)]
  with trainer.current_policy() as sampler:
    completions = sampler.generate(prompt_ids, n=n, max_new_tokens=trainer.R, sampling=trainer.sampling, seed=seed,
                                   prompt_ids=[zlib.crc32(r["problem"].encode()) & 0x7FFFFFFF for r in records])
  counts = np.zeros(len(records), np.int64)
  for c in completions:
    text = trainer.tokenizer.decode(c.tokens, skip_special_tokens=True)
    counts[c.prompt_index] += int(task.score(text, records[c.prompt_index]["answer"]))
  return counts


def pass_at_k(records: list[dict], counts: np.ndarray, n: int) -> dict[str, dict[int, float]]:
  """{OVERALL or "<k> terms": {k: mean pass@k}} over all problems and per number of terms."""
  groups = {OVERALL: list(counts)}
  for r, c in zip(records, counts):
    groups.setdefault(f"{synthetic_tasks.num_terms(r['problem'])} terms", []).append(c)
  return passk.pass_at_k_table(groups, n)
