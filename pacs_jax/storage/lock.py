"""One trainer per workdir: a lock file `WORKDIR/trainer.lock` naming its holder, refreshed by a heartbeat.

A second trainer refuses to start and names the holder. A lock left by a killed trainer is stale, and taken
over with a warning, when its process is gone (same host) or its heartbeat is older than `stale_after_s`
(another host: a pid there means nothing here). Every change is a compare-and-swap, so two trainers that
find the same stale lock cannot both take it: on Cloud Storage, which has no file locks, a write carries a
generation precondition (`ifGenerationMatch`); locally, the read-compare-write runs under `flock` on the
workdir. Hosts' clocks are assumed synchronised (NTP) to well within `stale_after_s`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid

from absl import logging

from pacs_jax import paths
from pacs_jax.storage.workdir import LOCK_FILE


class WorkdirLocked(RuntimeError):
  """Another live trainer holds the workdir."""


class _Conflict(Exception):
  """The lock changed between our read and our write."""


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  started: float  # time.time() when the trainer took the lock
  heartbeat: float  # time.time() of its last refresh
  token: str  # unique per acquisition
  pid_started: str = ""  # the process's start time in clock ticks since boot (Linux), against pid reuse

  def describe(self) -> str:
    return (f"host {self.host}, pid {self.pid}, started {_clock(self.started)}, "
            f"last heartbeat {time.time() - self.heartbeat:.0f} s ago")


def _clock(t: float) -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _process_start(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]  # field 22 (starttime), counted after the command name
  except (OSError, IndexError):
    return ""


def _process_alive(pid: int, started: str) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # exists, owned by someone else
  return not started or not _process_start(pid) or _process_start(pid) == started


def stale_reason(holder: Holder, stale_after_s: float, now: float | None = None) -> str | None:
  """Why `holder` no longer holds the lock, or None while it does."""
  now = time.time() if now is None else now
  if holder.host == socket.gethostname():
    return None if _process_alive(holder.pid, holder.pid_started) else f"process {holder.pid} is gone"
  if now - holder.heartbeat > stale_after_s:
    return f"no heartbeat for {now - holder.heartbeat:.0f} s (> {stale_after_s:.0f} s)"
  return None


# ----------------------------------------------------------------------------------------------
# Compare-and-swap stores: read() -> (bytes | None, version); write/delete only if the version still holds.


class _LocalStore:
  def __init__(self, path: str):
    self.path = path

  @contextlib.contextmanager
  def _exclusive(self):
    import fcntl
    fd = os.open(os.path.dirname(self.path), os.O_RDONLY)  # flock on the workdir itself: no extra file
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
      yield
    finally:
      os.close(fd)

  def read(self):
    try:
      with open(self.path, "rb") as f:
        data = f.read()
      return data, data
    except FileNotFoundError:
      return None, None

  def write(self, data: bytes, expected):
    with self._exclusive():
      if self.read()[1] != expected:
        raise _Conflict
      paths.write_atomic(self.path, data)
    return data

  def delete(self, expected) -> None:
    with self._exclusive():
      if self.read()[1] == expected:
        os.remove(self.path)


class _GcsStore:
  def __init__(self, uri: str):
    import fsspec
    self.fs = fsspec.filesystem("gcs")
    self.bucket, self.key = uri.removeprefix("gs://").split("/", 1)

  def read(self):
    try:
      headers, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media")
    except FileNotFoundError:
      return None, 0
    return data, int(headers["x-goog-generation"])

  def write(self, data: bytes, expected: int) -> int:
    upload = self.fs.base.replace("/storage/v1/", "/upload/storage/v1/") + "b/{}/o"
    try:
      meta = self.fs.call("POST", upload, self.bucket, uploadType="media", name=self.key, ifGenerationMatch=expected,
                          data=data, headers={"Content-Type": "application/octet-stream"}, json_out=True)
    except FileExistsError as e:  # gcsfs's name for 412 Precondition Failed
      raise _Conflict from e
    return int(meta["generation"])

  def delete(self, expected: int) -> None:
    with contextlib.suppress(FileNotFoundError, FileExistsError):
      self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=expected)


def _store(path: str):
  if not paths.is_remote(path):
    return _LocalStore(path)
  if path.startswith("gs://"):
    return _GcsStore(path)
  raise ValueError(f"{path}: the workdir lock supports local paths and gs:// only")


# ----------------------------------------------------------------------------------------------


class WorkdirLock:
  """`acquire()` takes the lock (or raises WorkdirLocked), a daemon thread refreshes it, `release()` frees it.
  `lost` turns True if another trainer took it over (this one was thought dead): the loop then stops."""

  def __init__(self, workdir: str, stale_after_s: float = 300.0):
    self.path = paths.join(workdir, LOCK_FILE)
    self.workdir, self.stale_after_s = paths.normalize(workdir), stale_after_s
    self._store = None
    self._version = None
    self._holder: Holder | None = None
    self._stop = threading.Event()
    self._thread = None
    self.lost: str | None = None  # a description of who took the lock over

  def acquire(self) -> None:
    paths.makedirs(self.workdir)
    self._store = _store(self.path)
    now = time.time()
    mine = Holder(socket.gethostname(), os.getpid(), now, now, uuid.uuid4().hex, _process_start(os.getpid()))
    for _ in range(10):
      data, version = self._store.read()
      if data is not None:
        try:
          holder = Holder(**json.loads(data))
        except (ValueError, TypeError) as e:
          logging.warning("%s is unreadable (%s); taking it over", self.path, e)
        else:
          reason = stale_reason(holder, self.stale_after_s)
          if reason is None:
            raise WorkdirLocked(
                f"{self.workdir} is in use by another trainer ({holder.describe()}). Stop it, or use another "
                f"--workdir; a lock whose holder died is taken over once its process is gone (same host) or "
                f"its heartbeat is {self.stale_after_s:.0f} s old (config.checkpoint.lock_stale_after_s); "
                f"delete {self.path} to take it over now.")
          logging.warning("taking over the stale lock on %s (%s): %s", self.workdir, holder.describe(), reason)
      try:
        self._version = self._store.write(_encode(mine), version)
      except _Conflict:
        continue  # it changed under us: look again
      self._holder = mine
      self._thread = threading.Thread(target=self._heartbeat, name="workdir-lock-heartbeat", daemon=True)
      self._thread.start()
      return
    raise WorkdirLocked(f"{self.path}: could not take the lock (it keeps changing)")

  def _heartbeat(self) -> None:
    interval = max(1.0, min(60.0, self.stale_after_s / 5))
    while not self._stop.wait(interval):
      holder = dataclasses.replace(self._holder, heartbeat=time.time())
      try:
        self._version = self._store.write(_encode(holder), self._version)
        self._holder = holder
      except _Conflict:
        data, _ = self._store.read()
        try:
          self.lost = Holder(**json.loads(data)).describe() if data else "nobody (the lock was deleted)"
        except (ValueError, TypeError):
          self.lost = "an unreadable lock"
        logging.error("lost the lock on %s to %s", self.workdir, self.lost)
        return
      except Exception as e:  # noqa: BLE001 (a network hiccup: try again at the next beat)
        logging.warning("could not refresh the lock on %s: %s", self.workdir, e)

  def abandon(self) -> None:
    """Stops the heartbeat without waiting for it and leaves the lock file (its store is unreachable): the lock
    is stale at once to a restart on this host, and after `stale_after_s` on another."""
    self._stop.set()
    self._holder = None

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._holder is not None and self.lost is None:
      with contextlib.suppress(Exception):
        self._store.delete(self._version)
    self._holder = None


def _encode(holder: Holder) -> bytes:
  return (json.dumps(dataclasses.asdict(holder), indent=1) + "\n").encode()
