"""The Python sandbox of tool-integrated reasoning (issue 43): a model's ```python``` block runs in a process of its
own, under limits, and how it ended comes back as a `Result` whose `kind` a training loop counts.

What holds, whatever the program does (the kernel enforces it):
- time: CPU time (RLIMIT_CPU) and wall clock; at the wall limit the whole process group is killed (SIGKILL), and
  after every run too, so no child or grandchild that stayed in the group survives it;
- memory: the address space (RLIMIT_AS): an allocation past it fails (MemoryError);
- output: at most `output_bytes` + 1 bytes are read from its pipe, then the process group is killed;
- files: each file it writes is at most `file_bytes` (RLIMIT_FSIZE); its folder is a fresh temporary one, deleted
  after the run; no core file;
- processes: RLIMIT_NPROC at the user's count at start plus `max_processes` (the kernel ignores it for root).
- the host: a program dies with the process that started it (PR_SET_PDEATHSIG), a host killed with SIGKILL too.

What holds against a program that is not trying to escape (an audit hook in the child, sandbox_child.py, installed
before the program's first line): no network (every `socket.*` event refused), no new processes (fork, exec, spawn,
system, subprocess) and no signals to others, no C calls through ctypes, no writes, renames or removals outside its
folder (symbolic links resolved), and no import by the program's own code of the modules of the network, processes
and C calls (socket, subprocess, multiprocessing, ctypes, urllib, http...). A refused action ends the program at
once (kind "forbidden"). The program may read any file the user may, and use numpy, sympy and the standard library.

What it does NOT protect against: audit hooks are no security boundary (PEP 578). Code that sets out to escape can
reach the interpreter's internals (gc, frames, a re-imported extension module) and undo the hook; C extensions
act without raising events; writes through descriptors obtained before a check, races on symbolic links, and
os.mkfifo / os.mknod are not seen. There is no network namespace, seccomp filter or cgroup (they need privileges
this library does not assume). A program could also write "forbidden" or "memory" on its own verdict pipe: that
only changes which counter it lands in. Where a model's code is hostile, run the trainer under a user of its own
(not root, so RLIMIT_NPROC holds and file permissions guard the rest) or in a container without network.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import re
import select
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
KINDS = ("ok", "error", "timeout", "memory", "output", "forbidden", "killed")


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one program may use. `cpu_seconds` is rounded up to whole seconds (RLIMIT_CPU's unit); `output_bytes` is
  what comes back, and a program that prints more is stopped there (kind "output")."""
  cpu_seconds: float = 2.0
  wall_seconds: float = 4.0
  memory_bytes: int = 512 * 2**20
  output_bytes: int = 4096
  max_processes: int = 8  # processes and threads it may add (RLIMIT_NPROC; not for root: then only the hook)
  file_bytes: int = 16 * 2**20

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value < 0 or value == 0 and field.name != "max_processes":
        raise ValueError(f"Limits.{field.name} must be positive, got {value}")


@dataclasses.dataclass(frozen=True)
class Result:
  """How a program ended. kind: "ok" (exit status 0), "error" (an exception, a syntax error, a non-zero exit),
  "timeout" (CPU or wall clock), "memory" (a MemoryError ended it), "output" (it printed past the limit),
  "forbidden" (the sandbox refused an action), "killed" (a signal: the sandbox closed, or it crashed). output:
  its stdout and stderr together, cut at the limit with a note. exit_code: as Popen's (-N: signal N)."""
  output: str
  kind: str
  seconds: float
  exit_code: int


class _Running:
  """The processes of runs under way, so that `close` can kill them. A run leaves the set, under the lock, before
  its process is reaped: a reaped pid may be reused, and its group must never be signalled after that."""

  def __init__(self):
    self.lock = threading.Lock()
    self.processes: set[subprocess.Popen] = set()
    self.closed = False

  def add(self, process: subprocess.Popen):
    with self.lock:
      self.processes.add(process)
      if self.closed:
        kill_group(process.pid)

  def remove(self, process: subprocess.Popen):
    """Kills what is left of its group (grandchildren of a program that ended) and forgets it."""
    with self.lock:
      self.processes.discard(process)
      kill_group(process.pid)

  def close(self):
    with self.lock:
      self.closed = True
      for process in self.processes:
        kill_group(process.pid)


def kill_group(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):  # nothing left in it
    pass


