"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), per problem
and averaged per data source, for k = 1, 2, 4, ... <= n."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Probability that at least one of k samples drawn without replacement from n is correct.

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

  with c correct samples out of n. The product form avoids the huge binomials (C(256, 128) ~ 1e75)
  and their cancellation; averaged over problems it is an unbiased estimate of pass@k.

  Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
  """
  n, c, k = int(n), int(c), int(k)
  if n < 1:
    raise ValueError(f"pass_at_k needs n >= 1 samples, got n={n}")
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
  if n - c < k:  # every k-subset must contain a correct sample
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def ks_up_to(n: int) -> list[int]:
  """The reported k values: powers of two 1, 2, 4, ... that are <= n (docs/algorithm.md)."""
  if n < 1:
    raise ValueError(f"ks_up_to needs n >= 1, got n={n}")
  return [1 << i for i in range(int(n).bit_length())]


def pass_at_k_table(correct_counts_by_source: Mapping[str, Sequence[int]], n: int) -> dict[str, dict[int, float]]:
  """Mean pass@k over each source's problems: {source: {k: mean_p pass_at_k(n, c_p, k)}}.

  `correct_counts_by_source[source][p]` is the number of correct samples (out of n) for problem p;
  every source gets every k in `ks_up_to(n)`.
  """
  table = {}
  for source, counts in correct_counts_by_source.items():
    if len(counts) == 0:
      raise ValueError(f"data source {source!r} has no problems")
    table[source] = {k: float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in ks_up_to(n)}
  return table
