"""pass@k evaluation on a tiny random model and ../shared/data subsets: both files, pass@k consistent with the
rows, every k <= n per data source, exact resume, refusals, and the CLI on a training workdir."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zlib

import ml_collections
import numpy as np
import pytest
from flax import nnx

from pacs_jax.data import sources
from pacs_jax.eval import passk, runner
from pacs_jax.models import hf, qwen2

NAMES = ("math500", "aime2024", "aime2025", "amc23")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ("math_500", "aime_2024", "aime_2025", "amc23")
# Prompt lengths of the first 3 problems with the test tokenizer: aime2024 [275, 220, 231], aime2025 [118, 295, 296],
# the others <= 214; so 250 drops 1 and 2 of them and keeps every source.
# 16 slots hold a whole chunk (4 problems x 4 samples): one insert per chunk and prompt bucket, few compiles.
SETTINGS = runner.EvalSettings(n=4, max_new_tokens=8, max_prompt_length=250, batch_slots=16, chunk_problems=4,
                               limit=3, dtype="float32")
KEPT = {"math_500": 3, "aime_2024": 2, "aime_2025": 1, "amc23": 3}
# Qwen2.5's pre-tokenizer split: transformers loads any tokenizer beside a qwen2 config.json as Qwen2Tokenizer,
# which rebuilds the byte-level BPE with this split from tokenizer.json's vocab and merges.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class ParityScorer:
  """Scores by the parity of a hash of the response: deterministic, and about half the samples of a random
  model are correct, so pass@k values are not all 0 or 1."""

  def score_batch(self, responses, answers, data_sources):
    return np.array([float(zlib.crc32(r.encode()) % 2) for r in responses], np.float32), {}


def build_tokenizer(texts):
  """A Qwen2.5-like byte-level BPE (512 ids) trained on `texts`, with Qwen's special tokens and chat format."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  backend = Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  backend.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=CHAT_TEMPLATE)


def tiny_model(vocab_size):
  config = qwen2.get_preset("tiny", vocab_size=vocab_size, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
  return qwen2.Qwen2ForCausalLM(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokenizer(data_dir):
  texts = [sources.MATH_INSTRUCTION]
  for name in NAMES:
    texts += [r["problem"] for r in sources.load_records(os.path.join(data_dir, name, "test.jsonl")).records]
  return build_tokenizer(texts)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_model"))
  hf.save_pretrained(tiny_model(len(tokenizer)), path, tokenizer=tokenizer)
  return path


@pytest.fixture(scope="module")
def data_dir(shared_data, tmp_path_factory):
  """The first 6 problems of each set, in the shared layout (the runner's --limit takes 3)."""
  path = tmp_path_factory.mktemp("data")
  for name in NAMES:
    with open(os.path.join(shared_data, name, "test.jsonl")) as f:
      lines = f.readlines()[:6]
    os.makedirs(path / name)
    (path / name / "test.jsonl").write_text("".join(lines))
  return str(path)


@pytest.fixture(scope="module")
def first_run(model_dir, data_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("eval"))
  metrics = runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=out, data_dir=data_dir,
                            scorer=ParityScorer(), progress=False)
  return out, metrics


def read_lines(out):
  with open(os.path.join(out, runner.ROLLOUT_FILE)) as f:
    return [json.loads(line) for line in f]


def test_writes_both_files_with_every_k_per_source(first_run):
  out, metrics = first_run
  with open(os.path.join(out, runner.METRICS_FILE)) as f:
    assert json.load(f) == json.loads(json.dumps(metrics))
  assert metrics["complete"]
  assert set(metrics["sources"]) == set(SOURCES)
  for source, entry in metrics["sources"].items():
    assert {name for name in entry if name.startswith("pass@")} == {"pass@1", "pass@2", "pass@4"}
    assert entry["num_problems"] == entry["num_problems_scored"] == KEPT[source]
    assert entry["num_responses"] == 4 * KEPT[source]
  assert metrics["sources"]["aime_2024"]["num_dropped_overlong"] == 1
  assert metrics["sources"]["aime_2025"]["num_dropped_overlong"] == 2
  rows = read_lines(out)
  assert len(rows) == 4 * sum(KEPT.values())
  assert len({(r["data_source"], r["problem_index"], r["sample_index"]) for r in rows}) == len(rows)
  for r in rows:
    assert set(r) == {"data_source", "problem_index", "sample_index", "answer", "score", "finish_reason",
                      "num_tokens", "response"}
    assert r["finish_reason"] in ("eos", "length") and 1 <= r["num_tokens"] <= 8
  assert {r["problem_index"] for r in rows if r["data_source"] == "aime_2024"} == {1, 2}  # #0 is overlong


def test_pass_at_k_matches_the_rows(first_run):
  out, metrics = first_run
  counts = {}
  for r in read_lines(out):
    key = (r["data_source"], r["problem_index"])
    counts[key] = counts.get(key, 0) + int(r["score"] == 1.0)
  assert 0 < sum(counts.values()) < 4 * len(counts)  # the scorer gives a mix of 0 and 1
  for source in SOURCES:
    per_problem = [c for (s, _), c in counts.items() if s == source]
    for k in (1, 2, 4):
      expected = np.mean([passk.pass_at_k(4, c, k) for c in per_problem])
      assert metrics["sources"][source][f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    scores = [r["score"] for r in read_lines(out) if r["data_source"] == source]
    assert metrics["sources"][source]["mean_accuracy"] == pytest.approx(np.mean(scores))
    assert metrics["sources"][source]["pass@1"] == pytest.approx(np.mean(scores))


def test_resume_redraws_only_missing_rows_identically(first_run, model_dir, data_dir, tmp_path, monkeypatch):
  out, metrics = first_run
  resumed = str(tmp_path / "resumed")
  shutil.copytree(out, resumed)
  rows = read_lines(out)
  key = lambda r: (r["data_source"], r["problem_index"], r["sample_index"])
  # Lost: all samples of one problem and two of another; plus a duplicated row and a line cut short by a crash.
  lost = {k for k in map(key, rows) if k[:2] == ("math_500", 1) or (k[:2] == ("amc23", 0) and k[2] >= 2)}
  kept = [r for r in rows if key(r) not in lost]
  with open(os.path.join(resumed, runner.ROLLOUT_FILE), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in kept + kept[:1]) + json.dumps(rows[0])[:30])
  again = runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=resumed, data_dir=data_dir,
                          scorer=ParityScorer(), progress=False)
  after = read_lines(resumed)
  assert len(after) == len(rows) and {key(r) for r in after} == {key(r) for r in rows}
  assert sorted(after, key=key) == sorted(rows, key=key)  # same responses, scores, lengths
  assert again["sources"] == metrics["sources"] and again["complete"]

  # A complete evaluation is not redone: no model is even loaded.
  monkeypatch.setattr(hf, "load_pretrained", lambda *a, **k: pytest.fail("reloaded a complete evaluation"))
  assert runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=resumed, data_dir=data_dir,
                         scorer=ParityScorer(), progress=False)["sources"] == metrics["sources"]


