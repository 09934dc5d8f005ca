"""Every shipped config runs 2 training steps end to end, shrunk to the tiny model by tests/config_shrink.py (the
same algorithm, remat, compute dtype, attention chunking, reference policy, micro-batches (2 at most) per mini-batch
and validation; a tiny model, batches, lengths, mesh and data). The trainer runs in the test's process (a CLI
process would add its 6 s of imports to each config; the demo and first-hour tests run the command line itself)."""

import glob
import json
import math
import os

import jax
import pytest

import config_shrink
from pacs_jax import config as config_lib
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not os.path.basename(p).startswith("_"))
# A config file's variants (`get_config(arg)`), as `--config FILE:ARG` gives them. tiny_cpu.py's baselines
# (`:grpo`, `:ppo`) run through the CLI in tests/train/test_demo_learns.py, to the README's table, so not here.
VARIANTS: dict[str, list[str]] = {}
SPECS = [p for c in CONFIGS for p in [c] + [f"{c}:{v}" for v in VARIANTS.get(c, [])]]


def load(spec: str):
  """The config `--config FILE[:ARG]` gives: FILE's get_config(ARG) (or get_config())."""
  import importlib.util
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location(f"_e2e_{abs(hash(spec))}", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def test_every_config_is_covered():
  assert {"configs/tiny_cpu.py", "configs/qwen3b_v5p.py", "configs/qwen7b_v5p.py", "configs/qwen3b_gpu.py",
          "configs/qwen1p5b_1gpu.py", "configs/qwen7b_lora_v5p8.py", "configs/qwen7b_lora_1gpu.py"} <= set(CONFIGS)
  for spec in SPECS:
    config_shrink.shrink(load(spec))  # raises if a field has no rule


@pytest.mark.parametrize("spec", SPECS)
def test_config_trains_two_steps(spec, tmp_path):
  cfg = load(spec)
  overrides, devices = config_shrink.shrink(cfg)
  shrunk = load(spec)
  for field, value in overrides.items():
    config_lib.set_field(shrunk, field, value)
  workdir = tmp_path / "run"
  loop.Trainer(shrunk, str(workdir), devices=jax.devices()[:devices]).run()

  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl") if line.strip()]
  steps = [r["step"] for r in rows]
  validates = bool(cfg.eval_every and (cfg.data.val or cfg.data.val_dir))
  assert steps[-2:] == [1, 2] and (steps[0] == 0) == validates, steps
  if validates:
    assert f"val/accuracy/{overrides['data.val']}" in rows[0]
  for r in rows[-2:]:
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["skipped_updates"] == 0, r
  # The run used the config's recipe: every kept field as the config sets it, every shrunk one as shrunk.
  checkpointer = checkpoint_lib.Checkpointer(str(workdir / "checkpoints"))
  try:
    assert checkpointer.latest_step() == 2
    saved = checkpointer.restore_config(2)
  finally:
    checkpointer.close()

  def get(tree, field):
    for part in field.split("."):
      tree = tree[part] if isinstance(tree, dict) else getattr(tree, part)
    return tree

  for field in config_shrink.kept_fields(cfg):
    assert get(saved, field) == get(cfg, field), field
  for field, value in overrides.items():
    assert get(saved, field) == value, field
