"""The sandbox of tool-integrated RL (envs/sandbox.py, issue 43): each hostile program ends as a counted kind within
its limit, the sandbox goes on running programs, no process of the run is left and nothing is written outside its
folder; programs run concurrently; extract_code and format_observation."""

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from pacs_jax.envs import sandbox as sandbox_lib
from pacs_jax.envs.sandbox import Limits, Result, Sandbox, extract_code, format_observation, run_program
from tests.processes import live_processes

LIMITS = Limits(cpu_seconds=1, wall_seconds=2)
MARGIN = 1.5  # seconds past a limit: starting the process and killing it, on a busy 2-core machine
QUICK = 1.0  # a refused action or a failed allocation ends the program at once: well before any limit
PID = "import os\nprint('pid', os.getpid(), flush=True)\n"  # hostile programs name their process first
NORMAL = "print(sum(range(10)))"


def started_here(process: tuple[int, int, int, int, str]) -> bool:
  """Whether `process` is a sandbox process this test process started (other test workers' are not ours)."""
  return process[1] == os.getpid() and sandbox_lib.CHILD in process[4]


def left_behind(pid: int | None = None) -> list[tuple[int, int, int, int, str]]:
  """Live processes of a run whose process was `pid`: in its session or group (it leads both, and whatever it
  forked stays in them unless it escapes the hook and leaves), and any sandbox process started here (every run
  has ended by now: each is reaped before its result returns)."""
  return [p for p in live_processes() if pid is not None and pid in (p[0], p[2], p[3]) or started_here(p)]


def run_pid(result: Result) -> int:
  first = result.output.split("\n", 1)[0].split()
  assert first[:1] == ["pid"], result
  return int(first[1])


@pytest.fixture
def sandbox():
  with Sandbox(LIMITS, max_workers=8) as box:
    yield box
  assert not left_behind()


def assert_contained(sandbox: Sandbox, code: str, kind: str, within: float) -> Result:
  """Runs `code`: it ends as `kind` within `within` seconds and leaves no process; then a normal program runs."""
  result = sandbox.run(code)
  assert result.kind == kind, result
  assert result.seconds < within, result
  assert not left_behind(run_pid(result) if code.startswith(PID) else None)
  after = sandbox.run(NORMAL)
  assert (after.kind, after.output) == ("ok", "45\n"), after
  return result


def test_a_normal_program(sandbox):
  result = sandbox.run(NORMAL)
  assert (result.output, result.kind, result.exit_code) == ("45\n", "ok", 0)
  assert sandbox.stats() == {"ok": 1, "error": 0, "timeout": 0, "memory": 0, "output": 0, "forbidden": 0,
                             "killed": 0}


def test_the_math_libraries_work():
  code = ("import math, fractions, itertools, numpy as np, sympy\n"
          "print(math.comb(5, 2), fractions.Fraction(1, 3) * 3, len(list(itertools.permutations(range(3)))),\n"
          "      int(np.arange(5).sum()), sympy.factorint(360))")
  result = run_program(code, Limits())  # sympy's import takes ~0.5 s of CPU: the default limits
  assert (result.kind, result.output) == ("ok", "10 1 6 10 {2: 3, 3: 2, 5: 1}\n"), result


def test_the_child_starts_without_site_yet_has_the_libraries_and_the_builtins_site_gives(sandbox):
  """The child skips `site` (its .pth files: 13 of a start's 20 ms of CPU) and imports linecache and traceback only
  when something needs them; a program sees site-packages, exit / quit / help, and its own lines in tracebacks,
  its own traceback.print_exc's included."""
  probe = sandbox.run("import sys\nprint(sys.flags.no_site, 'linecache' in sys.modules, 'traceback' in sys.modules)")
  assert probe.output == "1 False False\n", probe
  assert sandbox.run("import numpy\nprint(callable(help), callable(quit))\nexit(3)").exit_code == 3
  assert sandbox.run("print(callable(help), callable(quit))").output == "True True\n"
  caught = sandbox.run("import traceback\ntry:\n  1 / 0\nexcept ZeroDivisionError:\n  traceback.print_exc()")
  assert caught.kind == "ok" and 'File "<program>", line 3' in caught.output and "    1 / 0\n" in caught.output, caught
  raised = sandbox.run("x = 1\ny = x / 0")
  assert raised.output.startswith('Traceback (most recent call last):\n  File "<program>", line 2, in <module>\n'
                                  "    y = x / 0\n"), raised


