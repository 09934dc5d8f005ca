"""What a sandbox process runs first (`python -I -S -B -u sandbox_child.py WORK VERDICT_FD CPU MEMORY FILE PROCESSES
HOST_PID PROGRAM`, started by envs/sandbox.py): it dies with its host (the process that started it), lowers its
resource limits, installs an audit hook that refuses the network, new processes, signals and writes outside WORK,
then runs PROGRAM's code as `__main__`. A refused action or a MemoryError is reported on the verdict pipe, apart
from the program's output. Standard library only, and no import of pacs_jax: it runs first in a fresh interpreter,
in a process of its own."""

from __future__ import annotations

import builtins
import math
import os
import resource
import sys
import types

PROGRAM = "<program>"  # the code's file name in its tracebacks

# Modules the program's own code may not import (a library it uses may: numpy loads ctypes, sympy subprocess). An
# import is only the first line of defence: what the modules do (connect, start a process) is refused below too.
BLOCKED_MODULES = frozenset({
    "socket", "_socket", "ssl", "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "ctypes",
    "_ctypes", "cffi", "pty", "urllib", "http", "ftplib", "smtplib", "poplib", "imaplib", "telnetlib", "xmlrpc",
    "webbrowser", "requests", "httpx", "urllib3", "aiohttp",
})
# Audit events refused whoever raises them, with the reason the program is told.
NETWORK = "the sandbox has no network"
PROCESSES = "the program may not start or signal processes"
LIMITS = "the program may not change its limits"
C_CALLS = "the program may not call C functions"
REFUSED_EVENTS = {
    "os.fork": PROCESSES, "os.forkpty": PROCESSES, "os.system": PROCESSES, "os.exec": PROCESSES,
    "os.posix_spawn": PROCESSES, "os.spawn": PROCESSES, "subprocess.Popen": PROCESSES, "pty.spawn": PROCESSES,
    "os.kill": PROCESSES, "os.killpg": PROCESSES, "signal.pthread_kill": PROCESSES,
    "resource.setrlimit": LIMITS, "resource.prlimit": LIMITS,
    "ctypes.dlsym": C_CALLS, "ctypes.dlsym/handle": C_CALLS, "ctypes.call_function": C_CALLS,
    "urllib.Request": NETWORK, "webbrowser.open": NETWORK,
}
# Audit events that write a path: {event: ((index of a path argument, index of its dir_fd argument or None), ...)}.
# Both ends of a rename or hard link count (a link to an outside file would let the program write that file).
WRITE_EVENTS = {
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.chflags": ((0, None),), "os.lchflags": ((0, None),),
    "os.lchmod": ((0, None),), "os.link": ((0, 2), (1, 3)), "os.mkdir": ((0, 2),), "os.remove": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)), "os.rmdir": ((0, 1),), "os.symlink": ((1, 2),), "os.truncate": ((0, None),),
    "os.utime": ((0, 3),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
    "shutil.copyfile": ((1, None),), "shutil.copymode": ((1, None),), "shutil.copystat": ((1, None),),
    "shutil.copytree": ((1, None),), "shutil.move": ((0, None), (1, None)), "shutil.rmtree": ((0, 1),),
    "shutil.chown": ((0, None),), "shutil.make_archive": ((0, None),), "shutil.unpack_archive": ((1, None),),
    "tempfile.mkstemp": ((0, None),), "tempfile.mkdtemp": ((0, None),), "sqlite3.connect": ((0, None),),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
HARMLESS_PATHS = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})


def tell(fd: int, text: str):
  """Writes `text` on `fd` (stderr, the verdict pipe) by the system call: nothing the program replaced is used."""
  try:
    os.write(fd, text.encode(errors="replace"))
  except OSError:  # the program closed it
    pass


def user_tasks(uid: int) -> int:
  """The processes and threads of `uid` now: what the kernel counts against RLIMIT_NPROC."""
  count = 0
  for name in os.listdir("/proc"):
    try:
      if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
        with open(f"/proc/{name}/stat", "rb") as f:
          count += int(f.read().rsplit(b")", 1)[1].split()[17])  # field 20, num_threads
    except (OSError, IndexError, ValueError):  # the process ended meanwhile
      pass
  return count


