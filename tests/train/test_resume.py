"""Preemption and crashes: SIGTERM saves and exits 0, resuming is exact; kill -9 mid-save resumes from the last complete step."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax.train import export_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMING_PREFIXES = ("timing/", "throughput/")
# A tiny_cpu run small enough to be quick; eval and checkpoints inside the interval exercise both paths.
ARGS = ["--config.steps=20", "--config.eval_every=5", "--config.checkpoint.every=4",
        "--config.train.batch_prompts=8", "--config.train.mini_batch_prompts=4", "--config.data.synthetic_val_size=8"]


def trainer_cmd(workdir, *extra):
  return [sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", "tiny_cpu.py"),
          "--workdir", str(workdir), *ARGS, *extra]


def env():
  e = dict(os.environ)
  e["XLA_FLAGS"] = ""  # one CPU device, as the config's mesh asks
  e["PYTHONUNBUFFERED"] = "1"
  # Runs after the first reuse its compiled programs (as a restarted job would).
  e["PACS_JAX_COMPILATION_CACHE"] = os.path.join(ROOT, ".jax_cache", "trainer")
  return e


def metrics_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def without_timings(rows):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def final_params(workdir, step):
  model, restored_step = export_lib.load_policy(str(workdir))
  assert restored_step == step
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def wait_for(predicate, proc, timeout=600):
  start = time.time()
  while not predicate():
    if proc.poll() is not None:
      raise AssertionError(f"trainer exited early with {proc.returncode}:\n{proc.stdout.read()}")
    if time.time() - start > timeout:
      proc.kill()
      raise AssertionError("timed out waiting for the trainer")
    time.sleep(0.05)


def logged_step(workdir, step):
  path = os.path.join(workdir, "metrics.jsonl")
  return lambda: os.path.exists(path) and any(r["step"] >= step for r in metrics_rows(workdir))


@pytest.mark.slow
def test_sigterm_then_resume_is_bitwise_identical(tmp_path):
  straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
  subprocess.run(trainer_cmd(straight), env=env(), check=True, capture_output=True, timeout=900)

  proc = subprocess.Popen(trainer_cmd(interrupted), env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  wait_for(logged_step(interrupted, 10), proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  stopped_at = metrics_rows(interrupted)[-1]["step"]
  assert 10 <= stopped_at < 20, "the run should stop at the step it was in when SIGTERM arrived"
  resumed = subprocess.run(trainer_cmd(interrupted), env=env(), capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f"resumed from step {stopped_at}" in resumed.stdout

  for a, b in zip(final_params(straight, 20), final_params(interrupted, 20)):
    np.testing.assert_array_equal(a, b)
  rows_a, rows_b = metrics_rows(straight), metrics_rows(interrupted)
  assert [r["step"] for r in rows_b] == list(range(0, 21))
  assert without_timings(rows_a) == without_timings(rows_b)


@pytest.mark.slow
def test_kill_9_during_checkpoint_write_resumes_from_last_complete(tmp_path):
  workdir = tmp_path / "run"
  ckpt_dir = workdir / "checkpoints"

  def writing():
    return ckpt_dir.exists() and any("tmp" in p.name for p in ckpt_dir.iterdir())

  # Checkpoint every step so a write is nearly always in flight; kill -9 as soon as one is seen after
  # a complete checkpoint exists.
  for attempt in range(5):
    proc = subprocess.Popen(trainer_cmd(workdir, "--config.checkpoint.every=1", "--config.checkpoint.async_save=True"),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(logged_step(workdir, 3 + 4 * attempt), proc)
    wait_for(writing, proc)
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait()
    if writing():
      break
  assert writing(), "never caught the trainer mid-write"
  complete = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
  assert complete

  resumed = subprocess.run(trainer_cmd(workdir, "--config.steps=" + str(max(complete) + 2)), env=env(),
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f"resumed from step {max(complete)}" in resumed.stdout
  assert metrics_rows(workdir)[-1]["step"] == max(complete) + 2
  assert not any("tmp" in p.name for p in ckpt_dir.iterdir())