def test_an_infinite_loop_times_out(sandbox):
  assert_contained(sandbox, PID + "while True: pass", "timeout", LIMITS.wall_seconds + MARGIN)


def test_a_program_that_ignores_sigxcpu_or_sleeps_still_times_out(sandbox):
  ignore = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
  assert_contained(sandbox, PID + ignore, "timeout", LIMITS.wall_seconds + MARGIN)
  assert_contained(sandbox, PID + "import time\ntime.sleep(60)", "timeout", LIMITS.wall_seconds + MARGIN)


@pytest.mark.parametrize("bomb", [
    "while True: os.fork()",
    "import multiprocessing\nwhile True: multiprocessing.Process(target=print).start()",
    "import subprocess\nsubprocess.run(['sleep', '60'])",
    "os.system('sleep 60')",
    "os.posix_spawn('/bin/sleep', ['sleep', '60'], {})",
    "import concurrent.futures\nwith concurrent.futures.ProcessPoolExecutor(2) as pool: list(pool.map(abs, [1]))",
    "import importlib\nimportlib.import_module('subprocess').Popen(['sleep', '60'])",  # not by an import statement
    "import concurrent.futures.process as p\np.mp.get_context('spawn').Process(target=print).start()",
    "os.kill(os.getppid(), 9)",  # the host itself
], ids=["fork", "multiprocessing", "subprocess", "system", "posix_spawn", "process_pool", "import_module", "spawn",
        "kill_the_host"])
def test_a_fork_bomb_or_a_spawn_is_forbidden(sandbox, bomb):
  result = assert_contained(sandbox, PID + bomb, "forbidden", QUICK)
  assert "Forbidden: " in result.output  # the import of a blocked module, or the process itself


def test_a_process_started_past_the_hook_dies_with_the_group():
  """The audit hook is no boundary (a fresh copy of _posixsubprocess starts a process unseen); the process group
  kill after the run is: the grandchild, alive after its parent ended, does not outlive the run."""
  code = PID + ("import sys, importlib\n"
                "del sys.modules['_posixsubprocess']\nimportlib.import_module('_posixsubprocess')\n"
                "util = importlib.import_module('multiprocessing.util')\n"
                "print('grandchild', util.spawnv_passfds(b'/bin/sleep', [b'sleep', b'60'], ()), flush=True)")
  result = run_program(code, LIMITS)
  if result.kind == "forbidden":
    pytest.skip("this way past the hook is closed now: find another to test the group kill")
  assert result.kind == "ok" and "grandchild" in result.output, result
  grandchild = int(result.output.split("grandchild")[1].split()[0])
  assert not left_behind(run_pid(result))
  assert grandchild not in [p[0] for p in live_processes()]


# The memory bombs run with 5 s of CPU, not 1: filling 512 MiB a block at a time (each zeroed, so written) took more
# than 1 s of CPU on CI's busy 2-core machine (stop 48: "timeout", not "memory"), and this test is about memory.
MEMORY_LIMITS = dataclasses.replace(LIMITS, cpu_seconds=5, wall_seconds=6)


@pytest.mark.parametrize("bomb", ["x = bytearray(10**10)", "x = []\nwhile True: x.append(' ' * 10**6)",
                                  "import numpy as np\nx = np.ones((10**5, 10**5))"], ids=["one", "growing", "numpy"])
def test_a_memory_bomb_runs_out_of_memory(bomb):
  with Sandbox(MEMORY_LIMITS, max_workers=2) as sandbox:
    result = assert_contained(sandbox, PID + bomb, "memory", MEMORY_LIMITS.cpu_seconds)
  assert not left_behind()
  assert "MemoryError" in result.output


def test_an_output_flood_is_cut(sandbox):
  result = assert_contained(sandbox, PID + "while True: print('x' * 1000)", "output", QUICK)
  assert result.output.endswith(f"\n[output cut: more than {LIMITS.output_bytes} bytes]\n")
  assert len(result.output.encode()) <= LIMITS.output_bytes + 50
  assert result.exit_code == -9  # stopped by the sandbox