def die_with_the_host(host_pid: int):
  """SIGKILL this process when the thread that started it ends (prctl PR_SET_PDEATHSIG; the sandbox's thread waits
  for it to end first), so that a host killed with SIGKILL, its wall clock gone with it, leaves no program running;
  exits at once if the host is already gone. Runs before the audit hook, which would refuse its C call."""
  import ctypes
  import signal
  pr_set_pdeathsig = 1
  if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
    tell(2, f"sandbox: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); the program would outlive its "
            "host\n")
    os._exit(1)
  if os.getppid() != host_pid:  # the host died before the call above
    os._exit(1)


def set_limits(cpu_seconds: float, memory_bytes: int, file_bytes: int, processes: int):
  """CPU time (SIGXCPU at the limit, SIGKILL one second later), address space, file size, no core file, and the
  user's tasks now plus `processes` (RLIMIT_NPROC counts per user; the kernel does not apply it to root)."""
  cpu = max(1, math.ceil(cpu_seconds))
  resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
  resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
  resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  if os.getuid() != 0:
    tasks = user_tasks(os.getuid()) + processes
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))


class Guard:
  """The audit hook: refuses network, processes, signals, C calls, writes outside `work` and the program's imports
  of BLOCKED_MODULES. A refusal ends the program at once (it cannot be caught): the reason on stderr, "forbidden"
  on the verdict pipe, exit status 1."""

  def __init__(self, work: str, verdict_fd: int):
    self.work, self.verdict_fd = os.path.realpath(work), verdict_fd

  def owned(self, filename: str) -> bool:
    """Whether code of this file is the program's: its own, what it exec'd, or a module it wrote in its folder."""
    return filename in (PROGRAM, "<string>") or filename.startswith(self.work + os.sep)

  def inside(self, path, dir_fd=None) -> bool:
    """Whether writing `path` (relative to `dir_fd` where one is given) stays in the work folder, symbolic links
    resolved. An int is a descriptor already open: its opening was checked."""
    if isinstance(path, int):
      return True
    path = os.fsdecode(path)
    if path in HARMLESS_PATHS:
      return True
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
      path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    real = os.path.realpath(path)
    return real == self.work or real.startswith(self.work + os.sep)

  def refuse(self, what: str, why: str):
    frame, line = sys._getframe(1), None
    while frame is not None and line is None:
      line = frame.f_lineno if frame.f_code.co_filename == PROGRAM else None
      frame = frame.f_back
    where = f'  File "{PROGRAM}", line {line}\n' if line else ""
    tell(2, f"{where}Forbidden: {what}: {why}\n")
    tell(self.verdict_fd, "forbidden\n")
    os._exit(1)

  def __call__(self, event: str, args: tuple):
    if event in REFUSED_EVENTS:
      self.refuse(event, REFUSED_EVENTS[event])
    elif event.startswith("socket."):
      self.refuse(event, NETWORK)
    elif event == "open":
      self.check_open(*args[:3])
    elif event == "ctypes.dlopen" and args[0] is not None:  # None: the interpreter itself (ctypes' own import)
      self.refuse(event, "the program may not load C libraries")
    elif event == "sqlite3.connect" and str(args[0]).startswith("file:"):  # a URI: its path is not args[0]
      self.refuse(event, "the program may not open a database by URI")
    elif event in WRITE_EVENTS:
      for path_at, dir_fd_at in WRITE_EVENTS[event]:
        if path_at < len(args) and not self.inside(args[path_at], None if dir_fd_at is None else args[dir_fd_at]):
          self.refuse(f"{event} {args[path_at]!r}", "the program may write only inside its working folder")

  def check_open(self, path, mode, flags):
    writes = flags & WRITE_FLAGS if isinstance(flags, int) else any(c in (mode or "") for c in "wax+")
    if not self.inside(path):
      if writes:
        self.refuse(f"open {path!r} for writing", "the program may write only inside its working folder")
      elif os.path.isdir(path):  # a folder's descriptor, as dir_fd, would let os.open(name, dir_fd=) escape
        self.refuse(f"open folder {path!r}", "the program may not open folders outside its working folder")


