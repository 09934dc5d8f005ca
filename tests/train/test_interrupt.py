"""Ctrl-C (issue 34): the first one finishes the step, saves a checkpoint and exits 0, as SIGTERM does; a second one
exits at once (status 130) without saving, and the next start resumes from the last checkpoint."""

import os
import signal
import subprocess
import sys
import time

import pytest

from pacs_jax import errors
from pacs_jax.trainer import preemption
from pacs_jax.trainer.metrics import read_rows
from tests.train.test_failures import ROOT, RUN, env

# Each step's scoring takes a second longer, so that a Ctrl-C lands mid-step and a second one before it ends.
SLOW_STEPS = ("import time\nfrom pacs_jax.trainer import stages\n_score = stages.score\n"
              "stages.score = lambda *a: time.sleep(1.0) or _score(*a)\n")


def start(workdir):
  """The demo in its own process group, as a terminal runs it (Ctrl-C reaches the whole group)."""
  command = [sys.executable, "-c", f"{SLOW_STEPS}import runpy, sys\nsys.argv = ['pacs_jax.train', *sys.argv[1:]]\n"
             "runpy.run_module('pacs_jax.train', run_name='__main__', alter_sys=True)",
             *RUN, "--config.steps=100", "--config.checkpoint.every=1000", "--workdir", str(workdir)]
  return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env(),
                          start_new_session=True)


def wait_for_row(workdir, step, proc, timeout=300):
  deadline = time.monotonic() + timeout
  while not any(r["step"] >= step for r in read_rows(os.path.join(workdir, "metrics.jsonl"))):
    assert proc.poll() is None, proc.communicate()
    assert time.monotonic() < deadline, "no metrics row in time"
    time.sleep(0.05)


def checkpoints(workdir):
  return sorted(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())


@pytest.mark.slow
def test_ctrl_c_saves_at_the_step_boundary_and_a_second_one_exits_at_once(tmp_path):
  workdir = tmp_path / "run"
  proc = start(workdir)
  wait_for_row(workdir, 1, proc)
  os.killpg(proc.pid, signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err
  saved = read_rows(os.path.join(workdir, "metrics.jsonl"))[-1]["step"]
  assert checkpoints(workdir) == [saved]
  assert "SIGINT received: finishing this step, then saving a checkpoint and exiting (Ctrl-C again to exit at " \
         "once)" in err
  assert f"interrupted: saved step {saved}, exiting" in err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err

  proc = start(workdir)
  wait_for_row(workdir, saved + 1, proc)
  os.killpg(proc.pid, signal.SIGINT)
  time.sleep(0.3)  # within the step (each takes over a second)
  os.killpg(proc.pid, signal.SIGINT)
  started = time.monotonic()
  out, err = proc.communicate(timeout=60)
  assert time.monotonic() - started < 5
  assert proc.returncode == preemption.EXIT_SECOND_INTERRUPT == errors.EXIT_INTERRUPTED, err
  assert f"resumed from step {saved}" in out
  assert err.strip().splitlines()[-1] == ("second Ctrl-C: exiting now, without saving this step (a rerun resumes "
                                          "from the last checkpoint)")
  assert "Traceback" not in err and "KeyboardInterrupt" not in err
  assert checkpoints(workdir) == [saved]
