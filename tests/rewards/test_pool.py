"""Rewards named "package.module:function" (rewards/named.py) and scored by the worker pool (rewards/pool.py): a
function of a test module runs in the workers, returning a score or a (score, error) pair; a name that names no
function says why."""

import os

import pytest

from pacs_jax.rewards import math as reward_math
from pacs_jax.rewards import named, pool


def test_a_named_reward_runs_in_the_workers_in_either_form():
  with pool.RewardScorer(num_workers=1, timeout_s=10.0, score_fn="custom_rewards:exact_or_why") as scorer:
    scores, stats = scorer.score_batch(["4", "5", "", "raise"], ["4"] * 4, ["my_problems"] * 4)
    assert scorer.worker_pids() and os.getpid() not in scorer.worker_pids()  # no `in_process`: all in the workers
  assert scores.tolist() == [1.0, 0.0, 0.0, 0.0]
  assert stats == {"errors": 2, "timeouts": 0}  # the (0.0, why) pair and the exception


@pytest.mark.parametrize("result, checked", [
    (1, (1.0, None)), (True, (1.0, None)), ((0.5, None), (0.5, None)), ((0.0, "why"), (0.0, "why")),
    ("high", (0.0, "ValueError: could not convert string to float: 'high'")),
])
def test_checked_call_takes_a_score_or_a_pair(result, checked):
  assert pool.checked_call(lambda *args: result, ("src", "response", "answer")) == checked


def test_the_builtin_is_named_as_any_other():
  assert named.resolve(named.BUILTIN) is reward_math.checked_score_for
  assert named.problem("pacs_jax.rewards.synthetic:compute_score") is None  # the synthetic verifier: a plain score


@pytest.mark.parametrize("name, why", [
    ("custom_rewards", 'must be "package.module:function"'),
    (":always_one", 'must be "package.module:function"'),
    ("no_such_module_here:score", "cannot import 'no_such_module_here' (ModuleNotFoundError"),
    ("custom_rewards:missing", "module 'custom_rewards' has no 'missing'"),
    ("custom_rewards:NOT_A_FUNCTION", "'custom_rewards:NOT_A_FUNCTION' is not callable (a value of type int)"),
])
def test_a_name_that_names_no_function_says_why(name, why):
  assert named.problem(name).startswith(why), named.problem(name)
  with pytest.raises(ValueError, match=f"^reward {name!r}: "):
    named.resolve(name)