# The program's source for tracebacks, put into linecache's cache once something imports linecache (traceback and
# warnings do): importing it (with tokenize and re) up front took 8 of the child's 23 ms of CPU, paid by every program.
_SOURCE: list[str] = []


def share_source() -> None:
  """The program's lines in linecache's cache (tracebacks show them), once linecache is loaded."""
  cache = getattr(sys.modules.get("linecache"), "cache", None)  # (None while linecache itself is being imported)
  if _SOURCE and isinstance(cache, dict) and PROGRAM not in cache:
    cache[PROGRAM] = (len(_SOURCE[0]), None, _SOURCE[0].splitlines(True), PROGRAM)


def guarded_import(guard: Guard, real_import):
  """`__import__` that refuses the program's own imports of BLOCKED_MODULES, also of modules a library already
  loaded (which raise no "import" audit event). `importlib.import_module` goes around it: the events still hold."""
  def __import__(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.partition(".")[0] in BLOCKED_MODULES and guard.owned(sys._getframe(1).f_code.co_filename):
      guard.refuse(f"import {name}", "the module is not available in the sandbox")
    module = real_import(name, globals, locals, fromlist, level)
    share_source()
    return module
  return __import__


def refuse_spawn(guard: Guard):
  """`_posixsubprocess.fork_exec` (subprocess's and multiprocessing's way to start a program) raises no audit event
  of its own: replaced by a refusal."""
  import _posixsubprocess  # noqa: PLC0415 -- only here, in the sandbox's process

  def fork_exec(*args, **kwargs):
    guard.refuse("_posixsubprocess.fork_exec", PROCESSES)
  _posixsubprocess.fork_exec = fork_exec


def report(error: BaseException):
  """The program's traceback on stderr, without this file's frame."""
  tb = error.__traceback__.tb_next if error.__traceback__ else None
  try:
    import traceback  # noqa: PLC0415 -- on a failure only (see _SOURCE)
    share_source()
    traceback.print_exception(type(error), error, tb)
  except MemoryError:
    tell(2, f"{type(error).__name__}\n")


def run(source: str, verdict_fd: int) -> int:
  """Runs `source` as `__main__`; the exit status. A MemoryError that ends the program is named on the verdict pipe
  (its memory freed first, so the traceback can be printed)."""
  _SOURCE.append(source)  # tracebacks show its lines
  share_source()
  main = types.ModuleType("__main__")
  main.__builtins__ = builtins
  sys.modules["__main__"], sys.argv = main, [PROGRAM]
  try:
    exec(compile(source, PROGRAM, "exec"), main.__dict__)
  except SystemExit:
    raise
  except MemoryError as error:
    tell(verdict_fd, "memory\n")
    main.__dict__.clear()
    tb = error.__traceback__  # its frames' locals freed too (traceback.clear_frames, before importing anything)
    while tb is not None:
      try:
        tb.tb_frame.clear()
      except RuntimeError:  # a frame still running: this one
        pass
      tb = tb.tb_next
    report(error)
    return 1
  except BaseException as error:  # noqa: BLE001 -- the program's failure, reported as Python would
    report(error)
    return 1
  return 0


def without_site_hooks() -> None:
  """What `site` would have given a program, but its .pth files (started with -S: envs/sandbox.py): the
  site-packages folders on the path (numpy, sympy), and `exit`, `quit`, `help` and the copyright notices."""
  import site
  sys.path.extend(p for p in os.environ.get("PACS_SANDBOX_SITE_PACKAGES", "").split(os.pathsep) if p)
  site.setquit()
  site.setcopyright()
  site.sethelper()


def main(argv: list[str]) -> int:
  work, verdict_fd, cpu, memory, file_bytes, processes, host_pid, program = argv[1:]
  die_with_the_host(int(host_pid))
  if sys.flags.no_site:
    without_site_hooks()
  with open(program, encoding="utf-8") as f:
    source = f.read()
  set_limits(float(cpu), int(memory), int(file_bytes), int(processes))
  guard = Guard(work, int(verdict_fd))
  sys.addaudithook(guard)
  builtins.__import__ = guarded_import(guard, builtins.__import__)
  refuse_spawn(guard)
  return run(source, int(verdict_fd))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
