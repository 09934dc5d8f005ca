"""Damaged checkpoints: the next start resumes from the newest one that restores, warning with the bad step;
with every checkpoint damaged it stops with an error listing them, never training from scratch."""

import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDES = {"steps": 8, "eval_every": 4, "checkpoint.every": 4, "train.batch_prompts": 8,
             "train.mini_batch_prompts": 4, "data.synthetic_val_size": 8, "checkpoint.async_save": False}


def tiny(**overrides):
  return config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {**OVERRIDES, **overrides})


# Each damages the checkpoint folder of one step, as a crash, a full disk or a bad copy would.
def truncate_a_tensor_file(step_dir):
  biggest = max(glob.glob(f"{step_dir}/state/ocdbt.process_0/d/*"), key=os.path.getsize)
  os.truncate(biggest, os.path.getsize(biggest) // 2)


def garbage_in_the_manifest(step_dir):
  with open(f"{step_dir}/state/manifest.ocdbt", "wb") as f:
    f.write(b"\x00garbage" * 8)


def garbage_in_the_array_metadata(step_dir):
  with open(f"{step_dir}/state/_METADATA", "w") as f:
    f.write('{"tree_metadata": ')


def delete_an_item(step_dir):
  shutil.rmtree(f"{step_dir}/state")


def garbage_config(step_dir):
  with open(f"{step_dir}/config/metadata", "w") as f:
    f.write("{garbage")


def garbage_data_position(step_dir):
  with open(f"{step_dir}/data/metadata", "w") as f:
    json.dump({"no": "position"}, f)


DAMAGE = [truncate_a_tensor_file, garbage_in_the_manifest, garbage_in_the_array_metadata, delete_an_item,
          garbage_config, garbage_data_position]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
  """A finished 8-step run with checkpoints at steps 4 and 8."""
  workdir = tmp_path_factory.mktemp("good")
  loop.train(tiny(), str(workdir), devices=jax.devices()[:1])
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "8"]
  return workdir


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
  """One trainer whose maybe_restore is pointed at each damaged copy in turn (building one is the slow part)."""
  t = loop.Trainer(tiny(), str(tmp_path_factory.mktemp("probe")), devices=jax.devices()[:1])
  yield t
  t.checkpointer.close()
  t.lock.release()


def restore_from(trainer, checkpoints):
  trainer.checkpointer.close()
  trainer.checkpointer = checkpoint_lib.Checkpointer(str(checkpoints), keep=3, async_save=False)
  return trainer.maybe_restore()


def params_of(state):
  return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(damage, good_run, trainer, tmp_path, caplog):
  reference = restore_from(trainer, good_run / "checkpoints")
  assert reference == 8
  step4 = checkpoint_lib.Checkpointer(str(good_run / "checkpoints"), read_only=True)
  expected = params_of(step4.restore(4, checkpoint_lib.abstract_like(trainer.state))[0])
  step4.close()

  workdir = tmp_path / "run"
  shutil.copytree(good_run, workdir)
  damage(workdir / "checkpoints" / "8")
  with caplog.at_level(logging.WARNING):
    assert restore_from(trainer, workdir / "checkpoints") == 4
  assert any("checkpoint step 8 cannot be restored" in r.getMessage() for r in caplog.records), caplog.text
  for a, b in zip(params_of(trainer.state), expected):
    np.testing.assert_array_equal(a, b)
  # The bad step is moved out of the way (a new save of step 8 would collide with it), not deleted.
  assert os.listdir(workdir / "checkpoints") == ["4"]
  assert [name.split(".")[0] for name in os.listdir(workdir / checkpoint_lib.SET_ASIDE_DIR)] == ["8"]


def test_an_empty_newer_step_folder_is_skipped(good_run, trainer, tmp_path, caplog):
  workdir = tmp_path / "run"
  shutil.copytree(good_run, workdir)
  os.makedirs(workdir / "checkpoints" / "12")  # e.g. a copy or a sync that created the folder only
  with caplog.at_level(logging.WARNING):
    assert restore_from(trainer, workdir / "checkpoints") == 8
  assert any("checkpoint step 12 cannot be restored" in r.getMessage() for r in caplog.records), caplog.text


def test_training_on_after_a_fallback_ends_as_if_nothing_happened(good_run, tmp_path):
  """The resumed run saves step 8 again (the damaged one is set aside) and ends bitwise equal, same rows."""
  workdir = tmp_path / "run"
  shutil.copytree(good_run, workdir)
  truncate_a_tensor_file(workdir / "checkpoints" / "8")
  loop.train(tiny(), str(workdir), devices=jax.devices()[:1])

  def final(w):
    model, step = export_lib.load_policy(str(w))
    assert step == 8
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]

  for a, b in zip(final(workdir), final(good_run)):
    np.testing.assert_array_equal(a, b)
  rows = lambda w: [{k: v for k, v in json.loads(line).items() if not k.startswith(("timing/", "throughput/"))}
                    for line in open(w / "metrics.jsonl")]
  assert rows(workdir) == rows(good_run)


def test_every_checkpoint_damaged_stops_in_one_line_and_never_trains_from_scratch(good_run, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(good_run, workdir)
  garbage_config(workdir / "checkpoints" / "8")
  delete_an_item(workdir / "checkpoints" / "4")
  metrics_before = (workdir / "metrics.jsonl").read_bytes()
  cmd = [sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", "tiny_cpu.py"),
         "--workdir", str(workdir)] + [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": child_env.xla_flags(), "JAX_PLATFORMS": "cpu"})
  assert result.returncode != 0
  # One line however many steps (issue 44: it grew a line per step): how many, the newest's cause; each step's cause
  # is in the log with the traceback.
  refusal = [line for line in result.stderr.splitlines() if "no checkpoint in" in line]
  assert len(refusal) == 1 and "can be restored (2 steps; the newest, step 8: JSONDecodeError" in refusal[0], \
      result.stderr
  log = re.search(r"\(traceback: (.+)\)$", refusal[0]).group(1)
  assert "step 4: KeyError" in open(log).read() and "step 4: KeyError" not in result.stderr
  assert "checkpoint.restore=never" in result.stderr
  assert "Traceback" not in result.stderr
  # Nothing was trained or logged, and the checkpoints are where they were.
  assert (workdir / "metrics.jsonl").read_bytes() == metrics_before
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "8"]
  assert not (workdir / "trainer.lock").exists()

  # Asked explicitly, it starts over, setting the old checkpoints aside.
  restart = subprocess.run(cmd + ["--config.checkpoint.restore=never", "--config.steps=1", "--config.eval_every=0"],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "XLA_FLAGS": child_env.xla_flags(), "JAX_PLATFORMS": "cpu"})
  assert restart.returncode == 0, restart.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
  assert sorted(n.split(".")[0] for n in os.listdir(workdir / checkpoint_lib.SET_ASIDE_DIR)) == ["4", "8"]
  assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == [1]
