"""math-verify scoring: agreement with the released semantics, worker pool, timeouts, dead workers."""

import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

from pacs_jax.rewards import math as reward_math

HANGING = "\\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate the power tower; verify never returns

MATRIX = "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"
# (response, ground truth, expected score)
PAIRS = [
    # fractions and decimals
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{0.3333333}", "\\frac13", 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\frac{7}{3}}", "\\frac{14}{3}", 0.0),
    ("\\boxed{27}", "27.0", 1.0),
    ("\\boxed{025}", "25", 1.0),
    ("\\boxed{25}", "025", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{10^{10}}", "10000000000", 1.0),
    # \frac / \dfrac / \tfrac
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\tfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\frac{14}{3}}", "\\frac{14}{3}", 1.0),
    ("The answer is \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{2}{3}", 0.0),
    # nested \boxed
    ("\\boxed{\\boxed{5}}", "5", 1.0),
    ("\\boxed{\\text{\\boxed{5}}}", "5", 1.0),
    ("So \\boxed{x = \\boxed{3}}", "3", 1.0),
    # several boxed answers
    ("First \\boxed{2}, finally \\boxed{3}", "3", 0.0),
    ("First \\boxed{2}, finally \\boxed{3}", "2", 0.0),
    ("\\boxed{2} and \\boxed{2}", "2", 1.0),
    # units
    ("\\boxed{10 \\text{ cm}}", "10", 1.0),
    ("\\boxed{5\\%}", "5", 1.0),
    ("\\boxed{45^\\circ}", "45", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{3 \\text{ meters}}", "4", 0.0),
    # intervals
    ("\\boxed{(1, 2]}", "(1,2]", 1.0),
    ("\\boxed{[1, 2)}", "(1,2]", 0.0),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", 1.0),
    ("\\boxed{(-\\infty, 0) \\cup (1, \\infty)}", "(-\\infty,0)\\cup(1,\\infty)", 1.0),
    ("\\boxed{x \\in [2, 5]}", "[2,5]", 1.0),
    # sets and tuples
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3, 2, 1\\}", 1.0),
    ("\\boxed{1, 2, 3}", "3, 2, 1", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2, 3\\}", 0.0),
    ("\\boxed{-2, 3}", "3, -2", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    # matrices
    ("\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}}", MATRIX, 1.0),
    ("\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}}", MATRIX, 0.0),
    ("\\boxed{\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{\\begin{bmatrix} 0.5 & 0 \\\\ 0 & 1 \\end{bmatrix}}",
     "\\begin{pmatrix} \\frac12 & 0 \\\\ 0 & 1 \\end{pmatrix}", 1.0),
    # symbolic answers
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    ("\\boxed{p - q}", "p - q", 1.0),
    ("\\boxed{q - p}", "p - q", 0.0),
    ("\\boxed{y = 2x + 3}", "2x+3", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{\\text{(C)}}", "C", 1.0),
    ("\\boxed{E}", "\\text{(E)}", 1.0),
    # wrong answers
    ("\\boxed{42}", "43", 0.0),
    ("The answer is 12.", "13", 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
    ("\\boxed{2\\pi}", "\\pi", 0.0),
    # no boxed answer
    ("The answer is 12.", "12", 1.0),
    ("Therefore the final answer is $\\frac{1}{2}$.", "\\frac12", 1.0),
    ("I think it's 7", "7", 1.0),
    ("x = 5", "5", 1.0),
    ("I have no idea.", "5", 0.0),
    # empty text, empty box, unparseable gold
    ("", "5", 0.0),
    ("   ", "0", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("\\boxed{5}", "", 0.0),
    ("\\boxed{5}", "\\text{}", 0.0),
    # answers with free symbols against numbers (the pairs `_cannot_be_equal` may skip): a constant in disguise still
    # verifies; words parse as products of letters (e: Euler's number)
    ("\\boxed{1}", "\\sin^2 x + \\cos^2 x", 1.0),
    ("\\boxed{1}", "(x+1)^2 - x^2 - 2x", 1.0),
    ("\\boxed{2}", "(x+1)^2 - x^2 - 2x", 0.0),
    ("\\boxed{5}", "x = 5", 1.0),
    ("\\boxed{x}", "x", 1.0),
    ("\\boxed{12}", "the quick brown fox", 0.0),
    ("\\boxed{the quick brown fox}", "the quick brown fox", 1.0),
    ("user mod 12 +", "Paris", 0.0),
    ("\\boxed{7}", "\\frac{1}{x}", 0.0),
    ("\\boxed{x + 1}", "1 + x", 1.0),
]


def released_compute_score(model_output: str, ground_truth: str) -> float:
  """verl's reward_score/math_verify.compute_score (used by the released PACS), run directly."""
  verify_func = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                            pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
  score = 0.0
  try:
    score, _ = verify_func(["\\boxed{" + ground_truth + "}"], [model_output])
  except Exception:  # noqa: BLE001
    pass
  return score


@pytest.fixture(scope="module")
def scorer():
  with reward_math.RewardScorer(num_workers=2, timeout_s=2.0) as s:
    s.start()
    yield s


def test_pairs_cover_the_required_cases():
  assert len(PAIRS) >= 50
  scores = [expected for _, _, expected in PAIRS]
  assert 15 <= scores.count(0.0) and 15 <= scores.count(1.0)


@pytest.mark.parametrize("response, ground_truth, expected", PAIRS)
def test_compute_score_agrees_with_direct_math_verify(response, ground_truth, expected):
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  assert reward_math.compute_score(response, ground_truth) == released_compute_score(response, ground_truth) == expected


def test_unparseable_gold_is_reported_as_an_error():
  assert reward_math.checked_score("\\boxed{5}", "")[1].startswith("no gold answer")
  assert reward_math.checked_score("\\boxed{5}", "5") == (1.0, None)
  assert reward_math.checked_score(None, "5")[0] == 0.0


def test_pool_scores_equal_compute_score(scorer):
  responses, answers, expected = zip(*PAIRS)
  scores, stats = scorer.score_batch(responses, answers, ["math_500"] * len(PAIRS))
  assert scores.dtype == np.float32
  np.testing.assert_array_equal(scores, expected)
  assert stats == {"errors": 2, "timeouts": 0}  # the two unparseable golds


def test_synthetic_sources_are_scored_here_without_workers():
  with reward_math.RewardScorer(num_workers=2) as fresh:
    scores, stats = fresh.score_batch(["4", "5", "user"], ["1", "1", "0"], ["synthetic/mod3"] * 3)
    assert fresh.worker_pids() == []
  np.testing.assert_array_equal(scores, [1.0, 0.0, 0.0])
  assert stats == {"errors": 0, "timeouts": 0}
  assert reward_math.score("synthetic/mod3", "4", "1") == 1.0 and reward_math.score("gsm8k", "\\boxed{4}", "4") == 1.0


def test_mixed_batch_keeps_order(scorer):
  scores, _ = scorer.score_batch(["\\boxed{3}", "7", "\\boxed{4}", "8"], ["3", "1", "5", "2"],
                                 ["math", "synthetic/mod3", "math", "synthetic/mod3"])
  np.testing.assert_array_equal(scores, [1.0, 1.0, 0.0, 1.0])


def test_hanging_input_hangs_math_verify_without_a_timeout():
  code = ("from math_verify import parse, verify, LatexExtractionConfig, ExprExtractionConfig\n"
          f"g = parse(r'\\boxed{{1}}', [LatexExtractionConfig()], parsing_timeout=None)\n"
          f"p = parse(r'{HANGING}', [ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=None)\n"
          "print(verify(g, p, timeout_seconds=None))\n")
  with pytest.raises(subprocess.TimeoutExpired):
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=4)


def test_hanging_item_times_out_and_the_next_batch_is_scored(scorer):
  pids = scorer.worker_pids()
  start = time.monotonic()
  scores, stats = scorer.score_batch([HANGING, "\\boxed{2}", "\\boxed{3}"], ["1", "2", "4"], ["math"] * 3)
  elapsed = time.monotonic() - start
  np.testing.assert_array_equal(scores, [0.0, 1.0, 0.0])
  assert stats == {"errors": 0, "timeouts": 1}
  assert elapsed < scorer.timeout_s + 1.0, elapsed
  assert len(set(scorer.worker_pids()) - set(pids)) == 1  # the hung worker was replaced

  responses, answers, expected = zip(*PAIRS[:20])
  scores, stats = scorer.score_batch(responses, answers, ["math"] * 20)
  np.testing.assert_array_equal(scores, expected)
  assert stats == {"errors": 0, "timeouts": 0}


def test_killed_workers_are_replaced(scorer):
  import os
  import signal

  # Both workers hang; kill them from outside before the timeout: their items are errors, not timeouts.
  scorer.start()  # both workers ready, so each takes one hanging item
  pids = scorer.worker_pids()
  killer = threading.Timer(0.5, lambda: [os.kill(pid, signal.SIGKILL) for pid in pids])
  scorer.timeout_s = 30.0  # so that a kill cannot be mistaken for a timeout
  try:
    killer.start()
    start = time.monotonic()
    scores, stats = scorer.score_batch([HANGING, HANGING, "\\boxed{6}"], ["1", "1", "6"], ["math"] * 3)
    killer.join()
  finally:
    scorer.timeout_s = 2.0
  np.testing.assert_array_equal(scores, [0.0, 0.0, 1.0])
  assert stats == {"errors": 2, "timeouts": 0}
  assert time.monotonic() - start < 25.0  # well below the 30 s timeout: the kills, not the timeout, ended them
  assert not set(scorer.worker_pids()) & set(pids)

  # A worker that dies while idle is replaced before it is given an item.
  scorer.start()
  os.kill(scorer.worker_pids()[0], signal.SIGKILL)
  time.sleep(0.2)
  scores, stats = scorer.score_batch(["\\boxed{1}", "\\boxed{2}"], ["1", "2"], ["math"] * 2)
  np.testing.assert_array_equal(scores, [1.0, 1.0])
  assert stats == {"errors": 0, "timeouts": 0}


def test_lengths_must_match(scorer):
  with pytest.raises(ValueError, match="lengths differ"):
    scorer.score_batch(["a"], [], ["math"])


# Answers math-verify parses into products of their letters, and demo-like responses (numbers and words).
WORD_ANSWERS = ["the quick brown fox", "Paris", "yes", "no answer", "red", "blue", "abc", "xyz"]
DEMO_RESPONSES = ["7 12 mod +", "user 3", "mod mod 41", "+ 9 assistant 30", "13", "system 2 2", "54 +", "0 mod 5"]


def test_words_against_numbers_skip_sympys_simplify(monkeypatch):
  """A word answer against a number: its value at a rational point differs from the number, so math-verify's
  `simplify` (0.1-3 s a pair) is never asked; the verdicts stay the released ones."""
  from math_verify import grader
  calls = []
  simplify = grader.simplify
  monkeypatch.setattr(grader, "simplify", lambda *a, **k: calls.append(a) or simplify(*a, **k))
  for answer in WORD_ANSWERS:
    for response in DEMO_RESPONSES:
      assert reward_math.checked_score(response, answer) == (0.0, None)
  assert calls == []
  assert reward_math.checked_score("\\boxed{1}", "\\sin^2 x + \\cos^2 x") == (1.0, None)  # still asked here
  assert calls


def test_a_batch_of_word_answers_costs_about_a_batch_of_numbers():
  """Issue 34: answers math-verify cannot parse as numbers made a demo step take 35-79 s instead of 0.1 s. Scoring
  64 demo-like responses against word answers costs at most about twice scoring them against numbers."""
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  reward_math.checked_score("\\boxed{1}", "ab")  # first use of the parsers and the point evaluation

  def seconds(answers):
    start = time.perf_counter()
    for answer in answers:
      for response in DEMO_RESPONSES:
        reward_math.checked_score(response, answer)
    return time.perf_counter() - start

  numbers = seconds([str(n) for n in range(20, 28)])
  words = seconds(WORD_ANSWERS)
  assert words <= 2 * numbers + 0.5, (words, numbers)
