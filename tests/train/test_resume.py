"""Faults at random moments: a run killed with SIGKILL (mid-step, mid-save, mid-validation, before the first
checkpoint) or stopped with SIGTERM (preemption) and restarted each time ends bitwise equal to an uninterrupted
run, parameters and metrics rows (timings aside), with no row duplicated or cut off.

The runs train packed (`train.packing`, as every released config does; issue 42): the packed path resumes bitwise
too. The padded path's are killed and checked bitwise in test_lora_resume.py (one path for full and LoRA runs) and
test_overlap_resume.py.

The kill moments come from a seeded generator: a failure reproduces with the same moments (up to timing).
"""

import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax.storage import hf_export as export_lib
from tests import kill_loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMING_PREFIXES = ("timing/", "throughput/")
STEPS = 20
# A tiny_cpu run: validation every 5 steps and a checkpoint every 3, so kills land in both.
ARGS = [f"--config.steps={STEPS}", "--config.eval_every=5", "--config.checkpoint.every=3",
        "--config.train.batch_prompts=8", "--config.train.mini_batch_prompts=4", "--config.data.synthetic_val_size=8",
        "--config.train.packing=True"]


def trainer_cmd(workdir, *extra):
  return [sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", "tiny_cpu.py"),
          "--workdir", str(workdir), *ARGS, *extra]


def env():
  e = dict(os.environ)
  e["XLA_FLAGS"] = child_env.xla_flags()  # one CPU device, as the config's mesh asks
  e["JAX_PLATFORMS"] = "cpu"
  e["PYTHONUNBUFFERED"] = "1"
  # Runs after the first reuse its compiled programs (as a restarted job would).
  e["PACS_JAX_COMPILATION_CACHE"] = os.path.join(ROOT, ".jax_cache", "trainer")
  return e


def start(workdir) -> subprocess.Popen:
  return kill_loop.start(trainer_cmd(workdir), env())


def rows(workdir):
  return kill_loop.rows(workdir)


def without_timings(logged):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in logged]


def final_params(workdir):
  model, step = export_lib.load_policy(str(workdir))
  assert step == STEPS
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def run_to_the_end(workdir) -> str:
  return kill_loop.run_to_the_end(trainer_cmd(workdir), env())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("straight")
  run_to_the_end(workdir)
  return rows(workdir), final_params(workdir)


def assert_same_as_uninterrupted(workdir, uninterrupted):
  expected_rows, expected_params = uninterrupted
  got = rows(workdir)
  assert [r["step"] for r in got] == list(range(STEPS + 1))  # each step once, step 0 included
  assert without_timings(got) == without_timings(expected_rows)
  with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
    assert f.read().endswith(b"}\n")
  for a, b in zip(final_params(workdir), expected_params):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(tmp_path, uninterrupted):
  rng = random.Random(1234)
  workdir = tmp_path / "run"
  # (what to wait for, then a random extra delay): before the first checkpoint, mid-save, and later steps.
  plan = [("row", 0, rng.uniform(0.0, 0.05)), ("save", rng.randint(4, 8), 0.0),
          ("row", rng.randint(9, 12), rng.uniform(0.0, 0.6)), ("row", rng.randint(13, 17), rng.uniform(0.0, 0.6))]
  for i, (event, step, delay) in enumerate(plan):
    moments = [kill_loop.logged(workdir, step)] + ([lambda: kill_loop.saving(workdir)] if event == "save" else [])
    kill_loop.kill_when(trainer_cmd(workdir), env(), *moments, delay=delay)
    if event == "save":
      assert kill_loop.saving(workdir), "the kill should have caught a save in flight"
    if i == 0:  # rows logged, no checkpoint yet: the restart begins anew and must not log step 0 twice
      assert not [name for name in os.listdir(workdir / "checkpoints") if name.isdigit()]
    if i == 2:  # as if the kill had cut a row mid-write: the next start must drop the partial line
      with open(workdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "reward/me')
  out = run_to_the_end(workdir)
  assert "resumed from step" in out
  assert_same_as_uninterrupted(workdir, uninterrupted)
  assert not any("tmp" in name for name in os.listdir(workdir / "checkpoints"))


@pytest.mark.slow
def test_sigterm_at_random_moments_then_resume_is_bitwise_identical(tmp_path, uninterrupted):
  rng = random.Random(5678)
  workdir = tmp_path / "run"
  # Preemption during start-up (before the handler is installed), then twice while training.
  plan = [(None, rng.uniform(0.5, 3.0)), (rng.randint(2, 7), rng.uniform(0.0, 0.4)),
          (rng.randint(10, 16), rng.uniform(0.0, 0.4))]
  for step, delay in plan:
    proc = start(workdir)
    if step is not None:
      kill_loop.wait_for(kill_loop.logged(workdir, step), proc)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    if step is None:
      assert proc.returncode in (0, -signal.SIGTERM), out
      continue
    assert proc.returncode == 0, out  # finished the step, saved it, exited cleanly
    stopped_at = rows(workdir)[-1]["step"]
    assert step <= stopped_at < STEPS, out
    assert f"preempted: saved step {stopped_at}" in out, out
    assert str(stopped_at) in os.listdir(workdir / "checkpoints")
  out = run_to_the_end(workdir)
  assert f"resumed from step {stopped_at}" in out
  assert_same_as_uninterrupted(workdir, uninterrupted)
