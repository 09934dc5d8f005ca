"""The built-in reward: math-verify scoring with the released semantics (`checked_score_for`, the config's default
`reward.fn`), which the worker pool (rewards/pool.py) runs with a per-item timeout."""

from __future__ import annotations

import functools
import itertools
import logging
from typing import TYPE_CHECKING

from pacs_jax.rewards import synthetic
from pacs_jax.rewards.pool import RewardScorer  # noqa: F401 -- re-exported: callers name it here, where it lived

if TYPE_CHECKING:
  import sympy

# math-verify and sympy load on first use (half a second of imports): a run whose problems are all synthetic, scored
# in the calling process (`in_process` below), never loads them; the worker pool's processes preload them (`preload`).


@functools.cache
def _targets() -> tuple[tuple, tuple]:
  """math-verify's extraction targets: the gold answer's (LaTeX) and the response's (expression, then LaTeX)."""
  from math_verify import ExprExtractionConfig, LatexExtractionConfig
  return (LatexExtractionConfig(),), (ExprExtractionConfig(), LatexExtractionConfig())


class _TimeoutDisabledFilter(logging.Filter):
  """Drops math-verify's "Timeout is disabled" warning: timeouts are enforced by RewardScorer (rewards/pool.py)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).addFilter(_TimeoutDisabledFilter())


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str) -> tuple:
  """The gold answer's extractions, parsed once per answer (a prompt's n responses share it)."""
  from math_verify import parse
  return tuple(parse("\\boxed{" + ground_truth + "}", _targets()[0], parsing_timeout=None))


@functools.lru_cache(maxsize=4096)
def _value_at_a_point(expr: sympy.Expr) -> sympy.Expr | None:
  """`expr` with each free symbol replaced by a fixed rational (distinct, non-integer), or None if it is no number
  then (a pole, a function left unevaluated with a symbol)."""
  import sympy
  point = {s: sympy.Rational(1009 + 37 * i, 113 + 7 * i) for i, s in enumerate(sorted(expr.free_symbols, key=str))}
  value = expr.subs(point)
  return value if value.is_number and not value.free_symbols else None


def _cannot_be_equal(gold, pred) -> bool:
  """True when math-verify's comparison of this pair (`sympy_expr_eq`) can only say no, without running it: one is
  an exact number, the other an expression of free symbols (no relation, set, lone symbol or matrix: e.g. a word
  in the answer, parsed as a product of its letters) whose value at a rational point provably differs from it. Then
  gold - pred is not identically 0, so neither the structural, numeric nor symbolic (`simplify`: 0.1-3 s a pair)
  test can succeed. False means: ask math-verify."""
  import sympy
  for number, expr in ((gold, pred), (pred, gold)):
    if (isinstance(number, sympy.Number) and not isinstance(number, sympy.Float) and isinstance(expr, sympy.Expr)
        and not isinstance(expr, (sympy.Symbol, sympy.MatrixExpr)) and expr.free_symbols and not expr.has(sympy.Float)):
      value = _value_at_a_point(expr)
      return value is not None and (value - number).is_zero is False  # (None: sympy cannot tell)
  return False


def verify_pairs(gold, pred) -> bool:
  """math-verify's `verify(gold, pred)` at 6 decimals (true if any gold extraction equals any predicted one), each
  pair compared as `verify` does, but pairs that `_cannot_be_equal` skipped."""
  from math_verify import verify
  return any(not _cannot_be_equal(g, p) and verify(g, p, float_rounding=6, timeout_seconds=None)
             for g, p in itertools.product(gold, pred))


def checked_score(solution_str: str, ground_truth: str) -> tuple[float, str | None]:
  """(score, error message or None); `compute_score` with its errors reported instead of hidden."""
  try:
    if not isinstance(solution_str, str) or not isinstance(ground_truth, str):
      raise TypeError(f"expected str, got {type(solution_str).__name__} and {type(ground_truth).__name__}")
    # math-verify's own timeouts use signal.alarm (main thread only, whole seconds); they are off
    # here and RewardScorer enforces the timeout by killing the worker instead.
    gold = _parse_gold(ground_truth)
    if not gold:  # math_metric raises here, which the released compute_score turns into 0.0
      return 0.0, f"no gold answer could be parsed from {ground_truth!r:.100}"
    from math_verify import parse
    pred = parse(solution_str, _targets()[1], parsing_timeout=None)
    return (1.0 if verify_pairs(gold, pred) else 0.0), None
  except Exception as e:  # noqa: BLE001 -- any parser failure scores 0.0, as released
    return 0.0, f"{type(e).__name__}: {e}"[:500]


def compute_score(solution_str: str, ground_truth: str) -> float:
  """1.0 when the response verifies equal to `\\boxed{ground_truth}`, else 0.0 (errors too).

  The released semantics (verl `reward_score/math_verify.py`, math_metric): gold parsed with LaTeX
  extraction, the response with expression + LaTeX extraction, `verify` at 6 decimals. It has no
  timeout of its own: score untrusted text through `RewardScorer`.
  """
  return checked_score(solution_str, ground_truth)[0]


def checked_score_for(data_source: str, solution_str: str, ground_truth: str) -> tuple[float, str | None]:
  """Dispatch by data source: built-in synthetic tasks use their own verifier, all else math-verify."""
  if synthetic.is_synthetic(data_source):
    try:
      return synthetic.compute_score(data_source, solution_str, ground_truth), None
    except Exception as e:  # noqa: BLE001
      return 0.0, f"{type(e).__name__}: {e}"[:500]
  return checked_score(solution_str, ground_truth)


# What the worker pool reads of a reward function (rewards/pool.py): the data sources it scores in the calling
# process (the synthetic tasks: cheap and trusted), the modules its workers' server imports first, and the items
# each new worker scores before it takes any, so that first-use set-up of the parsers (~0.1 s per kind of
# expression) does not count against an item's timeout.
checked_score_for.in_process = synthetic.is_synthetic
checked_score_for.preload = ("sympy", "math_verify")
checked_score_for.warm_up = tuple(("math", response, answer) for response, answer in (
    ("\\boxed{\\frac{1}{2}}", "0.5"), ("$x \\in (1, 2]$", "(1,2]"), ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}"),
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("The answer is 3\\sqrt{2}.", "\\sqrt{18}"), ("\\boxed{45^\\circ}", "45")))


def score(data_source: str, solution_str: str, ground_truth: str) -> float:
  """`compute_score` dispatched by data source (verl's `default_compute_score` role)."""
  return checked_score_for(data_source, solution_str, ground_truth)[0]
