"""The one place that turns an expected failure (config, data, checkpoint, lock, disk, storage) into one line on
stderr naming the thing, its path and the cause, with an exit status per kind; the traceback goes to a log file.

The command lines run through `run(prog, main)`. A failure that is not one of the expected kinds is a bug: its
traceback is printed whole, as before.
"""

from __future__ import annotations

import _thread
import dataclasses
import errno
import logging as std_logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable

from absl import app, flags, logging

# Exit statuses, one per kind of failure (docs/training.md's table).
EXIT_USAGE = 1  # absl's for a usage error (an unknown flag, a flag's value of the wrong type), and Python's for a bug
EXIT_INPUT = 2  # a required flag not given, a missing or unreadable file or directory given, an occupied --out
EXIT_CONFIG = 3  # a config file that fails, an unknown field, a value out of range or of the wrong type, no prompt fits
EXIT_DATA = 4  # a data file that cannot be read, rows that are malformed
EXIT_CHECKPOINT = 5  # no checkpoint restores, or it belongs to another run (algorithm, model, tokenizer)
EXIT_LOCKED = 6  # another trainer holds the workdir
EXIT_STORAGE = 7  # a save or write failed: a full or read-only disk, an unreachable store
EXIT_UNHEALTHY = 8  # training died or diverged (services/health.py): stopped before saving
EXIT_INTERRUPTED = 130  # Ctrl-C before training began, or a second one during it (a shell's 128 + SIGINT)

LOG_FILE = "errors.log"  # in the workdir: the traceback of each failure, appended

_VERBOSE = flags.DEFINE_bool("verbose", False, "On an expected failure print the whole traceback, not one line.")

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


@dataclasses.dataclass(frozen=True)
class Failure:
  status: int
  message: str


class InputError(ValueError):
  """A command-line input that names nothing usable (e.g. a data set name without --data_dir): EXIT_INPUT."""


_log_dir: str | None = None
_watched: list[str] = []  # remote locations whose outage explains a failure (watch_storage)
_held_records: list[std_logging.LogRecord] = []


def log_to(directory: str) -> None:
  """Where the traceback of a failure goes (a workdir, once it exists; else a temporary file)."""
  global _log_dir
  from pacs_jax import paths
  _log_dir = paths.normalize(directory)


def watch_storage(*locations: str | None) -> None:
  """Locations a command reads or writes besides its workdir (export's and evaluate's --workdir, --model, --out):
  a failure while the object store of a `gs://` one does not answer is named as that outage."""
  from pacs_jax import paths
  _watched.extend(paths.normalize(p) for p in locations if p and paths.is_remote(p))


def _causes(e: BaseException) -> list[BaseException]:
  """`e` and the exceptions of its explicit `raise ... from` chain, outermost first."""
  seen = [e]
  while seen[-1].__cause__ is not None and seen[-1].__cause__ not in seen:
    seen.append(seen[-1].__cause__)
  return seen



def first_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[0] if lines else type(e).__name__


def classify(e: BaseException) -> Failure | None:
  """The exit status and the line to print for an expected failure; None for a bug."""
  from pacs_jax import config, paths
  from pacs_jax.data import sources
  from pacs_jax.models import hf
  from pacs_jax.storage import checkpoint, lock
  from pacs_jax.services import health

  if isinstance(e, health.Unhealthy):
    return Failure(EXIT_UNHEALTHY, str(e))
  if isinstance(e, config.ConfigError):
    return Failure(EXIT_CONFIG, str(e))
  if isinstance(e, (InputError, hf.WeightsMismatch)):
    return Failure(EXIT_INPUT, str(e))
  if isinstance(e, sources.DataError):
    return Failure(EXIT_DATA, str(e))
  if isinstance(e, lock.WorkdirLocked):
    return Failure(EXIT_LOCKED, str(e))
  if isinstance(e, (checkpoint.CheckpointMismatch, hf.NonFiniteWeights)):
    return Failure(EXIT_CHECKPOINT, str(e))
  if isinstance(e, paths.StorageError):
    return Failure(EXIT_STORAGE, str(e))
  root = next((link for link in _causes(e) if isinstance(link, OSError) and link.errno in _DISK_ERRNOS), None)
  if root is not None:
    where = root.filename or ""
    return Failure(EXIT_STORAGE, f"{where + ': ' if where else ''}{os.strerror(root.errno)}")
  unreachable = _unreachable_storage(e)
  if unreachable:
    return Failure(EXIT_STORAGE, unreachable)
  if isinstance(e, checkpoint.NoRestorableCheckpoint):
    return Failure(EXIT_CHECKPOINT, str(e))
  if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)):
    return Failure(EXIT_INPUT, first_line(e) if not e.filename else f"{e.filename}: {e.strerror or first_line(e)}")
  return None


def _unreachable_storage(e: BaseException) -> str | None:
  """`<workdir>: storage unreachable (<cause>); ...` when the remote workdir's store does not answer now (asked
  again: the error itself is often a side effect, a directory that "does not exist", a closed handle), or `e` was
  caused by a failed connection (the store may answer again by now)."""
  from pacs_jax import paths
  for location in ([_log_dir] if _log_dir and paths.is_remote(_log_dir) else []) + _watched:
    cause = paths.unreachable(location) or _connection_failure(e)
    if cause:
      return f"{location}: storage unreachable ({cause}); rerun the same command to resume"
  return None


def _connection_failure(e: BaseException) -> str | None:
  """The cause of the first failed connection (refused, reset, timed out) in `e`'s chain, else None."""
  chain, link = [], e
  while link is not None and link not in chain:
    chain.append(link)
    link = link.__cause__ or link.__context__
  for link in chain:
    if isinstance(link, (ConnectionError, TimeoutError)):
      return (os.strerror(link.errno) if link.errno else None) or first_line(link)
  return None


def _write_log(prog: str, text: str) -> str | None:
  """Appends `text` to the workdir's log file (a temporary file if the workdir is missing or unwritable)."""
  from pacs_jax import paths
  stamp = time.strftime("%Y-%m-%d %H:%M:%S")
  entry = f"--- {prog} failed at {stamp} (pid {os.getpid()}) ---\n{text}\n"
  if _log_dir and not paths.is_remote(_log_dir) and os.path.isdir(_log_dir):
    target = os.path.join(_log_dir, LOG_FILE)
    try:
      with open(target, "a", encoding="utf-8") as f:
        f.write(entry)
      return target
    except OSError:
      pass  # a full disk is a reason to be here: fall back to the temporary folder
  try:
    fd, target = tempfile.mkstemp(prefix=f"pacs_jax_{prog}_", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(entry)
    return target
  except OSError:
    return None


class _HoldLibraryErrors(std_logging.Filter):
  """Keeps libraries' error records off stderr until the program ends (Orbax logs several, with tracebacks, for
  one failed save): after a failure they go to the log file with its traceback; after a success each is shown
  as its first line."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    path = record.pathname.replace(os.sep, "/")
    if _VERBOSE.value or record.levelno < std_logging.ERROR or ("/pacs_jax/" in path and "-packages/" not in path):
      return True
    if record not in _held_records:
      _held_records.append(record)
    return False


def _show_held_records() -> None:
  for record in _held_records:
    lines = [line for line in record.getMessage().splitlines() if line.strip()]
    sys.stderr.write(f"{record.name} error (at exit): {lines[0] if lines else ''}\n")


def stop_on_ctrl_c(prog: str) -> None:
  """A command line's first call, before its imports (seconds of them): until `run` takes over, a Ctrl-C ends it at
  once in one line with EXIT_INTERRUPTED (nothing is written before), not in a traceback through those imports.
  Then jax is imported without its CUDA plugin's lines where there is no CUDA runtime (services/platform_noise.py)."""
  from pacs_jax.services import platform_noise

  def at_once(signum, frame):  # pylint: disable=unused-argument
    sys.stderr.flush()
    os.write(platform_noise.real_stderr(), f"{prog}: {INTERRUPTED}\n".encode())
    os._exit(EXIT_INTERRUPTED)

  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, at_once)
  platform_noise.import_jax_quietly()


INTERRUPTED = "interrupted (Ctrl-C)"
_interrupted = False  # a Ctrl-C came while the program ran outside the trainer's steps (services/preemption.py's)


def _on_ctrl_c(signum, frame):  # pylint: disable=unused-argument
  """Python's own Ctrl-C (a KeyboardInterrupt wherever the program is), remembered: see `_ctrl_c_in_a_callback`."""
  global _interrupted
  _interrupted = True
  raise KeyboardInterrupt


def _ctrl_c_in_a_callback(previous_hook):
  """A KeyboardInterrupt raised inside a callback that Python runs between the program's own instructions (jax's
  garbage-collection callback, a `__del__`) cannot stop the program: Python prints it as "Exception ignored in"
  with a traceback and goes on, the Ctrl-C lost (seen while a model loads or compiles). Raised again instead, a
  moment later from another thread (raised here, it would land in this hook), until it lands in the program's own
  code. Anything else goes to `previous_hook`."""

  def hook(unraisable):
    if _interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt):
      threading.Timer(_AGAIN_AFTER_S, _thread.interrupt_main).start()  # (nothing printed: the one line says it)
      return
    previous_hook(unraisable)

  return hook


_AGAIN_AFTER_S = 0.05


def _flags_parser(prog: str) -> Callable[[list[str]], list[str]]:
  """absl's flag parsing, with a config file that fails or an unknown `--config.field` as one line."""

  def parse(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      failure = _flag_failure(e)
      print(f"{prog}: {failure.message}", file=sys.stderr)
      if failure.status == EXIT_USAGE:
        print("Pass --helpshort or --helpfull to see help on flags.", file=sys.stderr)
      sys.exit(failure.status)
    except Exception as e:  # noqa: BLE001 (a config file's get_config() may raise anything)
      print(f"{prog}: {_config_message(e, argv)}", file=sys.stderr)
      sys.exit(EXIT_CONFIG)

  return parse


def _flag_failure(e: flags.Error) -> Failure:
  """A flag that fails to parse: a required flag not given is a missing input (EXIT_INPUT, with the flag's help), a
  `--config.field` value of the wrong type a config error (EXIT_CONFIG); anything else a usage error."""
  line = first_line(e)
  required = re.fullmatch(r"flag --(\w+)=None: Flag --\w+ must have a value other than None\.", line)
  if required:
    name = required.group(1)
    return Failure(EXIT_INPUT, f"--{name} is required: {flags.FLAGS[name].help}")
  if line.startswith("flag --config."):
    return Failure(EXIT_CONFIG, line.removeprefix("flag "))
  return Failure(EXIT_USAGE, line)


def _config_message(e: BaseException, argv: list[str]) -> str:
  """`config file <path>: <cause>`, or `--config.<field>: no such config field` for a mistyped `--config.<field>`
  (`was removed: <why>` for a field that was removed)."""
  # ml_collections: "'trian'\nDid you mean "train" instead of "trian"?" (a KeyError at the top level; in a
  # section, an AttributeError around that KeyError).
  text, cause = "", e
  while isinstance(cause, (KeyError, AttributeError)) and cause.args:
    cause, text = cause.args[0], str(cause.args[0])
  field = next((a.split("=")[0].removeprefix("--") for a in argv if text and a.startswith("--config.")
                and f"'{text.splitlines()[0].strip(chr(39))}'" in repr(a.split("=")[0].split("."))), None)
  if isinstance(e, KeyError) or field:
    from pacs_jax.config import checks  # pylint: disable=import-outside-toplevel
    removed = checks.REMOVED_FIELDS.get((field or "").removeprefix("config."))
    if removed:
      return f"--{field}: was removed: {removed}"
    hint = " ".join(line.strip() for line in text.splitlines()[1:])
    return f"--{field or 'config'}: no such config field{'; ' + hint if hint else ''}"
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  name = _config_file(argv)
  if lines and "failure to load" in lines[0]:  # config_flags' wrapper: the cause is its last line
    return f"config file {name}: {lines[-1]}"
  return f"config file {name}: {type(e).__name__}: {lines[0] if lines else ''}"


def _config_file(argv: list[str]) -> str:
  """The config file named last on the command line (as absl takes the last value)."""
  name = "(the default config)"
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      name = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      name = argv[i + 1]
  return name


def define_config_file(prog: str, name: str, default: str, help_: str):
  """`config_flags.DEFINE_config_file`, which runs the config file and applies `--config.*` overrides as it is
  defined: a file that fails or an unknown field ends the program in one line."""
  from ml_collections import config_flags
  try:
    return config_flags.DEFINE_config_file(name, default, help_, lock_config=True)
  except Exception as e:  # noqa: BLE001 (a config file's get_config() may raise anything)
    print(f"{prog}: {_config_message(e, sys.argv)}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)


def config_value(flag):
  """`flag.value` of a `config_flags` flag, a config file that fails to load turned into one line."""
  try:
    return flag.value
  except Exception as e:  # noqa: BLE001 (the config file's own exception, wrapped by ml_collections)
    raise _ConfigFileError(_config_message(e, sys.argv)) from e


class _ConfigFileError(Exception):
  pass


def no_arguments_quiet_logs(argv: list[str]) -> None:
  """The command lines' common start: no positional arguments, and absl logging at WARNING unless --verbosity is
  given (Orbax logs every file it reads or writes at INFO)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def run(prog: str, main: Callable[[list[str]], object]) -> None:
  """`app.run(main)` with expected failures as one line `<prog>: <what>: <cause>` and their exit status."""

  def guarded(argv):
    # Until the trainer's steps begin (their own handler finishes the step and saves), Ctrl-C stops the program in
    # one line with EXIT_INTERRUPTED: a model load, a compile, a restore, an evaluation or an export.
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGINT, _on_ctrl_c)
      sys.unraisablehook = _ctrl_c_in_a_callback(sys.unraisablehook)
    for handler in {*std_logging.getLogger().handlers, logging.get_absl_handler()}:
      handler.addFilter(_HoldLibraryErrors())
    try:
      result = main(argv)
      _show_held_records()
      return result
    except (SystemExit, app.UsageError):
      raise
    except KeyboardInterrupt as e:  # (once training runs, Ctrl-C saves a checkpoint first: services/preemption.py)
      _exit(prog, Failure(EXIT_INTERRUPTED, INTERRUPTED), e)
    except _ConfigFileError as e:
      _exit(prog, Failure(EXIT_CONFIG, str(e)), e)
    except Exception as e:  # noqa: BLE001 (classified below; a bug is re-raised whole)
      # After a Ctrl-C, whatever a library made of its KeyboardInterrupt is the interruption.
      failure = Failure(EXIT_INTERRUPTED, INTERRUPTED) if _interrupted else classify(e)
      if failure is None:
        raise
      _exit(prog, failure, e)

  app.run(guarded, flags_parser=_flags_parser(prog))


def _exit(prog: str, failure: Failure, e: BaseException) -> None:
  text = "".join(traceback.format_exception(e))
  for record in _held_records:
    text += f"\n(logged by {record.name} at {record.pathname}:{record.lineno})\n{record.getMessage()}\n"
    if record.exc_info:
      text += "".join(traceback.format_exception(*record.exc_info))
  if _VERBOSE.value:
    sys.stderr.write(text)
    where = ""
  else:
    log = _write_log(prog, text)
    where = f" (traceback: {log})" if log else ""
  sys.stderr.write(f"{prog}: {failure.message}{where}\n")
  sys.stdout.flush()
  sys.stderr.flush()
  # Not a normal exit: Orbax's and gcsfs's event loops would print hundreds of lines of "Exception ignored
  # in coroutine" / "Event loop is closed" as the interpreter tears them down half-way through an operation.
  # Everything that must be on disk (metrics, the lock's release, a finished checkpoint) already is.
  os._exit(failure.status)