def group_alive(pgid: int) -> bool:
  """Whether a process of group `pgid` still runs (zombies, dead but not yet reaped by init, do not count). Signal
  0 only asks: a group id reused meanwhile is never harmed."""
  try:
    os.killpg(pgid, 0)
  except (ProcessLookupError, PermissionError):
    return False
  for name in filter(str.isdigit, os.listdir("/proc")):  # rare: only after a program left a grandchild
    try:
      with open(f"/proc/{name}/stat") as f:
        state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
    except (OSError, ValueError):  # it ended meanwhile
      continue
    if int(group) == pgid and state not in ("Z", "X"):
      return True
  return False


def wait_for_group(pgid: int, timeout: float = 1.0):
  """After the kill and the leader's reaping: waits (at most `timeout` s) until no process of the group runs. A
  grandchild dies a moment after its SIGKILL, not at once."""
  deadline = time.monotonic() + timeout
  while group_alive(pgid) and time.monotonic() < deadline:
    time.sleep(0.005)


# The child starts without `site` (-S): reading the environment's .pth files (an editable install's import hook, a
# coverage hook) took 13 of a bare start's 20 ms of CPU, paid by every program (128 a step in the tool demo). It
# puts the interpreter's site-packages on its path itself (sandbox_child.py), so a program still imports numpy or
# sympy; what a .pth file alone adds (an editable install's packages) is not importable there.
SITE_PACKAGES_ENV = "PACS_SANDBOX_SITE_PACKAGES"


def child_env(work: str) -> dict[str, str]:
  """A minimal environment: no proxies or credentials of the host, home and temporary files in the work folder,
  one thread for the numeric libraries (each program is one of many running at once), the site-packages folders."""
  threads = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
  return {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8", "MPLBACKEND": "Agg",
          "PYTHONDONTWRITEBYTECODE": "1", SITE_PACKAGES_ENV: os.pathsep.join(site_packages()), **threads}


@functools.cache
def site_packages() -> tuple[str, ...]:
  """This interpreter's site-packages folders (a venv's, or the system's)."""
  return tuple(p for p in site.getsitepackages() if os.path.isdir(p))


def read_output(process: subprocess.Popen, cap: int, deadline: float) -> tuple[bytes, bool, bool]:
  """(output, flooded, timed out): reads the program's pipe until it exits, prints more than `cap` bytes or
  `deadline` passes (time.monotonic()). Its exit is seen on a pidfd, without reaping it."""
  out_fd, pidfd = process.stdout.fileno(), os.pidfd_open(process.pid)
  poller = select.poll()
  poller.register(out_fd, select.POLLIN)
  poller.register(pidfd, select.POLLIN)
  chunks, size, exited = [], 0, False
  try:
    while not exited:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return b"".join(chunks), False, True
      for fd, _ in poller.poll(remaining * 1000):
        if fd == pidfd:
          exited = True
        elif chunk := os.read(out_fd, 65536):
          chunks.append(chunk)
          size += len(chunk)
          if size > cap:
            return b"".join(chunks)[:cap + 1], True, False
        else:  # end of file: it closed its output; its exit comes on the pidfd
          poller.unregister(out_fd)
    return b"".join(chunks), False, False
  finally:
    os.close(pidfd)


def drain(fd: int, raw: bytes, cap: int) -> bytes:
  """`raw` and what is left in the pipe after the program exited (its group killed: no writer waits), up to cap + 1
  bytes in all."""
  os.set_blocking(fd, False)
  while len(raw) <= cap:
    try:
      chunk = os.read(fd, 65536)
    except BlockingIOError:  # a writer that left the group holds it open: stop here
      break
    if not chunk:
      break
    raw += chunk
  return raw[:cap + 1]


def read_verdict(fd: int) -> set[str]:
  """The words the child wrote on its verdict pipe ("forbidden", "memory"), read without waiting."""
  os.set_blocking(fd, False)
  data = b""
  try:
    while chunk := os.read(fd, 4096):
      data += chunk
  except BlockingIOError:
    pass
  return set(data.decode(errors="replace").split())


def classify(*, verdict: set[str], flooded: bool, timed_out: bool, exit_code: int, cpu_seconds: float,
             limits: Limits) -> str:
  """The kind of a run: a refused action first (it ended the program), then what the sandbox stopped it for."""
  if "forbidden" in verdict:
    return "forbidden"
  if flooded:
    return "output"
  # RLIMIT_CPU: SIGXCPU at the limit (whole seconds), SIGKILL a second later if the program ignores SIGXCPU.
  hard_limit = exit_code == -signal.SIGKILL and cpu_seconds >= math.ceil(limits.cpu_seconds)
  if timed_out or exit_code == -signal.SIGXCPU or hard_limit:
    return "timeout"
  if "memory" in verdict:
    return "memory"
  if exit_code == 0:
    return "ok"
  return "killed" if exit_code < 0 else "error"


