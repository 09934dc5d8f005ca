"""Two JAX processes on 127.0.0.1 (CPU, gloo) train like one process with the same global batch."""

import json
import os
import subprocess
import sys

import numpy as np
import portpicker
import pytest

import jax
from flax import nnx

from pacs_jax.train import export_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", os.path.join(ROOT, "configs", "tiny_cpu.py"), "--config.steps=2", "--config.eval_every=0",
        "--config.train.batch_prompts=8", "--config.train.mini_batch_prompts=8", "--config.mesh.fsdp=2",
        "--config.checkpoint.async_save=False"]


def env(devices: int):
  e = dict(os.environ)
  e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  e["JAX_PLATFORMS"] = "cpu"
  e["PACS_JAX_COMPILATION_CACHE"] = os.path.join(ROOT, ".jax_cache", "trainer")
  return e


def final_params(workdir, step):
  model, restored_step = export_lib.load_policy(str(workdir))
  assert restored_step == step
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def run_one(workdir, *extra):
  subprocess.run([sys.executable, "-m", "pacs_jax.train", *ARGS, *extra, "--workdir", str(workdir)], env=env(2),
                 check=True, capture_output=True, timeout=900)


def run_two(workdir, *extra) -> list[str]:
  """Two processes on 127.0.0.1, one CPU device each; returns their outputs."""
  port = portpicker.pick_unused_port()
  procs = [subprocess.Popen([sys.executable, "-m", "pacs_jax.train", *ARGS, *extra, "--workdir", str(workdir),
                             f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                             "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
                            env=env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out
  return outs


def metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  run_one(one)
  outs = run_two(two)
  # Only process 0 logs; checkpoints are written collectively.
  assert "step     2" in outs[0] and "step     2" not in outs[1]
  for a, b in zip(final_params(str(one), 2), final_params(str(two), 2)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  # Process 0's metrics cover the global batch, not just its own half.
  for a, b in zip(metrics(one), metrics(two)):
    assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]


@pytest.mark.slow
def test_two_processes_micro_batches_hold_whole_groups(tmp_path):
  """With gradient accumulation each process feeds whole groups to every micro-batch.

  The micro-batches hold other prompts than in the 1-process run, but the loss of the first step (before
  any update) and its gradient's norm are the same: a group cut across processes or micro-batches would
  change the RLOO baselines and class weights, and so the loss.
  """
  one, two = tmp_path / "one", tmp_path / "two"
  extra = ("--config.steps=1", "--config.train.micro_batch_prompts=4")
  run_one(one, *extra)
  run_two(two, *extra)
  (a,), (b,) = metrics(one), metrics(two)
  assert a["reward/mean"] == b["reward/mean"]
  for key in ("loss", "grad_norm", "pacs/score_mean", "pacs/weight_mean"):
    np.testing.assert_allclose(b[key], a[key], rtol=1e-6, err_msg=key)
