"""The difference of two methods' pass@k with a paired-bootstrap interval over seeds and problems (the laptop study's
ranking, docs/study.md).

Both methods are trained with the same S seeds and evaluated on the same U problems; `correct[s, u]` counts the
correct samples out of n of seed s's trained model on problem u. A bootstrap replicate draws S seeds and U problems
with replacement, the same indices for both methods, and takes the mean over that grid of the per-cell difference
of the unbiased pass@k (`passk.pass_at_k`); the interval is the replicates' percentile interval.
"""

from __future__ import annotations

import numpy as np

from pacs_jax.eval import passk

BOOTSTRAP_SEED = 0  # fixed: the same counts give the same interval, bit for bit
REPLICATES = 10_000
LEVEL = 0.95


def pass_at_k_grid(correct: np.ndarray, n: int, k: int) -> np.ndarray:
  """[S, U] correct counts out of n -> [S, U] unbiased pass@k of each cell (looked up per count 0 ... n)."""
  correct = np.asarray(correct)
  if correct.ndim != 2 or correct.size == 0:
    raise ValueError(f"correct: a non-empty [seeds, problems] array of counts, got shape {correct.shape}")
  table = np.array([passk.pass_at_k(n, c, k) for c in range(n + 1)])  # [n + 1]
  return table[correct]


def resampled_means(diff: np.ndarray, seed_index: np.ndarray, problem_index: np.ndarray) -> np.ndarray:
  """[B] the mean of `diff` [S, U] over each replicate's grid of drawn seeds [B, S] × drawn problems [B, U]:

    mean_{i, j} diff[seed_index[b, i], problem_index[b, j]] = c_s[b] · diff · c_u[b] / (S U)

  with c_s[b] [S] and c_u[b] [U] how often each seed and problem was drawn."""
  S, U = diff.shape
  replicates = np.arange(seed_index.shape[0])[:, None]
  seed_counts = np.zeros((seed_index.shape[0], S))
  np.add.at(seed_counts, (replicates, seed_index), 1.0)  # [B, S]
  problem_counts = np.zeros((problem_index.shape[0], U))
  np.add.at(problem_counts, (replicates, problem_index), 1.0)  # [B, U]
  return np.einsum("bs,su,bu->b", seed_counts, diff, problem_counts) / (S * U)


def paired_difference(correct_a: np.ndarray, correct_b: np.ndarray, n: int, k: int, *,
                      replicates: int = REPLICATES, seed: int = BOOTSTRAP_SEED, level: float = LEVEL) -> dict:
  """pass@k of method a minus method b, with a `level` paired-bootstrap percentile interval.

  correct_a, correct_b: [S, U] correct counts out of n, row s of both from seed s, column u the same problem.
  Returns {"diff": mean_{s,u} (pass@k_a − pass@k_b), "low", "high", "resolved": the interval excludes 0}.
  """
  a, b = np.asarray(correct_a), np.asarray(correct_b)
  if a.shape != b.shape:
    raise ValueError(f"correct_b: the same [seeds, problems] as correct_a {a.shape}, got {b.shape}")
  diff = pass_at_k_grid(a, n, k) - pass_at_k_grid(b, n, k)  # [S, U]
  S, U = diff.shape
  rng = np.random.default_rng(seed)
  seed_index = rng.integers(0, S, size=(replicates, S))  # [B, S]
  problem_index = rng.integers(0, U, size=(replicates, U))  # [B, U]
  means = resampled_means(diff, seed_index, problem_index)  # [B]
  low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
  return {"diff": float(diff.mean()), "low": float(low), "high": float(high),
          "resolved": bool(low > 0 or high < 0)}
