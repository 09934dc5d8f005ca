"""The real-data path end to end: a tiny random HF Qwen2 with a Qwen-style tokenizer, DeepScaleR rows, math-verify rewards."""

import json
import os

import jax
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pacs_jax import config as config_lib
from pacs_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2.5's chat template (without the tool-calling branches): default system prompt, im_start/im_end turns.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_style_tokenizer(texts, vocab_size=400):
  """A byte-level BPE with Qwen2.5's special tokens and chat template, trained on `texts`."""
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  backend = Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>", chat_template=QWEN25_TEMPLATE)


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory, released_data):
  path = tmp_path_factory.mktemp("tiny_qwen")
  with open(os.path.join(released_data, "deepscaler", "train", "math.json")) as f:
    problems = [r["problem"] + " " + str(r["answer"]) for r in json.load(f)[:300]]
  tokenizer = qwen_style_tokenizer(problems + ["Please reason step by step, and put your final answer within \\boxed{}."])
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
  tokenizer.save_pretrained(path)
  return str(path)


def test_two_steps_on_deepscaler_with_math_verify(tmp_path, hf_model_dir, released_data):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "model.hf_path": hf_model_dir, "model.vocab_size": 0, "tokenizer": "",
      "data.train": os.path.join(released_data, "deepscaler", "train", "math.json"),
      "data.val": os.path.join(released_data, "math500", "test.jsonl"), "data.val_max_examples": 4,
      "data.instruction": config_lib.default_config().data.instruction,
      "data.skip_bad_rows": True, "data.max_prompt_length": 192, "rollout.n": 2, "rollout.max_new_tokens": 12,
      "train.batch_prompts": 4, "train.mini_batch_prompts": 2, "train.lr": 1e-5,
      "steps": 2, "eval_every": 2, "reward_workers": 1, "checkpoint.async_save": False,
  })
  metrics = loop.train(cfg, str(tmp_path), devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert "accuracy/deepscaler_math" in rows[1] or any(k.startswith("accuracy/") for k in rows[1])
  assert rows[2]["reward/errors"] == 0 and rows[2]["reward/timeouts"] == 0
  assert any(k.startswith("val/accuracy/") for k in rows[2])
  assert rows[1]["data/dropped_prompts"] > 0  # long DeepScaleR problems are filtered, not truncated
  assert metrics["response_length/mean"] > 0
  # The exported policy is a directory transformers loads.
  from pacs_jax.storage import hf_export as export_lib
  out = export_lib.export(str(tmp_path), str(tmp_path / "hf"))
  transformers.Qwen2ForCausalLM.from_pretrained(out)
  transformers.AutoTokenizer.from_pretrained(out)