def test_a_syntax_error_is_an_error_with_its_traceback(sandbox):
  result = assert_contained(sandbox, "x = 1\nprint((x, 2)\n", "error", QUICK)
  assert result.output.splitlines()[:2] == ['  File "<program>", line 2', "    print((x, 2)"]
  assert result.output.splitlines()[-1] == "SyntaxError: '(' was never closed"
  assert result.exit_code == 1


def test_an_exception_keeps_the_output_before_it_in_order(sandbox):
  result = assert_contained(sandbox, "print('before')\n1 / 0", "error", QUICK)
  assert result.output.startswith("before\nTraceback (most recent call last):\n")
  assert '  File "<program>", line 2, in <module>\n    1 / 0\n' in result.output
  assert result.output.endswith("\nZeroDivisionError: division by zero\n")
  assert sandbox.run("import sys\nsys.exit(3)").kind == "error"


@pytest.mark.parametrize("module", ["socket", "ctypes", "urllib.request", "http.client", "subprocess"])
def test_a_forbidden_import(sandbox, module):
  result = assert_contained(sandbox, PID + f"import {module}", "forbidden", QUICK)
  assert f"Forbidden: import {module}: the module is not available in the sandbox" in result.output


@pytest.mark.parametrize("attempt", [
    "import asyncio\nasyncio.run(asyncio.open_connection('127.0.0.1', 80))",  # socket imported by a library
    "import importlib\nimportlib.import_module('socket').create_connection(('127.0.0.1', 80))",
    "import importlib\nimportlib.import_module('socket').getaddrinfo('example.com', 80)",
], ids=["asyncio", "socket", "dns"])
def test_a_network_attempt_is_forbidden(sandbox, attempt):
  result = assert_contained(sandbox, PID + attempt, "forbidden", QUICK)
  assert "the sandbox has no network" in result.output


@pytest.mark.parametrize("write", [
    "open({new!r}, 'w').write('x')",
    "import pathlib\npathlib.Path({new!r}).write_text('x')",
    "os.close(os.open({new!r}, os.O_CREAT | os.O_WRONLY))",
    "os.symlink({outside!r}, 'link')\nopen('link/new.txt', 'w')",  # a link in the folder to outside
    "os.link({keep!r}, 'mine')\nopen('mine', 'a').write('x')",  # a hard link would share the file
    "fd = os.open({outside!r}, os.O_RDONLY)\nos.open('new.txt', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
    "os.chdir({outside!r})\nopen('new.txt', 'w')",
    "os.remove({keep!r})",
    "os.rename({keep!r}, 'mine')",
    "import shutil\nshutil.rmtree({outside!r})",
    "import sqlite3\nsqlite3.connect({new!r})",
], ids=["open", "pathlib", "os_open", "symlink", "hard_link", "dir_fd", "chdir", "remove", "rename", "rmtree",
        "sqlite"])
def test_a_write_outside_the_folder_is_forbidden(sandbox, tmp_path, write):
  outside, keep, new = tmp_path / "outside", tmp_path / "outside" / "keep.txt", tmp_path / "outside" / "new.txt"
  outside.mkdir()
  keep.write_text("kept")
  code = PID + write.format(outside=str(outside), keep=str(keep), new=str(new))
  result = assert_contained(sandbox, code, "forbidden", QUICK)
  assert "Forbidden: " in result.output
  assert sorted(os.listdir(outside)) == ["keep.txt"] and keep.read_text() == "kept"


def test_files_inside_its_own_folder_are_allowed_and_deleted_after(sandbox):
  code = ("import os, tempfile, pathlib\n"
          "pathlib.Path('a.txt').write_text('hi')\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
          "with tempfile.NamedTemporaryFile('w') as f: f.write('x')\n"  # TMPDIR is its folder
          "print(open('d/b.txt').read())\nprint(sorted(os.listdir('.')))\nprint(os.getcwd())\n"
          "print(os.environ['HOME'] == os.getcwd() == tempfile.gettempdir())")
  result = sandbox.run(code)
  assert result.kind == "ok", result
  text, listing, folder, home = result.output.splitlines()
  assert (text, listing, home) == ("hi", "['d']", "True")
  assert not os.path.exists(folder)


def test_a_big_file_is_cut_at_the_file_limit():
  result = run_program("open('big', 'wb').write(b'x' * 2**20)", Limits(cpu_seconds=1, wall_seconds=2, file_bytes=2**16))
  assert result.kind == "error" and "OSError: [Errno 27] File too large" in result.output, result