def format_output(raw: bytes, cap: int) -> str:
  text = raw[:cap].decode("utf-8", errors="replace")
  return text + f"\n[output cut: more than {cap} bytes]\n" if len(raw) > cap else text


def run_program(code: str, limits: Limits = Limits(), running: _Running | None = None) -> Result:
  """Runs `code` in a fresh process under `limits` (see the module's docstring) and returns how it ended. The
  process group is killed and the work folder deleted before it returns."""
  running = running or _Running()
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="pacs-sandbox-", ignore_cleanup_errors=True) as root:
    work, program = os.path.join(root, "work"), os.path.join(root, "program.py")
    os.mkdir(work)
    with open(program, "w", encoding="utf-8") as f:
      f.write(code)
    verdict_fd, verdict_w = os.pipe()
    argv = [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", CHILD, work, str(verdict_w), str(limits.cpu_seconds),
            str(limits.memory_bytes), str(limits.file_bytes), str(limits.max_processes), str(os.getpid()), program]
    try:
      process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 cwd=work, env=child_env(work), start_new_session=True, pass_fds=(verdict_w,))
    except BaseException:
      os.close(verdict_fd)
      raise
    finally:
      os.close(verdict_w)
    try:
      running.add(process)
      try:
        raw, flooded, timed_out = read_output(process, limits.output_bytes, start + limits.wall_seconds)
      finally:
        running.remove(process)  # kills the group: a timed-out or flooding program, or what it left behind
      raw = drain(process.stdout.fileno(), raw, limits.output_bytes)
      _, status, usage = os.wait4(process.pid, 0)
      process.returncode = os.waitstatus_to_exitcode(status)
      wait_for_group(process.pid)
      verdict = read_verdict(verdict_fd)
    finally:
      process.stdout.close()
      os.close(verdict_fd)
  kind = classify(verdict=verdict, flooded=flooded, timed_out=timed_out, exit_code=process.returncode,
                  cpu_seconds=usage.ru_utime + usage.ru_stime, limits=limits)
  return Result(output=format_output(raw, limits.output_bytes), kind=kind, seconds=time.monotonic() - start,
                exit_code=process.returncode)


class Sandbox:
  """Runs programs concurrently, each in its own process driven by a worker thread, and counts how they ended.

    with Sandbox(Limits(cpu_seconds=2), max_workers=8) as sandbox:
      futures = [sandbox.submit(code) for code in programs]
      observations = [format_observation(f.result()) for f in futures]
      metrics.update({f"tool/{kind}": n for kind, n in sandbox.stats().items()})

  `close` (or leaving the `with`) kills every program still running (kind "killed") and cancels those waiting."""

  def __init__(self, limits: Limits = Limits(), max_workers: int = 4):
    if max_workers <= 0:
      raise ValueError(f"max_workers must be positive, got {max_workers}")
    self.limits = limits
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="sandbox")
    self._running = _Running()
    self._counts = collections.Counter()
    self._counts_lock = threading.Lock()

  def _run(self, code: str) -> Result:
    result = run_program(code, self.limits, self._running)
    with self._counts_lock:
      self._counts[result.kind] += 1
    return result

  def submit(self, code: str) -> concurrent.futures.Future[Result]:
    if self._running.closed:
      raise RuntimeError("the sandbox is closed")
    return self._pool.submit(self._run, code)

  def run(self, code: str) -> Result:
    return self.submit(code).result()

  def stats(self) -> dict[str, int]:
    """How many runs ended in each kind so far (every kind named, zeros included)."""
    with self._counts_lock:
      return {kind: self._counts[kind] for kind in KINDS}

  def close(self):
    self._running.close()
    self._pool.shutdown(wait=True, cancel_futures=True)

  def __enter__(self) -> Sandbox:
    return self

  def __exit__(self, *exc):
    self.close()


_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
  """The last closed ```python (or ```py) block of a model's turn, or None. A block left open (a turn cut at the
  token limit) is no program."""
  blocks = _CODE_BLOCK.findall(text)
  return blocks[-1] if blocks else None


_FAILURES = {
    "error": "the program ended with an error",
    "timeout": "the program ran past its time limit and was stopped",
    "memory": "the program ran out of memory",
    "output": "the program printed more than the output limit and was stopped",
    "forbidden": "the sandbox refused an action (no network, no new processes, no writes outside its folder)",
    "killed": "the program was killed",
}


def format_observation(result: Result) -> str:
  """The text returned to the model: the output in an ```output block, and for a failure its kind, named."""
  text = result.output if not result.output or result.output.endswith("\n") else result.output + "\n"
  if result.kind != "ok":
    text += f"[{result.kind}: {_FAILURES[result.kind]}]\n"
  return f"```output\n{text}```\n"
