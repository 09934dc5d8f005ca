"""One trainer per workdir: a second one refuses naming the first; a lock whose holder died is taken over."""

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pacs_jax.storage import lock as workdir_lock
from pacs_jax.storage.lock import Holder, WorkdirLock, WorkdirLocked
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dead_pid() -> int:
  proc = subprocess.Popen(["true"])
  proc.wait()
  return proc.pid


def write_holder(lock_path, **fields):
  now = time.time()
  holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now, "token": "x",
            **fields}
  if lock_path.startswith("gs://"):
    from pacs_jax import paths
    paths.write_atomic(lock_path, json.dumps(holder))
  else:
    with open(lock_path, "w") as f:
      json.dump(holder, f)


@pytest.fixture(params=["local", "gcs"])
def workdir(request, tmp_path):
  """A fresh workdir on the local disk, or in the Cloud Storage emulator (generation preconditions there)."""
  if request.param == "local":
    return str(tmp_path)
  gcs = request.getfixturevalue("local_gcs")
  return f"gs://{gcs.bucket}/lock-tests/{tmp_path.name}"


def test_lock_writes_are_compare_and_swap(workdir):
  """Two trainers that find the same stale lock cannot both take it: a write names the version it replaces."""
  store = workdir_lock._store(f"{workdir}/{workdir_lock.LOCK_FILE}")
  data, absent = store.read()
  assert data is None
  one = store.write(b"one", absent)
  with pytest.raises(workdir_lock._Conflict):
    store.write(b"other", absent)  # it exists now
  two = store.write(b"two", one)
  with pytest.raises(workdir_lock._Conflict):
    store.write(b"other", one)  # replaced meanwhile
  assert store.read() == (b"two", two)
  store.delete(one)  # a stale version deletes nothing
  assert store.read()[0] == b"two"
  store.delete(two)
  assert store.read()[0] is None


def test_a_second_lock_is_refused_naming_the_holder(workdir):
  first = WorkdirLock(workdir)
  first.acquire()
  try:
    with pytest.raises(WorkdirLocked) as refused:
      WorkdirLock(workdir).acquire()
    message = str(refused.value)
    assert f"host {socket.gethostname()}" in message and f"pid {os.getpid()}" in message and "started 20" in message
  finally:
    first.release()
  again = WorkdirLock(workdir)  # released: free again
  again.acquire()
  again.release()


@pytest.mark.parametrize("holder, reason", [
    (dict(pid=None), "is gone"),  # this host, its process has exited (pid filled in below)
    (dict(host="other-host", pid=1, heartbeat=time.time() - 3600), "no heartbeat for"),  # another host, silent for an hour
])
def test_a_stale_lock_is_taken_over_with_a_warning(workdir, holder, reason, caplog):
  holder = dict(holder, pid=holder.get("pid") or dead_pid())
  write_holder(f"{workdir}/{workdir_lock.LOCK_FILE}", **holder)
  lock = WorkdirLock(workdir, stale_after_s=300)
  with caplog.at_level(logging.WARNING):
    lock.acquire()
  try:
    assert any("taking over the stale lock" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    with pytest.raises(WorkdirLocked):  # and it is ours now
      WorkdirLock(workdir).acquire()
  finally:
    lock.release()


def test_another_hosts_lock_with_a_recent_heartbeat_is_respected(workdir):
  write_holder(f"{workdir}/{workdir_lock.LOCK_FILE}", host="other-host", pid=1, heartbeat=time.time() - 10)
  with pytest.raises(WorkdirLocked, match="host other-host, pid 1"):
    WorkdirLock(workdir, stale_after_s=300).acquire()


def test_the_heartbeat_refreshes_and_a_takeover_is_noticed(workdir):
  lock = WorkdirLock(workdir, stale_after_s=1.0)  # a heartbeat every second
  lock.acquire()
  first_beat = lock._holder.heartbeat
  deadline = time.time() + 20
  while lock._holder.heartbeat == first_beat and time.time() < deadline:
    time.sleep(0.1)
  assert lock._holder.heartbeat > first_beat
  # Another trainer decided we were dead and took the lock: the next heartbeat notices, and release
  # leaves the new holder's lock alone.
  write_holder(f"{workdir}/{workdir_lock.LOCK_FILE}", host="other-host", pid=7)
  while not lock.lost and time.time() < deadline:
    time.sleep(0.1)
  assert lock.lost and "host other-host, pid 7" in lock.lost
  lock.release()
  with pytest.raises(WorkdirLocked, match="host other-host"):
    WorkdirLock(workdir, stale_after_s=300).acquire()


def test_stale_rules():
  me = Holder(socket.gethostname(), os.getpid(), 0.0, time.time(), "t", workdir_lock._process_start(os.getpid()))
  assert workdir_lock.stale_reason(me, 1.0, now=time.time() + 10**6) is None  # alive here: never stale
  assert "is gone" in workdir_lock.stale_reason(dataclasses.replace(me, pid=dead_pid()), 300)
  # The pid now belongs to another process (started at another time): the holder is gone.
  assert "is gone" in workdir_lock.stale_reason(dataclasses.replace(me, pid_started="1"), 300)
  other = dataclasses.replace(me, host="elsewhere", heartbeat=100.0)
  assert workdir_lock.stale_reason(other, 300, now=399.0) is None
  assert "no heartbeat for 300 s" in workdir_lock.stale_reason(other, 299, now=400.0)


def trainer(workdir, *extra):
  cmd = [sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", "tiny_cpu.py"),
         "--workdir", str(workdir), "--config.train.batch_prompts=8", "--config.train.mini_batch_prompts=4",
         "--config.eval_every=0", "--config.checkpoint.every=2", *extra]
  env = {**os.environ, "XLA_FLAGS": child_env.xla_flags(), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
         "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer")}
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_trainers_on_one_workdir(tmp_path):
  first = trainer(tmp_path, "--config.steps=100000")
  try:
    deadline = time.time() + 600
    while not (tmp_path / "metrics.jsonl").exists():  # training: it holds the lock
      assert first.poll() is None, first.communicate()
      assert time.time() < deadline
      time.sleep(0.2)
    second = trainer(tmp_path, "--config.steps=3")
    _, err = second.communicate(timeout=600)
    assert second.returncode != 0
    assert f"is in use by another trainer (host {socket.gethostname()}, pid {first.pid}, started" in err, err
    assert "Traceback" not in err
    assert first.poll() is None  # the first one trains on
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate()
  assert (tmp_path / workdir_lock.LOCK_FILE).exists()  # left behind by the kill

  third = trainer(tmp_path, "--config.steps=2")
  _, err = third.communicate(timeout=600)
  assert third.returncode == 0, err
  assert "taking over the stale lock" in err and f"pid {first.pid}" in err and "is gone" in err, err
  assert not (tmp_path / workdir_lock.LOCK_FILE).exists()  # released at the end