def test_programs_run_concurrently_and_loops_end_within_one_wall_limit(sandbox):
  start = time.monotonic()
  futures = [sandbox.submit("while True: pass" if i % 2 else f"print({i} * 2)") for i in range(8)]
  results = [f.result() for f in futures]
  assert time.monotonic() - start < LIMITS.wall_seconds + MARGIN  # 4 loops at once: one limit, not four
  assert [r.kind for r in results] == ["ok", "timeout"] * 4
  assert [r.output for r in results[::2]] == ["0\n", "4\n", "8\n", "12\n"]
  assert sandbox.stats() == {"ok": 4, "error": 0, "timeout": 4, "memory": 0, "output": 0, "forbidden": 0,
                             "killed": 0}


def test_closing_kills_what_runs_and_cancels_what_waits():
  box = Sandbox(Limits(cpu_seconds=30, wall_seconds=30), max_workers=1)
  running, waiting = box.submit(PID + "import time\ntime.sleep(60)"), box.submit(NORMAL)
  deadline = time.monotonic() + 10
  while not any(map(started_here, live_processes())) and time.monotonic() < deadline:
    time.sleep(0.02)
  time.sleep(0.3)  # its process has started: let it print its pid and reach the sleep
  start = time.monotonic()
  box.close()
  assert time.monotonic() - start < MARGIN
  result = running.result()
  assert result.kind == "killed" and result.exit_code == -9, result
  assert waiting.cancelled()
  assert not left_behind(run_pid(result))
  with pytest.raises(RuntimeError, match="closed"):
    box.submit(NORMAL)


def test_a_crash_is_killed(sandbox):
  assert_contained(sandbox, "import signal\nsignal.raise_signal(signal.SIGSEGV)", "killed", QUICK)


@pytest.mark.parametrize("field", ["cpu_seconds", "wall_seconds", "memory_bytes", "output_bytes", "file_bytes"])
def test_limits_must_be_positive(field):
  with pytest.raises(ValueError, match=field):
    Limits(**{field: 0})


def test_extract_code_takes_the_last_closed_python_block():
  turn = ("Let me compute.\n```python\nprint(1)\n```\nThat gave 1. Again:\n```py\nx = 2\nprint(x)\n```\n"
          "and an unfinished one:\n```python\nprint(3")
  assert extract_code(turn) == "x = 2\nprint(x)\n"
  assert extract_code("no code here, nor ```bash\nls\n```") is None
  assert extract_code("```python\nprint(1)") is None  # cut at the token limit: no program


def test_format_observation_names_the_failure():
  assert format_observation(Result("45\n", "ok", 0.1, 0)) == "```output\n45\n```\n"
  assert format_observation(Result("", "ok", 0.1, 0)) == "```output\n```\n"
  timeout = format_observation(Result("partial", "timeout", 2.0, -9))
  assert timeout == "```output\npartial\n[timeout: the program ran past its time limit and was stopped]\n```\n"
  for kind in sandbox_lib.KINDS[1:]:
    assert f"[{kind}: " in format_observation(Result("", kind, 0.0, 1))


def test_a_host_killed_with_sigkill_leaves_no_program():
  """The process running a sandbox dies by SIGKILL mid-program (a trainer killed mid-conversation): its wall clock
  dies with it, yet the sleeping program does not outlive it (PR_SET_PDEATHSIG)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  code = ("from pacs_jax.envs.sandbox import Limits, run_program\n"
          "run_program('import time\\ntime.sleep(60)', Limits(cpu_seconds=60, wall_seconds=60))")
  host = subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root})
  try:
    deadline = time.monotonic() + 30
    while not (programs := [p[0] for p in live_processes() if p[1] == host.pid and sandbox_lib.CHILD in p[4]]):
      assert host.poll() is None and time.monotonic() < deadline, "the host started no sandbox process"
      time.sleep(0.05)
    time.sleep(0.5)  # past its start: sleeping in the program
  finally:
    host.kill()
    host.wait()
  deadline = time.monotonic() + 5
  while programs[0] in [p[0] for p in live_processes()]:
    assert time.monotonic() < deadline, "the program outlived its host"
    time.sleep(0.05)
