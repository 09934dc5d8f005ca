"""DAPO's filler (issue 44): when dynamic sampling's rounds run out, the dropped groups that fill the batch carry
exactly zero gradient, the overlong penalty included (verl's recipe never trains on a dropped group), and the kept
groups' gradient is the one they would get alone; a step that kept no group warns in one line; the metrics give the
verifier's mean as `reward/mean` and the shaped rewards' as `reward/shaped_mean`.

The rollout is dynamic_sampling.sample's over a scripted pipeline, packed by stages.pack with DAPO's reward shaping
(no model): the gradient is the DAPO loss's with respect to the log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as registry
from pacs_jax.rollout.interface import Completion
from pacs_jax.trainer import dynamic_sampling, packing, stages

N, P, R, EOS = 4, 2, 4, 9


def config():
  cfg = config_lib.default_config()
  cfg.algorithm = "dapo"
  cfg.rollout.n = N
  cfg.rollout.max_new_tokens = R
  cfg.update_from_flattened_dict({"dapo.overlong_buffer_len": 2, "dapo.max_num_gen_batches": 1})
  config_lib.validate(cfg, 1)
  return registry.of(cfg).bind(cfg)


def rollout(verdicts: list[float], lengths: list[int], objective, empty=None):
  """One round of len(verdicts) // N prompts (responses of `lengths` tokens, the last one EOS), scored `verdicts`,
  through dynamic_sampling.sample and stages.pack as the loop runs them."""
  prompts = len(verdicts) // N
  element = {"prompt_ids": [np.array([1, 10 + p]) for p in range(prompts)], "answer": ["a"] * prompts,
             "data_source": ["src"] * prompts}

  def generate(global_prompts, seed):
    return [Completion(i, s, [5] * (lengths[i * N + s] - 1) + [EOS], np.full(lengths[i * N + s], -1.0, np.float32),
                       "eos") for i in range(len(global_prompts)) for s in range(N)]

  def score(element, completions):
    return stages.Scored([""] * len(completions), ["a"] * len(completions), ["src"] * len(completions),
                         np.asarray(verdicts, np.float32), {})

  prompt_ids, completions, scored, metrics = dynamic_sampling.sample(
      element, None, generate, score, objective.keep_groups, lambda tokens: "", n=N, P=P, max_rounds=1, seed=0,
      step=7, empty=empty)
  packed = stages.pack(prompt_ids, completions, scored, P=P, R=R, n=N, pad_id=0, mask_eos_ids=[EOS],
                       host_inputs=lambda ids, mask: {}, shape_rewards=objective.shape_rewards)
  return packed, metrics


def gradient(objective, packed, rows=None):
  """d loss / d log-probs [rows, R] of the DAPO loss over `rows` of the packed batch (all by default)."""
  rng = np.random.default_rng(0)
  old = rng.uniform(-2.0, -0.1, packed.loss_mask.shape).astype(np.float32)
  logprobs = old + rng.normal(0.0, 0.3, old.shape).astype(np.float32)  # ratios off 1: clipped and not
  rows = np.arange(old.shape[0]) if rows is None else rows
  micro = {"loss_mask": jnp.asarray(packed.loss_mask[rows]), "rewards": jnp.asarray(packed.rewards[rows]),
           "old_logprobs": jnp.asarray(old[rows])}
  logprobs = jnp.asarray(logprobs[rows])
  loss = lambda lp: objective.loss(lp, None, micro)[0]  # noqa: E731
  return np.asarray(jax.grad(loss)(logprobs))


def test_a_filler_group_gets_exactly_zero_gradient_with_the_length_penalty():
  objective = config()
  # Group 0 mixed (kept); group 1 all correct (dropped) but of lengths 2..4, so the overlong penalty (the last 2 of
  # 4 tokens) makes its shaped rewards differ: on main it had a non-zero advantage and trained on the penalty.
  packed, metrics = rollout([1, 0, 1, 0, 1, 1, 1, 1], [2, 2, 3, 2, 2, 3, 4, 4], objective)
  assert metrics["sampling/filler_groups"] == 1
  shaped = packed.rewards[N:]
  assert len(set(shaped.tolist())) > 1  # the penalty would give the dropped group an advantage
  g = gradient(objective, packed)
  assert np.all(g[N:] == 0.0)  # exactly: the filler is trained on by nothing
  assert np.any(g[:N] != 0.0)
  # The kept group's gradient is the one it gets without the filler (the token-mean counts only trained tokens).
  np.testing.assert_allclose(g[:N], gradient(objective, packed, np.arange(N)), rtol=1e-6, atol=0)


def test_a_step_that_kept_no_group_trains_on_nothing_and_warns_once(monkeypatch):
  objective = config()
  lines = []
  monkeypatch.setattr(dynamic_sampling.logging, "warning", lambda fmt, *args: lines.append(fmt % args))
  packed, metrics = rollout([1, 1, 1, 1, 0, 0, 0, 0], [2, 3, 4, 4, 4, 2, 3, 4], objective)
  assert metrics["sampling/kept_groups"] == 0 and metrics["sampling/filler_groups"] == 2
  assert np.all(gradient(objective, packed) == 0.0)
  assert lines == [dynamic_sampling.no_kept_group(7, 1, 2)] and "\n" not in lines[0]
  assert lines[0].startswith("step 7: dynamic sampling kept no group in 1 round(s)")
  # No group the loss sees differs, so the health check reads no "gradient 0 while rewards differ".
  assert packing.rollout_metrics(packed, {}, ["src"], N)["reward/mixed_groups"] == 0.0
  # The loop's run-long record (a solved task keeps no group on most steps): the first such step is said, once.
  lines.clear()
  empty = dynamic_sampling.EmptySteps()
  for _ in range(3):
    rollout([1, 1, 1, 1, 0, 0, 0, 0], [2, 3, 4, 4, 4, 2, 3, 4], objective, empty)
  assert lines == [dynamic_sampling.no_kept_group(7, 1, 2, once=True)] and empty.steps == 3


@pytest.mark.parametrize("name", ["dapo", "grpo", "pacs"])
def test_reward_is_the_verifiers_mean_and_a_shaped_reward_has_its_own_name(name):
  objective = config()
  packed, _ = rollout([1, 0, 1, 0, 1, 1, 1, 0], [4, 4, 4, 4, 2, 3, 4, 4], objective)
  if name != "dapo":  # the loop packs a non-shaping objective without shaping (`Objective.shapes_rewards`)
    assert not registry.get(name).shapes_rewards
    packed = dataclasses.replace(packed, rewards=packed.scores, scores=None)
  m = packing.rollout_metrics(packed, {}, ["src"], N)
  assert m["reward/mean"] == pytest.approx(5 / 8)  # the verifier's, not the penalised value
  if name == "dapo":
    assert registry.get(name).shapes_rewards
    assert m["reward/shaped_mean"] == pytest.approx(float(np.mean(packed.rewards)))
    assert m["reward/shaped_mean"] < m["reward/mean"]
  else:
    assert "reward/shaped_mean" not in m


def test_the_console_shows_the_shaped_reward_under_its_own_name():
  from pacs_jax.services import metrics as metrics_lib
  assert metrics_lib.CONSOLE_KEYS["reward/mean"] == "reward"
  assert metrics_lib.CONSOLE_KEYS["reward/shaped_mean"] == "shaped_reward"
