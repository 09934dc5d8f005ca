"""`python -m pacs_jax.evaluate --model EXPORT --data synthetic/mod3 --n 8` on the exported demo model: pass@k for every
k <= n (the synthetic task's 10 prompts over 64 problems are kept apart by problem, not merged by prompt text)."""

import json
import os
import subprocess
import sys

import jax

from pacs_jax import config as config_lib
from pacs_jax.eval import results
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_evaluate_the_exported_demo_on_its_task(tmp_path):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "steps": 1, "eval_every": 0, "train.batch_prompts": 8, "train.mini_batch_prompts": 8,
      "checkpoint.async_save": False})
  loop.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1])
  exported = export_lib.export(str(tmp_path / "run"), str(tmp_path / "exported"))
  env = {**os.environ, "XLA_FLAGS": "", "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "evaluate")}
  out = subprocess.run([sys.executable, "-m", "pacs_jax.evaluate", "--model", exported, "--data", "synthetic/mod3",
                        "--n", "8", "--reward_workers", "1"], env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  with open(os.path.join(exported, results.METRICS_FILE)) as f:
    released = json.load(f)
  assert set(released["synthetic/mod3"]) == {"pass@1", "pass@2", "pass@4", "pass@8"}
  with open(os.path.join(exported, results.SUMMARY_FILE)) as f:
    summary = json.load(f)
  entry = summary["sources"]["synthetic/mod3"]
  # The demo's sizes by default: its validation set's 64 problems, 4 new tokens each.
  assert entry["num_problems_scored"] == 64 and entry["num_responses"] == 64 * 8
  assert summary["settings"]["max_new_tokens"] == 4 and summary["settings"]["limit"] == 64
  for k in (1, 2, 4, 8):
    assert abs(entry[f"pass@{k}"] - released["synthetic/mod3"][f"pass@{k}"]) < 1e-9
  assert "pass@8" in out.stdout
