"""Every config file loads and validates; the v5p dry runs fit a v5p chip's 95 GB."""

import glob
import os
import re
import subprocess
import sys

import pytest

from pacs_jax import config as config_lib
from pacs_jax.train import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if not os.path.basename(p).startswith("_"))


def test_the_expected_configs_exist():
  names = {os.path.basename(p) for p in CONFIGS}
  assert {"tiny_cpu.py", "qwen3b_v5p.py", "qwen7b_v5p.py", "qwen3b_gpu.py", "qwen1p5b_1gpu.py"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_and_validates(path):
  cfg = config_lib.load_config_file(path)
  config_lib.validate(cfg, cfg.hardware.num_devices or 1, cfg.hardware.num_processes or 1)


def test_released_recipe_fields():
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "qwen7b_v5p.py"))
  assert (cfg.train.batch_prompts, cfg.rollout.n, cfg.train.mini_batch_prompts) == (1024, 8, 256)
  assert (cfg.train.lr, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens) == (1e-6, 512, 4096)
  assert (cfg.steps, cfg.eval_every, cfg.checkpoint.every) == (300, 5, 20)
  assert (cfg.pacs.beta, cfg.pacs.adv_estimator, cfg.pacs.use_weight) == (1.0, "rloo", True)


@pytest.mark.parametrize("name", ["qwen3b_v5p", "qwen7b_v5p"])
def test_dry_run_fits_a_v5p_chip(name):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  parts = memory.estimate(cfg, cfg.hardware.num_devices)
  assert set(parts) >= {"params", "optimizer", "reference", "kv_cache", "activations"}
  assert sum(parts.values()) / memory.GB < 95
  # Weights are really sharded: the 7B's fp32 params on 64 chips are well under 1 GB each.
  assert parts["params"] < 2 * memory.GB


def test_dry_run_cli_prints_the_per_device_table():
  out = subprocess.run([sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", "qwen3b_v5p.py"),
                        "--dry_run"], capture_output=True, text=True, check=True, env={**os.environ, "XLA_FLAGS": ""},
                       timeout=300).stdout
  for part in ("params", "optimizer", "reference", "kv_cache", "activations", "total"):
    assert re.search(rf"^{part}\s+\d+\.\d+$", out, re.M), out
  assert "fits in 95 GB" in out
