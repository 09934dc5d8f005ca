"""Scores per second of the math-verify reward: RewardScorer's worker pool vs one in-process loop.

  python benchmarks/reward_throughput.py [--num_workers=2] [--num_items=2000]
"""

import time

import numpy as np
from absl import app, flags

from pacs_jax.rewards import math as reward_math

_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "Reward worker processes.")
_NUM_ITEMS = flags.DEFINE_integer("num_items", 2000, "Responses scored by the pool.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 10.0, "Per-item timeout.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated responses.")

# Final answers in the forms MATH-style responses use, with a gold answer each; half are wrong.
_ANSWERS = [("\\frac{14}{3}", "\\frac{14}{3}"), ("0.5", "\\frac{1}{2}"), ("204", "204"), ("3\\sqrt{2}", "\\sqrt{18}"),
            ("(1, 2]", "(1,2]"), ("\\{1, 2\\}", "\\{2, 1\\}"), ("x^2+1", "1+x^2"), ("45^\\circ", "45"),
            ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
            ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)")]
_WRONG = ["7", "\\frac{13}{3}", "2\\sqrt{3}", "(1, 2)", "x^2-1"]


def make_items(n, seed):
  rng = np.random.default_rng(seed)
  reasoning = ("Let us compute step by step. We have $a + b = 12$ and $ab = 35$, so $a$ and $b$ are the roots "
               "of $t^2 - 12t + 35 = 0$, that is $t = 5$ or $t = 7$. ") * 8  # ~1.3k characters of working
  responses, answers = [], []
  for _ in range(n):
    predicted, gold = _ANSWERS[rng.integers(len(_ANSWERS))]
    if rng.random() < 0.5:
      predicted = _WRONG[rng.integers(len(_WRONG))]
    responses.append(f"{reasoning}Therefore the final answer is $\\boxed{{{predicted}}}$.")
    answers.append(gold)
  return responses, answers


def main(argv):
  del argv
  responses, answers = make_items(_NUM_ITEMS.value, _SEED.value)
  serial_n = min(200, len(responses))
  reward_math.compute_score(responses[0], answers[0])  # first-call set-up is not throughput
  start = time.perf_counter()
  for response, answer in zip(responses[:serial_n], answers[:serial_n]):
    reward_math.compute_score(response, answer)
  serial_rate = serial_n / (time.perf_counter() - start)

  with reward_math.RewardScorer(num_workers=_NUM_WORKERS.value, timeout_s=_TIMEOUT_S.value) as scorer:
    start = time.perf_counter()
    scorer.start()
    scorer.score_batch(responses[:8], answers[:8], ["math"] * 8)  # workers up and warm
    warm_up_s = time.perf_counter() - start
    start = time.perf_counter()
    scores, stats = scorer.score_batch(responses, answers, ["math"] * len(responses))
    pool_s = time.perf_counter() - start
  print(f"in-process, 1 thread: {serial_rate:8.1f} scores/s ({serial_n} items)")
  print(f"pool, {_NUM_WORKERS.value} workers:    {len(responses) / pool_s:8.1f} scores/s ({len(responses)} items, "
        f"{pool_s:.2f} s; start-up {warm_up_s:.2f} s; mean score {scores.mean():.3f}; {stats})")


if __name__ == "__main__":
  app.run(main)
