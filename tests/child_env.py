"""What a test's Python subprocess inherits: the search path (the repo first, then whatever this process was given:
a GPU machine's carried wheels arrive on PYTHONPATH, benchmarks/gpu_check.sh), never the repo alone; and the
tests' XLA flags with the device count the child needs."""

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def pythonpath(root: str) -> str:
  return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def xla_flags(devices: int = 1) -> str:
  """This process's XLA_FLAGS (tests/conftest.py's compile settings) for a child on `devices` CPU devices."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
  return " ".join(flags + ([f"{DEVICE_COUNT}={devices}"] if devices > 1 else []))
