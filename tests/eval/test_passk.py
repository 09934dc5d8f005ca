"""pass@k against a brute-force average over all k-subsets, exact binomials, and edge cases."""

import itertools
import math
from fractions import Fraction

import pytest

from pacs_jax.eval.passk import ks_up_to, pass_at_k, pass_at_k_table


def brute_force_pass_at_k(n, c, k):
  # Samples 0..c-1 are the correct ones; pass@k is the share of k-subsets holding any of them.
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_equals_brute_force_over_all_k_subsets(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("n", [16, 100, 256])
def test_stable_for_large_n_against_exact_binomials(n):
  for c in [1, 2, 3, n // 4, n // 2, n - 1]:
    for k in ks_up_to(n):
      exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
      assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_edge_cases():
  for n in [1, 2, 7, 32, 256]:
    for k in range(1, n + 1):
      assert pass_at_k(n, 0, k) == 0.0
      assert pass_at_k(n, n, k) == 1.0
    assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)
    assert pass_at_k(n, 1, n) == 1.0


def test_pass_at_1_is_the_fraction_correct():
  for n in range(1, 20):
    for c in range(n + 1):
      assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_monotone_in_k_and_c():
  n = 32
  for c in range(n + 1):
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))
  for k in [1, 4, 16]:
    values = [pass_at_k(n, c, k) for c in range(n + 1)]
    assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("n, c, k", [(4, 0, 5), (4, 5, 1), (4, -1, 1), (4, 1, 0), (0, 0, 1)])
def test_invalid_arguments_raise(n, c, k):
  with pytest.raises(ValueError):
    pass_at_k(n, c, k)


def test_ks_up_to():
  assert ks_up_to(1) == [1]
  assert ks_up_to(2) == [1, 2]
  assert ks_up_to(7) == [1, 2, 4]
  assert ks_up_to(8) == [1, 2, 4, 8]
  assert ks_up_to(32) == [1, 2, 4, 8, 16, 32]
  assert ks_up_to(256) == [2**i for i in range(9)]
  assert ks_up_to(300) == [2**i for i in range(9)]
  with pytest.raises(ValueError):
    ks_up_to(0)


def test_table_has_every_k_for_every_source_and_averages_problems():
  n = 8
  counts = {"math500": [0, 8, 4], "aime2024": [0, 0], "amc23": [1], "aime2025": [8, 8]}
  table = pass_at_k_table(counts, n)
  assert set(table) == set(counts)
  for source, by_k in table.items():
    assert list(by_k) == [1, 2, 4, 8]
    for k, value in by_k.items():
      expected = sum(brute_force_pass_at_k(n, c, k) for c in counts[source]) / len(counts[source])
      assert value == pytest.approx(expected, rel=1e-12, abs=1e-15)
  assert table["aime2024"] == {1: 0.0, 2: 0.0, 4: 0.0, 8: 0.0}
  assert table["aime2025"] == {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
  assert table["math500"][1] == pytest.approx((0 + 1 + 0.5) / 3)


def test_table_rejects_bad_counts():
  with pytest.raises(ValueError):
    pass_at_k_table({"math500": []}, 4)
  with pytest.raises(ValueError):
    pass_at_k_table({"math500": [5]}, 4)