def test_sharded_over_two_devices_draws_the_same_responses(first_run, model_dir, data_dir, tmp_path):
  """The CLI's multi-device path: slots split over a (data=2) mesh, same rows as on one device."""
  import jax

  from pacs_jax import sharding

  out, _ = first_run
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2])
  settings = dataclasses.replace(SETTINGS, limit=1, batch_slots=3)  # 3 slots -> 4, two per device
  runner.evaluate(model_dir, ["aime2025"], settings, out_dir=str(tmp_path), data_dir=data_dir, mesh=mesh,
                  scorer=ParityScorer(), progress=False)
  expected = [r for r in read_lines(out) if r["data_source"] == "aime_2025" and r["problem_index"] == 0]
  assert read_lines(str(tmp_path)) == expected


def test_refuses_to_mix_other_settings(first_run, model_dir, data_dir, tmp_path):
  out, _ = first_run
  copy = str(tmp_path / "copy")
  shutil.copytree(out, copy)
  for change in (dict(n=8), dict(temperature=1.0), dict(dtype="bfloat16")):
    settings = dataclasses.replace(SETTINGS, **change)
    with pytest.raises(ValueError, match=next(iter(change))):
      runner.evaluate(model_dir, ",".join(NAMES), settings, out_dir=copy, data_dir=data_dir,
                      scorer=ParityScorer(), progress=False)


def test_resolve_data(data_dir):
  with pytest.raises(ValueError, match="--data_dir"):
    runner.resolve_data("math500")  # no default folder: the names only resolve under --data_dir
  with pytest.raises(FileNotFoundError, match="nosuch"):
    runner.resolve_data("nosuch", data_dir)
  path = os.path.join(data_dir, "amc23", "test.jsonl")
  assert runner.resolve_data(f"math500, {path},synthetic/mod3", data_dir) == [
      os.path.join(data_dir, "math500", "test.jsonl"), path, "synthetic/mod3"]


def test_cli_on_a_training_workdir(data_dir, tokenizer, tmp_path):
  """The CLI end to end on one device: checkpoint -> export_step_<S> -> both files there, math-verify scores."""
  from pacs_jax.train import checkpoint as checkpoint_lib
  from pacs_jax.train import export_lib

  workdir = str(tmp_path / "run")
  model = tiny_model(len(tokenizer))
  export_lib.write_model_card(workdir, model.config, tokenizer)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
  ckpt.save(3, {"params": nnx.state(model, nnx.Param)}, {},
            ml_collections.ConfigDict({"model": {"param_dtype": "float32"}}))
  ckpt.close()
  data = ",".join(os.path.join(data_dir, name, "test.jsonl") for name in ("amc23", "math500"))
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  env["PACS_JAX_COMPILATION_CACHE"] = os.path.join(REPO, ".jax_cache")
  result = subprocess.run(
      [sys.executable, "-m", "pacs_jax.evaluate", f"--model={workdir}", f"--data={data}", "--n=2", "--limit=2",
       "--max_new_tokens=4", "--max_prompt_length=256", "--batch_slots=4", "--dtype=float32", "--reward_workers=1"],
      env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
  assert result.returncode == 0, result.stderr[-3000:]
  out = os.path.join(workdir, "export_step_3")
  assert "pass@2" in result.stdout and "amc23" in result.stdout
  with open(os.path.join(out, runner.METRICS_FILE)) as f:
    metrics = json.load(f)
  assert metrics["complete"] and set(metrics["sources"]) == {"amc23", "math_500"}
  for entry in metrics["sources"].values():
    assert {"pass@1", "pass@2"} <= set(entry) and entry["num_responses"] == 4
  assert len(read_lines(out)) == 8
