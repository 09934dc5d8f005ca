"""A LoRA run killed with SIGKILL (mid-save, mid-step) and restarted ends bitwise equal to an uninterrupted one:
adapters, their optimizer state and metrics rows (timings aside), as tests/train/test_resume.py shows for full runs.
The frozen base is read again from its source at each start; the checkpoints never held it."""

import os
import random
import sys

import jax
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import programs as programs_lib
from pacs_jax.services.metrics import read_rows
from tests import kill_loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
TIMING_PREFIXES = ("timing/", "throughput/")
STEPS = 10
SETTINGS = {"steps": STEPS, "eval_every": 4, "checkpoint.every": 3, "train.batch_prompts": 8,
            "train.mini_batch_prompts": 4, "data.synthetic_val_size": 8, "lora.rank": 8,
            "lora.modules_to_save": ""}


def trainer_cmd(workdir):
  return [sys.executable, "-m", "pacs_jax.train", "--config", TINY, "--workdir", str(workdir),
          *[f"--config.{k}={v}" for k, v in SETTINGS.items()]]


def env():
  return {**os.environ, "XLA_FLAGS": child_env.xla_flags(),
          "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": child_env.pythonpath(ROOT),
          "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer")}


def rows(workdir):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
          for r in read_rows(os.path.join(workdir, "metrics.jsonl"))]


def final_state(workdir) -> list[np.ndarray]:
  """The last checkpoint's state (adapters, their Adam moments, counters, RNG) on one device."""
  cfg = config_lib.load_config_file(TINY, SETTINGS)
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  _, _, abstract = programs_lib.abstract_train_state(cfg, mesh)
  ckpt = export_lib.open_checkpoints(str(workdir))
  try:
    assert ckpt.latest_step() == STEPS
    state, _ = ckpt.restore(STEPS, abstract)
  finally:
    ckpt.close()
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def run_to_the_end(workdir) -> str:
  return kill_loop.run_to_the_end(trainer_cmd(workdir), env())


@pytest.mark.slow
def test_a_lora_run_killed_at_random_moments_resumes_bitwise(tmp_path):
  straight = tmp_path / "straight"
  run_to_the_end(straight)
  rng = random.Random(31)
  workdir = tmp_path / "run"
  # (the step whose row to wait for, whether to wait for a save in flight, then a random extra delay)
  for step, mid_save, delay in [(rng.randint(3, 5), True, 0.0), (rng.randint(6, 8), False, rng.uniform(0.0, 0.3))]:
    moments = [kill_loop.logged(workdir, step)] + ([lambda: kill_loop.saving(workdir)] if mid_save else [])
    kill_loop.kill_when(trainer_cmd(workdir), env(), *moments, delay=delay)
  assert "resumed from step" in run_to_the_end(workdir)
  assert [r["step"] for r in rows(workdir)] == list(range(STEPS + 1))  # each step once, step 0's validation too
  assert rows(workdir) == rows(straight)
  for a, b in zip(final_state(workdir), final_state(straight), strict=True):
    np.testing.assert_array_equal(a, b)
