"""Ctrl-C (issue 34): the first one finishes the step, saves a checkpoint and exits 0, as SIGTERM does; a second one
exits at once (status 130) without saving, and the next start resumes from the last checkpoint. Before training
begins (the imports, the model's build), one Ctrl-C ends the command in one line with status 130 and leaves nothing
behind."""

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from pacs_jax import errors
from pacs_jax.services import preemption
from pacs_jax.services.metrics import read_rows
from tests.train.test_failures import PLATFORM_NOISE, ROOT, RUN, env

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
  # Past the step boundary that follows the row (its stop check), into the next step's second of scoring: both
  # Ctrl-Cs land within one step. Without the pause, a first one that landed between the row and the check stopped
  # the run at that boundary, before the second was sent.
  time.sleep(0.3)
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


# ---------------------------------------------------------------------------------------------------------
# Before training begins.

def launch(module, prelude, *args, cwd):
  """`python -m module args` in its own process group, `prelude` run first in the same process."""
  command = [sys.executable, "-c", f"{prelude}\nimport runpy, sys\nsys.argv = ['{module}', *sys.argv[1:]]\n"
             f"runpy.run_module('{module}', run_name='__main__', alter_sys=True)", *args]
  return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env(),
                          start_new_session=True)


def ctrl_c_when_ready(proc) -> tuple[str, str, float]:
  """Waits for the prelude's `ready` line, sends Ctrl-C; (stdout, stderr, seconds from the Ctrl-C to the exit)."""
  line = proc.stdout.readline()
  assert line == "ready\n", (line, proc.communicate())
  os.killpg(proc.pid, signal.SIGINT)
  started = time.monotonic()
  out, err = proc.communicate(timeout=120)
  return out, err, time.monotonic() - started


def assert_interrupted(proc, err, prog):
  lines = [line for line in err.splitlines() if line.strip() and not any(n in line for n in PLATFORM_NOISE)]
  assert proc.returncode == errors.EXIT_INTERRUPTED, err
  assert len(lines) == 1 and lines[0].startswith(f"{prog}: interrupted (Ctrl-C)"), err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Exception ignored" not in err


# The imports (jax, the config) take seconds before the program's own code runs: held there until the Ctrl-C.
IN_THE_IMPORTS = """
import sys, time
class HeldImport:
  def find_spec(self, name, path=None, target=None):
    if name == "pacs_jax.config":
      print("ready", flush=True)
      time.sleep(60)
sys.meta_path.insert(0, HeldImport())
"""


@pytest.mark.parametrize("module, args", [
    ("pacs_jax.train", ["--workdir", "run"]),
    ("pacs_jax.evaluate", ["--model", "run", "--data", "synthetic/mod3"]),
    ("pacs_jax.export", ["--workdir", "run", "--out", "hf"]),
    ("pacs_jax.study", ["--out", "study", "--shrunk"]),
])
def test_ctrl_c_during_the_imports_is_one_line(module, args, tmp_path):
  """Was: an 80-line KeyboardInterrupt traceback through the imports, and the status of a killed process."""
  proc = launch(module, IN_THE_IMPORTS, *args, cwd=tmp_path)
  _, err, seconds = ctrl_c_when_ready(proc)
  assert_interrupted(proc, err, module.split(".")[-1])
  assert seconds < 5 and os.listdir(tmp_path) == []


# jax runs a Python callback at each garbage collection; a Ctrl-C that comes while the model is built or compiled
# often lands in it, where Python prints the KeyboardInterrupt as "Exception ignored" and goes on. Here the
# collection at the start of the model's build waits in such a callback for the Ctrl-C (the workdir lock held).
IN_A_GC_CALLBACK = """
import gc, time
from pacs_jax.trainer import build
_build_policy = build.build_policy
def build_policy(*args, **kwargs):
  def in_gc(phase, info):
    gc.callbacks.remove(in_gc)
    print("ready", flush=True)
    time.sleep(60)
  gc.callbacks.append(in_gc)
  gc.collect()
  return _build_policy(*args, **kwargs)
build.build_policy = build_policy
"""


@pytest.mark.slow
def test_ctrl_c_while_the_model_is_built_stops_in_one_line_and_leaves_nothing(tmp_path):
  """Was: "Exception ignored in: <function in_gc>" and a KeyboardInterrupt traceback, then the run trained on
  (exit 0). Now the Ctrl-C is raised again in the program's own code: one line, 130, the lock released and the
  workdir this start created removed (a rerun starts as if this one never ran)."""
  proc = launch("pacs_jax.train", IN_A_GC_CALLBACK, *RUN, "--config.steps=2", "--workdir", "run", cwd=tmp_path)
  out, err, seconds = ctrl_c_when_ready(proc)
  assert_interrupted(proc, err, "train")
  assert seconds < 10 and "step" not in out and os.listdir(tmp_path) == []


def test_only_a_ctrl_c_in_a_callback_is_raised_again():
  """Another exception a callback could not raise is still printed (by the previous hook), and a KeyboardInterrupt
  too when it is no Ctrl-C's (none came)."""
  seen = []
  hook = errors._ctrl_c_in_a_callback(seen.append)
  unraisable = types.SimpleNamespace(exc_value=ValueError("boom"))
  hook(unraisable)
  interrupt = types.SimpleNamespace(exc_value=KeyboardInterrupt())
  hook(interrupt)
  assert seen == [unraisable, interrupt]
