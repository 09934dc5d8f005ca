"""rollout.mode "one_step_off" and "async" (issue 33, acceptance 4): a run killed with SIGKILL mid-rollout and
mid-update and restarted trains on every prompt of the pipeline's order exactly once, checked by the prompts'
dataset ids in the rollout dumps, and logs each step's metrics row once. The rollouts in flight at a kill are
dropped; their prompts are drawn again after the resume (the checkpoint holds the data position before them).

A two-process (gloo) run in one_step_off matches one process.

Not bitwise: after a resume the first step samples synchronously (nothing in flight), with fresher weights than the
uninterrupted run's rollout had.
"""

import collections
import itertools
import json
import os
import random
import sys

import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.trainer import loop
from pacs_jax.services import metrics as metrics_lib
from tests import kill_loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
STEPS = 8
SETTINGS = {"steps": STEPS, "eval_every": 0, "checkpoint.every": 2, "train.batch_prompts": 8,
            "train.mini_batch_prompts": 4}
MODES = {"one_step_off": {"rollout.mode": "one_step_off", "rollout.max_staleness": 1},
         "async": {"rollout.mode": "async", "rollout.max_staleness": 2}}


def write_prompts(path) -> str:
  """Distinct problems of the synthetic mod-3 task (its built-in set repeats texts), so a text names its row."""
  with open(path, "w") as f:
    for a, b, c in itertools.islice(itertools.product(range(9), repeat=3), 0, 729, 7):
      f.write(json.dumps({"problem": f"{a} + {b} + {c} mod 3", "answer": str((a + b + c) % 3),
                          "data_source": "synthetic/mod3"}) + "\n")
  return str(path)


def settings(workdir, mode) -> dict:
  return {**SETTINGS, **MODES[mode], "rollout_data_dir": os.path.join(workdir, "rollouts"),
          "data.train": os.path.join(os.path.dirname(workdir), "prompts.jsonl")}


def trainer_cmd(workdir, mode):
  return [sys.executable, "-m", "pacs_jax.train", "--config", TINY, "--workdir", str(workdir),
          *[f"--config.{k}={v}" for k, v in settings(workdir, mode).items()]]


def env():
  return {**os.environ, "XLA_FLAGS": child_env.xla_flags(),
          "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": child_env.pythonpath(ROOT),
          "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer")}


def expected_prompt_ids(workdir, mode) -> tuple[list[collections.Counter], dict[str, int]]:
  """Each step's dataset ids (n responses each) in the pipeline's order, and each prompt text's id."""
  cfg = config_lib.load_config_file(TINY, settings(workdir, mode))
  reader = object.__new__(loop.Trainer)  # the trainer's inputs, read as it reads them, nothing built
  reader._read_inputs(cfg)
  it, per_step, id_of = reader.pipeline.iterator(), [], {}
  for step in range(2 * STEPS):  # later steps' texts too: a run that skips ahead fails on the counts
    element = next(it)
    texts = metrics_lib.prompt_texts(reader.tokenizer, [p.tolist() for p in element["prompt_ids"]],
                                     list(range(len(element["prompt_ids"]))))
    for text, index in zip(texts, element["index"].tolist()):
      assert id_of.setdefault(text, index) == index, f"rows {id_of[text]} and {index} share {text!r}"
    if step < STEPS:
      per_step.append(collections.Counter({index: cfg.rollout.n for index in element["index"].tolist()}))
  return per_step, id_of


def trained_prompt_ids(workdir, id_of) -> list[collections.Counter]:
  """Each step's dataset ids as its rollout dump (the step's last write) names them, one per response."""
  out = []
  for step in range(1, STEPS + 1):
    with open(os.path.join(workdir, "rollouts", f"{step}.jsonl")) as f:
      out.append(collections.Counter(id_of[json.loads(line)["input"]] for line in f if line.strip()))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_overlapped_run_trains_on_each_prompt_once(tmp_path, mode):
  rng = random.Random(33)
  write_prompts(tmp_path / "prompts.jsonl")
  straight = tmp_path / "straight"
  kill_loop.run_to_the_end(trainer_cmd(straight, mode), env())
  timing = {r["step"]: r for r in kill_loop.rows(straight)}
  workdir = tmp_path / "run"
  # Mid-rollout: as the row of step k appears, step k+1 waits for its rollout (in flight since an earlier step).
  # Mid-update: halfway through step k+1's update (by the uninterrupted run's timings), rollouts ahead in flight.
  k1, k2 = rng.randint(2, 3), rng.randint(4, 6)
  t = timing[k2 + 1]
  plan = [(k1, 0.0), (k2, t["timing/rollout_s"] + t["timing/reward_s"] + 0.5 * t["timing/update_s"])]
  for step, delay in plan:
    kill_loop.kill_when(trainer_cmd(workdir, mode), env(), kill_loop.logged(workdir, step), delay=delay)
    logged = [r["step"] for r in kill_loop.rows(workdir)]
    assert logged[-1] < STEPS, f"the kill came after the run ended: {logged}"
  out = kill_loop.run_to_the_end(trainer_cmd(workdir, mode), env())
  assert "resumed from step" in out
  assert [r["step"] for r in kill_loop.rows(workdir)] == list(range(1, STEPS + 1))  # each row once
  expected, id_of = expected_prompt_ids(workdir, mode)
  assert trained_prompt_ids(straight, id_of) == expected
  assert trained_prompt_ids(workdir, id_of) == expected  # no prompt lost or repeated, each in its step
  assert all(r["rollout/dropped"] == 0.0 for r in kill_loop.rows(workdir))


@pytest.mark.slow
def test_one_step_off_on_two_processes_matches_one(tmp_path):
  # Two gloo processes of one CPU device each against one process of two devices, as tests/test_multihost.py
  # runs them; one_step_off at staleness 1 (each rollout one version old) with the rollout correction.
  from tests import test_multihost as mh
  extra = ["--config.rollout.mode=one_step_off", "--config.rollout.max_staleness=1", "--config.algorithm=grpo",
           "--config.rollout.tis_imp_ratio_cap=2.0", "--config.steps=3"]
  one, two = tmp_path / "one", tmp_path / "two"
  mh.run_one(one, *extra)
  mh.run_two(two, *extra)
  for a, b in zip(mh.final_params(str(one), 3), mh.final_params(str(two), 3), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  rows_one, rows_two = mh.metrics(one), mh.metrics(two)
  assert [r["rollout/staleness_max"] for r in rows_one] == [r["rollout/staleness_max"] for r in rows_two] == [0, 1, 1]
  for a, b in zip(rows_one, rows_two, strict=True):
    assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
