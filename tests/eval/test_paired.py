"""The paired bootstrap of pass@k differences (pacs_jax/eval/paired.py) against hand-computed and brute-force cases."""

import itertools

import numpy as np
import pytest

from pacs_jax.eval import paired, passk


def test_pass_at_k_grid_is_the_unbiased_estimator_per_cell():
  correct = np.array([[0, 3, 8], [1, 8, 5]])
  grid = paired.pass_at_k_grid(correct, 8, 2)
  expected = [[passk.pass_at_k(8, c, 2) for c in row] for row in correct]
  np.testing.assert_array_equal(grid, expected)
  assert grid[0, 0] == 0.0 and grid[0, 2] == 1.0 and grid[1, 0] == pytest.approx(2 / 8)  # 1 - C(7,2)/C(8,2)
  with pytest.raises(ValueError, match="correct: a non-empty"):
    paired.pass_at_k_grid(np.array([1, 2]), 8, 1)


def test_resampled_means_by_brute_force():
  """Each replicate's mean over its drawn grid, by explicit loops over every drawn (seed, problem) pair."""
  rng = np.random.default_rng(3)
  diff = rng.normal(size=(3, 5))
  seed_index = rng.integers(0, 3, size=(7, 3))
  problem_index = rng.integers(0, 5, size=(7, 5))
  brute = [np.mean([diff[s, u] for s in seed_index[b] for u in problem_index[b]]) for b in range(7)]
  np.testing.assert_allclose(paired.resampled_means(diff, seed_index, problem_index), brute, rtol=1e-12)


def test_interval_of_a_hand_computed_case():
  """One seed, two problems, PACS solves one of them (pass@1 1 vs 0) and ties the other: the replicates' mean is 0,
  1/2 or 1 with probability 1/4, 1/2, 1/4, so the 95% interval is [0, 1]; the point difference is 1/2."""
  a = np.array([[4, 0]])  # [seeds, problems], n = 4
  b = np.array([[0, 0]])
  d = paired.paired_difference(a, b, 4, 1, replicates=4000)
  assert (d["diff"], d["low"], d["high"], d["resolved"]) == (0.5, 0.0, 1.0, False)
  # The exact bootstrap distribution: every draw of 2 problem indices, equally likely.
  exact = [np.mean([[1.0, 0.0][i] for i in draw]) for draw in itertools.product(range(2), repeat=2)]
  assert sorted(exact) == [0.0, 0.5, 0.5, 1.0]


def test_interval_matches_the_exact_bootstrap_distribution():
  """Two seeds × three problems: every one of the 2² × 3³ equally likely (seed draw, problem draw) pairs enumerated;
  the sampled interval's ends are the exact distribution's 2.5% and 97.5% points up to the sampling of replicates."""
  a = np.array([[3, 2, 4], [4, 1, 4]])
  b = np.array([[1, 2, 0], [2, 0, 3]])
  diff = paired.pass_at_k_grid(a, 4, 1) - paired.pass_at_k_grid(b, 4, 1)
  exact = np.sort([np.mean(diff[np.ix_(seeds, problems)]) for seeds in itertools.product(range(2), repeat=2)
                   for problems in itertools.product(range(3), repeat=3)])
  d = paired.paired_difference(a, b, 4, 1, replicates=20_000)
  assert d["diff"] == pytest.approx(diff.mean()) and d["resolved"]
  # The sampled 2.5% point lies between the exact distribution's 1.5% and 3.5% points, nine standard errors of
  # 20,000 replicates' empirical CDF away (likewise at 97.5%).
  def q(p):  # a value the distribution takes, as each replicate's mean is
    return np.quantile(exact, p, method="inverted_cdf")

  assert q(0.015) <= d["low"] <= q(0.035) and q(0.965) <= d["high"] <= q(0.985)
  assert q(0.015) < q(0.985)  # the check is not vacuous


def test_paired_means_the_same_indices_for_both_arms():
  """Two arms equal up to a constant shift: every replicate's difference is that shift (a seed or problem effect
  common to both arms cancels), so the interval is a point and resolved."""
  rng = np.random.default_rng(0)
  b = rng.integers(0, 5, size=(4, 30))
  a = b + 3  # n = 8: pass@1 higher by 3/8 in every cell
  d = paired.paired_difference(a, b, 8, 1)
  assert d["low"] == pytest.approx(3 / 8) and d["high"] == pytest.approx(3 / 8) and d["resolved"]


def test_deterministic_and_checked():
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 9, size=(3, 20)), rng.integers(0, 9, size=(3, 20))
  assert paired.paired_difference(a, b, 8, 2) == paired.paired_difference(a, b, 8, 2)
  with pytest.raises(ValueError, match="correct_b: the same"):
    paired.paired_difference(a, b[:2], 8, 1)
