"""The search path a test's Python subprocess gets: the repo first, then whatever this process was given (a GPU
machine's carried wheels arrive on PYTHONPATH: benchmarks/gpu_check.sh), never the repo alone."""

import os


def pythonpath(root: str) -> str:
  return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
