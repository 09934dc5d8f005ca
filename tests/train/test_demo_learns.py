"""The built-in demo learns: PACS (the README's main command), GRPO and PPO on configs/tiny_cpu.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(tmp_path, config_arg, *extra):
  env = {**os.environ, "XLA_FLAGS": "", "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer")}
  out = subprocess.run([sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", config_arg),
                        "--workdir", str(tmp_path), *extra], env=env, capture_output=True, text=True, timeout=1500)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]


def rewards(rows):
  return [r["reward/mean"] for r in rows if "reward/mean" in r]


@pytest.mark.slow
def test_pacs_demo_reaches_0p9(tmp_path):
  r = rewards(run(tmp_path, "tiny_cpu.py", "--config.eval_every=100"))
  assert np.mean(r[:20]) < 0.5  # it starts near the random model's rate ...
  assert np.mean(r[-20:]) >= 0.9  # ... and the last 20 steps average at least 0.9


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_baselines_learn_the_demo_task(tmp_path, algorithm):
  rows = run(tmp_path, f"tiny_cpu.py:{algorithm}", "--config.steps=200", "--config.eval_every=100")
  r = rewards(rows)
  assert np.mean(r[:20]) < 0.5
  assert np.mean(r[-20:]) >= 0.9
  assert any(k.startswith("actor/") for k in rows[-1])
  if algorithm == "ppo":
    assert "critic/vf_loss" in rows[-1] and "critic/grad_norm" in rows[-1]
