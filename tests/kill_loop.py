"""The kill loop the resume tests share: start a trainer in a subprocess, wait for a moment (a metrics row, a save in
flight), kill it with SIGKILL (no handler, no cleanup), and run it to the end afterwards."""

import os
import subprocess
import time

from pacs_jax.services.metrics import read_rows


def rows(workdir) -> list[dict]:
  return read_rows(os.path.join(workdir, "metrics.jsonl"))


def logged(workdir, step):
  """A predicate: the row of `step` (or a later one) is in metrics.jsonl."""
  return lambda: any(r["step"] >= step for r in rows(workdir))


def saving(workdir) -> bool:
  """An Orbax save is in flight: its temporary folder exists."""
  ckpt = os.path.join(workdir, "checkpoints")
  return os.path.isdir(ckpt) and any("tmp" in name for name in os.listdir(ckpt))


def wait_for(predicate, proc, poll=0.005, timeout=600):
  deadline = time.time() + timeout
  while not predicate():
    if proc.poll() is not None:
      raise AssertionError(f"trainer exited early with {proc.returncode}:\n{proc.stdout.read()}")
    if time.time() > deadline:
      proc.kill()
      raise AssertionError("timed out waiting for the trainer")
    time.sleep(poll)


def start(cmd, env) -> subprocess.Popen:
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_when(cmd, env, *moments, delay: float = 0.0) -> str:
  """Starts `cmd`, waits for each predicate of `moments` in turn, then `delay` seconds, and kills it with SIGKILL;
  returns what it printed."""
  proc = start(cmd, env)
  for moment in moments:
    wait_for(moment, proc)
  time.sleep(delay)
  proc.kill()  # SIGKILL: no handler, no cleanup
  out, _ = proc.communicate()
  return out


def run_to_the_end(cmd, env, timeout=900) -> str:
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout
