"""Keeps off a command line's stderr the lines jax's CUDA plugin prints, installed where no CUDA runtime is (the test
extras install it): `cudart_stub.cc ... Could not find cuda drivers`, each after absl's note on its own logging."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile

NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")

_saved_stderr: int | None = None  # the real stderr's descriptor while fd 2 is held


@contextlib.contextmanager
def _noise_held_back():
  """fd 2, where the plugin's C++ logging writes, into a temporary file meanwhile; then the file's lines, all but
  the noise, to stderr (in order: Python's own writes to stderr go through fd 2 too)."""
  global _saved_stderr
  sys.stderr.flush()
  _saved_stderr = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(_saved_stderr, 2)
      os.close(_saved_stderr)
      _saved_stderr = None
      held.seek(0)
      lines = held.read().decode(errors="replace").splitlines(keepends=True)
      sys.stderr.write("".join(line for line in lines if not any(noise in line for noise in NOISE)))
      sys.stderr.flush()


def real_stderr() -> int:
  """The descriptor a message that must be seen at once (before an `os._exit`) is written to."""
  return _saved_stderr if _saved_stderr is not None else 2


def import_jax_quietly() -> None:
  """Imports jax (its CUDA plugin's extensions print as they load) and makes its plugin discovery, which loads the
  plugin itself at the first backend's start, quiet too. A command line's first step: nothing else runs meanwhile."""
  if "jax" in sys.modules:
    return
  with _noise_held_back():
    import jax  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  discover = getattr(xla_bridge, "discover_pjrt_plugins", None)
  if discover is None:  # a jax without this private hook: its lines are printed, nothing else changes
    return

  @functools.wraps(discover)
  def discover_quietly():
    with _noise_held_back():
      discover()

  xla_bridge.discover_pjrt_plugins = discover_quietly
