"""`python -m pacs_jax.export` of a LoRA run (issue 31): a tiny run trained on a Hugging Face base exports as the
merged model that transformers loads, and with --adapter as a PEFT folder that peft loads onto the base, both to the
run's own logits (fp32, 1e-4); --adapter of a full-parameter run, and an export against a base that changed since
training, are refused in one line."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import errors
from pacs_jax.models import lora
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
RUN = {"steps": 2, "eval_every": 0, "train.batch_prompts": 4, "train.mini_batch_prompts": 2,
       "checkpoint.async_save": False}
LORA = {"lora.rank": 8, "lora.modules_to_save": ""}  # a plain folder (the demo config saves embeddings and norms)
NOISE = ("All log messages before absl::InitializeLog() is called", "cudart_stub.cc")  # jax's CUDA plugin, no GPU


def export_cli(*args):
  return subprocess.run([sys.executable, "-m", "pacs_jax.export", *args], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "XLA_FLAGS": child_env.xla_flags(), "JAX_PLATFORMS": "cpu"})


def one_line_failure(result, status: int) -> str:
  lines = [line for line in result.stderr.splitlines() if line.strip() and not any(n in line for n in NOISE)]
  assert result.returncode == status and "Traceback" not in result.stderr, result.stderr
  assert len(lines) == 1, lines
  return lines[0]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  """A random 2-layer Qwen2 of the synthetic task's 64-token vocabulary, as transformers saves it."""
  d = tmp_path_factory.mktemp("base")
  torch.manual_seed(0)
  config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    tie_word_embeddings=False)
  transformers.Qwen2ForCausalLM(config).save_pretrained(d)
  return str(d)


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):
  """Two PACS steps of rank-8 adapters on every projection of the base (the demo task)."""
  workdir = str(tmp_path_factory.mktemp("lora") / "run")
  cfg = config_lib.load_config_file(TINY, {**RUN, "model.hf_path": base_dir, **LORA})
  loop.train(cfg, workdir, devices=jax.devices()[:1])
  return workdir


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


def test_merged_and_adapter_exports_load_in_transformers_and_peft_to_the_runs_logits(lora_run, base_dir, tmp_path):
  policy = export_lib.load(lora_run)
  assert policy.step == 2 and policy.spec == config_lib.lora_spec(config_lib.load_config_file(TINY, LORA))
  _, adapters, _ = lora.split(policy.model)
  b = [np.asarray(v.get_value()) for path, v in nnx.to_flat_state(adapters) if path[-1].endswith("_lora_b")]
  assert len(b) == 7 and all(np.abs(x).max() > 0 for x in b)  # trained: the update is no longer zero
  ids = np.random.default_rng(0).integers(0, 64, (2, 11))
  ours = np.asarray(policy.model(jnp.asarray(ids, jnp.int32)))
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
  assert np.abs(torch_logits(base, ids) - ours).max() > 1e-3  # the adapters change the logits

  merged = tmp_path / "merged"
  result = export_cli("--workdir", lora_run, "--out", str(merged))
  assert result.returncode == 0, result.stderr
  np.testing.assert_allclose(torch_logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval(), ids), ours,
                             atol=1e-4, rtol=0)
  assert not any("lora" in name for name in os.listdir(merged))  # a plain model: no adapter in its weights

  folder = tmp_path / "adapter"
  result = export_cli("--workdir", lora_run, "--out", str(folder), "--adapter")
  assert result.returncode == 0, result.stderr
  assert sorted(os.listdir(folder)) == sorted([lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, export_lib.EXPORT_MARKER])
  with open(folder / lora.ADAPTER_CONFIG) as f:
    adapter_config = json.load(f)
  assert (adapter_config["r"], adapter_config["base_model_name_or_path"]) == (8, base_dir)
  with_adapter = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), folder)
  np.testing.assert_allclose(torch_logits(with_adapter.eval(), ids), ours, atol=1e-4, rtol=0)
  # --overwrite replaces the adapter folder's own files, as for a model export.
  assert export_cli("--workdir", lora_run, "--out", str(folder), "--adapter", "--overwrite").returncode == 0


def test_an_adapter_export_of_a_full_run_is_refused_in_one_line(tmp_path):
  workdir = str(tmp_path / "full")
  loop.train(config_lib.load_config_file(TINY, {**RUN, "steps": 1}), workdir, devices=jax.devices()[:1])
  line = one_line_failure(export_cli("--workdir", workdir, "--out", str(tmp_path / "out"), "--adapter"),
                          errors.EXIT_CHECKPOINT)
  assert line.startswith("export: --adapter: ") and "a full-parameter run's checkpoint (lora.rank 0)" in line, line
  assert not (tmp_path / "out").exists()


def test_an_export_against_a_changed_base_is_refused_in_one_line(lora_run, base_dir, tmp_path):
  # The adapter folder needs no base; the merged model does, and its base must be the one the run trained on.
  weights = os.path.join(base_dir, "model.safetensors")
  saved = tmp_path / "model.safetensors"
  shutil.copy(weights, saved)
  try:
    other = transformers.Qwen2ForCausalLM(transformers.AutoConfig.from_pretrained(base_dir))
    other.save_pretrained(base_dir)  # another random init under the same path
    line = one_line_failure(export_cli("--workdir", lora_run, "--out", str(tmp_path / "merged")),
                            errors.EXIT_CHECKPOINT)
    assert "its adapters were trained on another base than model.hf_path=" in line, line
    assert export_cli("--workdir", lora_run, "--out", str(tmp_path / "adapter"), "--adapter").returncode == 0
  finally:
    shutil.copy(saved, weights)
