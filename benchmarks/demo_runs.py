"""What the demo benchmarks share (objectives_demo.py, overlap_demo.py, ...): the demo's config as `--config
configs/tiny_cpu.py:<algorithm>` gives it."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_config(algorithm: str):
  """`--config configs/tiny_cpu.py:<algorithm>` (its per-algorithm settings), with no validation runs."""
  spec = importlib.util.spec_from_file_location("tiny_cpu", os.path.join(ROOT, "configs", "tiny_cpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config(algorithm)
  cfg.eval_every = 0
  return cfg
