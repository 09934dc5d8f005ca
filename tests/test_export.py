"""`python -m pacs_jax.export`: a training checkpoint -> a directory transformers loads with the same logits."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from pacs_jax import config as config_lib
from pacs_jax.data import tokenizers
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_export_round_trip_through_transformers(tmp_path):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "steps": 2, "eval_every": 0, "train.batch_prompts": 8, "train.mini_batch_prompts": 8,
      "checkpoint.async_save": False})
  loop.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1])
  out = tmp_path / "hf"
  subprocess.run([sys.executable, "-m", "pacs_jax.export", "--workdir", str(tmp_path / "run"), "--out", str(out)],
                 check=True, capture_output=True, env={**os.environ, "XLA_FLAGS": child_env.xla_flags()}, timeout=300)
  model, step = export_lib.load_policy(str(tmp_path / "run"))
  assert step == 2
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out).eval()
  # This project's loader gives back the demo's word-level tokenizer (the export holds a form AutoTokenizer reads).
  tokenizer = tokenizers.load_tokenizer(str(out))
  assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
  ids = tokenizer.apply_chat_template([{"role": "user", "content": "17 mod 3"}], add_generation_prompt=True)
  ids = np.asarray(ids if isinstance(ids[0], int) else ids["input_ids"], np.int64)[None]
  with torch.no_grad():
    ref = reloaded(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
  np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
  # The tokenizer survives the trip unchanged (a word-level tokenizer must not be re-read as BPE).
  assert tokenizer.tokenize("17 mod 3") == ["17", "mod", "3"]
  # As they are, with no class picked by hand: AutoTokenizer reads the same ids (its own Qwen2Tokenizer form),
  # AutoModelForCausalLM the same weights, and generation_config.json is there with both stop ids.
  auto = transformers.AutoTokenizer.from_pretrained(out)
  demo = [[1, 5, 16, 7, 12, 2, 1, 6], ids[0].tolist()]  # "<|im_start|>user 7 mod 3<|im_end|> ..." and the above
  for row in demo:
    assert auto(tokenizer.decode(row))["input_ids"] == row
    assert auto(auto.decode(row))["input_ids"] == row
  assert auto.apply_chat_template([{"role": "user", "content": "17 mod 3"}], add_generation_prompt=True,
                                  tokenize=True)["input_ids"] == ids[0].tolist()
  with torch.no_grad():
    auto_logits = transformers.AutoModelForCausalLM.from_pretrained(out)(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(auto_logits, ref, atol=1e-5, rtol=0)
  generation = transformers.GenerationConfig.from_pretrained(out)
  assert sorted(generation.eos_token_id) == sorted(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
