"""rollout.mode "one_step_off" and "async" (issue 33 acceptance 4, issue 44 acceptance 1): a run killed with SIGKILL
and stopped with SIGTERM, each mid-rollout and mid-update, and restarted each time ends bitwise equal to the
uninterrupted run: metrics rows (timings aside), rollout dumps and final parameters. A checkpoint keeps the rollouts
in flight (each one's policy version and seed, and the weights of each version), and a resume starts them again on
the same pipeline elements, so the steps after it sample what the uninterrupted run's did. Each step trains on its
prompts of the pipeline's order exactly once, checked by the prompts' dataset ids in the rollout dumps.

A two-process (gloo) run in one_step_off matches one process.
"""

import collections
import itertools
import json
import os
import random
import signal
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax.services import metrics as metrics_lib
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import loop
from tests import kill_loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
STEPS = 10
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


def final_params(workdir) -> list[np.ndarray]:
  model, step = export_lib.load_policy(str(workdir))
  assert step == STEPS
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def without_timings(rows) -> list[dict]:
  return [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/"))} for r in rows]


def dumps(workdir) -> list[bytes]:
  out = []
  for step in range(1, STEPS + 1):
    with open(os.path.join(workdir, "rollouts", f"{step}.jsonl"), "rb") as f:
      out.append(f.read())
  return out


def stop(cmd, how, moment, delay) -> None:
  """Starts `cmd`, waits for `moment` and `delay` seconds, then SIGKILL (no handler: the run resumes from its last
  periodic checkpoint) or SIGTERM (preemption: it ends the step, saves it with the rollouts in flight, and exits 0)."""
  if how == "kill":
    kill_loop.kill_when(cmd, env(), moment, delay=delay)
    return
  proc = kill_loop.start(cmd, env())
  kill_loop.wait_for(moment, proc)
  time.sleep(delay)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0 and "preempted: saved step" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_stopped_overlapped_run_resumes_bitwise(tmp_path, mode):
  rng = random.Random(44)
  write_prompts(tmp_path / "prompts.jsonl")
  straight = tmp_path / "straight"
  kill_loop.run_to_the_end(trainer_cmd(straight, mode), env())
  timing = {r["step"]: r for r in kill_loop.rows(straight)}
  workdir = tmp_path / "run"
  # Mid-rollout: as the row of step k appears, step k+1 waits for its rollout (in flight since an earlier step).
  # Mid-update: halfway through step k+1's update (by the uninterrupted run's timings), rollouts ahead in flight.
  mid_update = lambda k: (timing[k + 1]["timing/rollout_s"] + timing[k + 1]["timing/reward_s"]
                          + 0.5 * timing[k + 1]["timing/update_s"])
  plan = [("kill", k, 0.0) for k in [rng.randint(2, 3)]] + [("term", k, mid_update(k)) for k in [rng.randint(4, 5)]]
  plan += [("term", k, 0.0) for k in [rng.randint(6, 7)]] + [("kill", k, mid_update(k)) for k in [8]]
  for how, step, delay in plan:
    # A row this process writes: a stop that came late may have logged the step already (a loaded machine), and a
    # signal before the new process's first row would find no handler installed yet.
    after = max([step - 1] + [r["step"] for r in kill_loop.rows(workdir)])
    stop(trainer_cmd(workdir, mode), how, kill_loop.logged(workdir, after + 1), delay)
    logged = [r["step"] for r in kill_loop.rows(workdir)]
    assert logged[-1] < STEPS, f"the stop came after the run ended: {logged}"
  out = kill_loop.run_to_the_end(trainer_cmd(workdir, mode), env())
  assert "resumed from step" in out
  assert [r["step"] for r in kill_loop.rows(workdir)] == list(range(1, STEPS + 1))  # each row once
  assert without_timings(kill_loop.rows(workdir)) == without_timings(kill_loop.rows(straight))
  assert dumps(workdir) == dumps(straight)
  for a, b in zip(final_params(workdir), final_params(straight), strict=True):
    np.testing.assert_array_equal(a, b)
  expected, id_of = expected_prompt_ids(workdir, mode)
  assert trained_prompt_ids(workdir, id_of) == expected  # no prompt lost or repeated, each in its step
  assert all(r["rollout/dropped"] == 0.0 for r in kill_loop.rows(workdir))
  staleness = [r["rollout/staleness_max"] for r in kill_loop.rows(workdir)]
  assert staleness == [min(step - 1, MODES[mode]["rollout.max_staleness"]) for step in range(1, STEPS + 1)]


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
