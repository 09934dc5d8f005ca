"""Two JAX processes on 127.0.0.1 (CPU, gloo) train like one process with the same global batch."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest

import jax
from flax import nnx

from pacs_jax.storage import hf_export as export_lib
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", os.path.join(ROOT, "configs", "tiny_cpu.py"), "--config.steps=2", "--config.eval_every=0",
        "--config.train.batch_prompts=8", "--config.train.mini_batch_prompts=8", "--config.mesh.fsdp=2",
        "--config.checkpoint.async_save=False"]


def env(devices: int):
  e = dict(os.environ)
  e["XLA_FLAGS"] = child_env.xla_flags(devices)
  e["JAX_PLATFORMS"] = "cpu"
  e["PACS_JAX_COMPILATION_CACHE"] = os.path.join(ROOT, ".jax_cache", "trainer")
  return e


def final_params(workdir, step):
  model, restored_step = export_lib.load_policy(str(workdir))
  assert restored_step == step
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def run_one(workdir, *extra, devices: int = 2):
  subprocess.run([sys.executable, "-m", "pacs_jax.train", *ARGS, *extra, "--workdir", str(workdir)],
                 env=env(devices), check=True, capture_output=True, timeout=900)


def start_two(workdir, *extra, devices: int = 1) -> list[subprocess.Popen]:
  """Two processes on 127.0.0.1, `devices` CPU devices each."""
  port = portpicker.pick_unused_port()
  return [subprocess.Popen([sys.executable, "-m", "pacs_jax.train", *ARGS, *extra, "--workdir", str(workdir),
                            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                            "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
                           env=env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for i in range(2)]


def run_two(workdir, *extra, devices: int = 1) -> list[str]:
  """Runs `start_two` to the end; returns the two outputs."""
  procs = start_two(workdir, *extra, devices=devices)
  outs = [p.communicate(timeout=900)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out
  return outs


def metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_two_processes_match_one_with_whole_groups_in_every_micro_batch(tmp_path):
  """Two processes train as one: the same final parameters and process 0's metrics over the global batch. With
  gradient accumulation each process feeds whole groups to every micro-batch: the micro-batches hold other prompts
  than in the 1-process run, but the loss of the first step (before any update) and its gradient's norm are the
  same (a group cut across processes or micro-batches would change the RLOO baselines and class weights, and so
  the loss), and so is the update."""
  one, two = tmp_path / "one", tmp_path / "two"
  extra = ("--config.train.micro_batch_prompts=4",)
  run_one(one, *extra)
  outs = run_two(two, *extra)
  # Only process 0 logs; checkpoints are written collectively.
  assert "step     2" in outs[0] and "step     2" not in outs[1]
  for a, b in zip(final_params(str(one), 2), final_params(str(two), 2)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  # Process 0's metrics cover the global batch, not just its own half.
  rows_one, rows_two = metrics(one), metrics(two)
  for a, b in zip(rows_one, rows_two):
    assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
  for key in ("loss", "grad_norm", "pacs/score_mean", "pacs/weight_mean"):
    np.testing.assert_allclose(rows_two[0][key], rows_one[0][key], rtol=1e-6, err_msg=key)


@pytest.mark.slow
def test_dynamic_sampling_on_two_processes_matches_one(tmp_path):
  """DAPO's refill (issue 32): the two processes select the same groups in global prompt order and each feeds its
  share, so they train as one process does. n = 2 on the random model: steps refill and, capped at 2 rounds, fill.
  Packed rows (issue 42): each process packs its share into its own rows of one agreed rung, the log-probs come
  back from the global rows' positions."""
  one, two = tmp_path / "one", tmp_path / "two"
  extra = ("--config.algorithm=dapo", "--config.rollout.n=2", "--config.dapo.max_num_gen_batches=2",
           "--config.dapo.overlong_buffer_len=1", "--config.train.packing=True")
  run_one(one, *extra)
  run_two(two, *extra)
  for a, b in zip(final_params(str(one), 2), final_params(str(two), 2)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  rows_one, rows_two = metrics(one), metrics(two)
  assert sum(r["sampling/rounds"] for r in rows_one) > len(rows_one)  # it refilled
  for a, b in zip(rows_one, rows_two):
    for key in ("sampling/rounds", "sampling/kept_groups", "sampling/filler_groups", "sampling/score_mean",
                "reward/mean", "accuracy/all"):
      assert a[key] == b[key], key


@pytest.mark.slow
def test_sigterm_on_one_host_stops_every_host_after_the_same_step(tmp_path):
  """A preemption notice reaches one host: both save the same step collectively and exit 0 (no host
  is left waiting in a collective the other never enters)."""
  workdir = tmp_path / "run"
  procs = start_two(workdir, "--config.steps=60")
  try:
    deadline = time.time() + 600
    while not (os.path.exists(workdir / "metrics.jsonl") and len(metrics(workdir)) >= 3):
      assert time.time() < deadline and all(p.poll() is None for p in procs), "trainer did not start"
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # process 1 only; process 0 writes the metrics
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out
  stopped = metrics(workdir)[-1]["step"]
  assert stopped < 60
  saved = sorted(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
  assert saved[-1] == stopped
  assert f"preempted: saved step {stopped}" in outs[1]
