"""Dynamic sampling (DAPO's filter_groups, trainer/dynamic_sampling.py): a step keeps the groups whose verdicts differ,
refills from new prompts until the batch is full or the rounds run out (then the dropped groups fill it), always
trains on train.batch_prompts groups, and says so in its metrics."""

import os

import jax
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.rewards import math as rewards_lib
from pacs_jax.rollout.interface import Completion
from pacs_jax.trainer import dynamic_sampling, loop, stages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 2


def test_select_groups_takes_the_first_kept_then_fills_with_the_dropped():
  keeps = [np.array([True, False, True, False]), np.array([False, True, False, False])]
  assert dynamic_sampling.select_groups(keeps, 2) == ([(0, 0), (0, 2)], 0)
  assert dynamic_sampling.select_groups(keeps, 3) == ([(0, 0), (0, 2), (1, 1)], 0)
  assert dynamic_sampling.select_groups(keeps, 4) == ([(0, 0), (0, 2), (1, 1), (0, 1)], 1)


def test_a_refill_round_draws_with_another_seed():
  assert dynamic_sampling.round_seed(123, 0) == 123  # the first round is the step's own rollout
  seeds = {dynamic_sampling.round_seed(123, r) for r in range(1, 20)}
  assert len(seeds) == 19 and 123 not in seeds and all(0 <= s < 2**31 - 1 for s in seeds)


def fake_pipeline(verdicts: list[list[float]]):
  """Elements of 2 prompts each (prompt ids [10 r + p]), and a verifier whose verdicts are `verdicts[round]` (n per
  prompt, prompt-major)."""
  elements = [{"prompt_ids": [np.array([10 * r + p]) for p in range(2)], "answer": [f"a{r}{p}" for p in range(2)],
               "data_source": ["src"] * 2} for r in range(len(verdicts))]
  seeds = []

  def generate(prompts, seed):
    seeds.append(seed)
    return [Completion(i, s, [prompts[i][0], s], np.zeros(2, np.float32), "eos")
            for i in range(len(prompts)) for s in range(N)]

  def score(element, completions):
    r = int(element["prompt_ids"][0][0]) // 10
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    return stages.Scored([""] * 4, [element["answer"][c.prompt_index] for c in completions], ["src"] * 4,
                         np.asarray(verdicts[r], np.float32), {"errors": 1})

  return elements, generate, score, seeds


@pytest.mark.parametrize("max_rounds, rounds, filler", [(0, 3, 0), (3, 3, 0), (2, 2, 1)])
def test_sample_refills_until_the_batch_is_full_or_the_rounds_run_out(max_rounds, rounds, filler):
  verdicts = [[1, 1, 0, 1], [0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 0, 1]]  # kept groups: round 0: p1; 1: none; 2: p0
  elements, generate, score, seeds = fake_pipeline(verdicts)
  drawn = iter(elements[1:])
  keep = lambda scores: np.asarray(scores).reshape(-1, N).std(-1) > 0  # noqa: E731
  prompts, completions, scored, metrics = dynamic_sampling.sample(
      elements[0], lambda: next(drawn), generate, score, keep, lambda tokens: f"t{tokens}", n=N, P=4,
      max_rounds=max_rounds, seed=7)
  assert metrics["sampling/rounds"] == rounds and metrics["sampling/filler_groups"] == filler
  assert seeds == [dynamic_sampling.round_seed(7, r) for r in range(rounds)]
  # The kept groups in order, then (rounds run out) the first dropped one.
  assert prompts == ([[1], [20]] if not filler else [[1], [0]])
  assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
  assert scored.answers == (["a01", "a01", "a20", "a20"] if not filler else ["a01", "a01", "a00", "a00"])
  np.testing.assert_array_equal(scored.scores, [0, 1, 1, 0] if not filler else [0, 1, 1, 1])
  assert scored.texts[0] == f"t{completions[0].tokens}" and scored.stats == {"errors": rounds}
  assert metrics["sampling/kept_groups"] == (2 if rounds == 3 else 1)
  assert metrics["sampling/score_mean"] == np.mean(verdicts[:rounds])


def tiny(algorithm, **overrides):
  base = {"steps": 2, "eval_every": 0, "rollout.n": N, "train.batch_prompts": 8, "train.mini_batch_prompts": 4,
          "checkpoint.async_save": False}
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {**base, **overrides})
  cfg.algorithm = algorithm
  return cfg


def test_dapo_trains_on_full_batches_of_mixed_groups(tmp_path):
  """n = 2 on the random model: about half the groups agree, so steps refill (and, capped at 2 rounds, fill)."""
  cfg = tiny("dapo", **{"dapo.max_num_gen_batches": 2, "dapo.overlong_buffer_len": 1})
  trainer = loop.Trainer(cfg, str(tmp_path), devices=jax.devices()[:1])
  rows, first = [], None
  with rewards_lib.RewardScorer(num_workers=1, timeout_s=10.0) as scorer:
    for _ in range(cfg.steps):
      element = next(trainer.data_iter)
      first = element["step"] if first is None else first
      rows.append(trainer.train_one_step(element, scorer))
  for row in rows:
    assert 1 <= row["sampling/rounds"] <= 2
    assert row["sampling/filler_groups"] == max(0, 8 - row["sampling/kept_groups"])
    assert np.isfinite(row["loss"]) and row["timing/reward_s"] > 0
  assert sum(r["sampling/rounds"] for r in rows) > cfg.steps  # it refilled
  drawn = next(trainer.data_iter)["step"] - first  # each refill is the pipeline's next element
  assert drawn == sum(r["sampling/rounds"] for r in rows)
  assert int(trainer.state.step) == 2
