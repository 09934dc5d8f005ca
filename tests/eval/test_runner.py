"""pass@k evaluation on a tiny random model and the released data's fixture rows: the released file layouts (read back as
the released inference.py does), pass@k consistent with the lines, every k <= n per data source, exact resume,
other writers' lines left alone, refusals, and the CLI on a training workdir."""

import collections
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import zlib

import ml_collections
import numpy as np
import pytest
from flax import nnx

from pacs_jax import api
from pacs_jax.data import prompts, sources
from pacs_jax.eval import passk, problems, results, runner
from pacs_jax.models import families as registry
from tests import child_env

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
  config = registry.preset("tiny", vocab_size=vocab_size, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
  return registry.causal_lm(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokenizer(data_dir):
  texts = [prompts.MATH_INSTRUCTION]
  for name in NAMES:
    texts += [r["problem"] for r in sources.load_records(os.path.join(data_dir, name, "test.jsonl")).records]
  return build_tokenizer(texts)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_model"))
  api.save_pretrained(tiny_model(len(tokenizer)), path, tokenizer=tokenizer)
  return path


@pytest.fixture(scope="module")
def data_dir(released_data, tmp_path_factory):
  """The first 6 problems of each set, in the released layout (the runner's --limit takes 3)."""
  path = tmp_path_factory.mktemp("data")
  for name in NAMES:
    with open(os.path.join(released_data, name, "test.jsonl")) as f:
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
  with open(os.path.join(out, results.ROLLOUT_FILE)) as f:
    return [json.loads(line) for line in f]


def read_summary(out):
  with open(os.path.join(out, results.SUMMARY_FILE)) as f:
    return json.load(f)


# ritzz-ai/PACS src/inference.py's reader (load_jsonl, merge_rollouts_by_prompt, calculate_pass_at_k, the metric
# loop), verbatim but for names: what the released code makes of the files.
def released_calculate_pass_at_k(n, k, data):
  scores = [[rollout["score"]["score"] for rollout in d["rollout"]] for d in data]
  total = len(scores)
  if total == 0:
    return 0.0
  all_pass_k = 0
  for sample_results in scores:
    c = sample_results.count(1)
    all_pass_k += 1 - math.comb(n - c, k) / math.comb(n, k)
  return all_pass_k / total


def released_merge_rollouts_by_prompt(data_list):
  merged_dict = {}
  for item in data_list:
    prompt_key = item["prompt"][0]["content"]
    if prompt_key not in merged_dict:
      merged_dict[prompt_key] = copy.deepcopy(item)
    else:
      merged_dict[prompt_key]["rollout"].extend(item["rollout"])
  return list(merged_dict.values())


def released_metrics(model_path):
  with open(f"{model_path}/eval_rollout.jsonl", "r") as file:
    result = [json.loads(line) for line in file]
  metrics = collections.defaultdict(lambda: collections.defaultdict(list))
  result_data_source = collections.defaultdict(list)
  for data in result:
    result_data_source[data["data_source"]].append(data)
  for data_source in result_data_source:
    merged_data = released_merge_rollouts_by_prompt(result_data_source[data_source])
    n = len(merged_data[0]["rollout"])
    lst = [x for x in [1, 2, 4, 8, 16, 32, 64, 128, 256] if x <= n]
    for k in lst:
      metrics[data_source][f"pass@{k}"] = released_calculate_pass_at_k(n, k, merged_data)
  return json.loads(json.dumps(metrics))


@contextlib.contextmanager
def weights_moved_away(model_dir):
  """The model's safetensors renamed for the block: loading the model inside it fails."""
  weights = [os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")]
  assert weights
  for w in weights:
    os.rename(w, w + ".away")
  try:
    yield
  finally:
    for w in weights:
      os.rename(w + ".away", w)


def test_writes_the_released_layouts_with_every_k_per_source(first_run):
  out, summary = first_run
  summary = dict(summary)
  assert summary.pop("out_dir") == os.path.abspath(out)  # where it went (by default beside the evaluated weights)
  assert read_summary(out) == json.loads(json.dumps(summary))
  assert summary["complete"]
  assert set(summary["sources"]) == set(SOURCES)
  for source, entry in summary["sources"].items():
    assert {name for name in entry if name.startswith("pass@")} == {"pass@1", "pass@2", "pass@4"}
    assert entry["num_problems"] == entry["num_problems_scored"] == KEPT[source]
    assert entry["num_responses"] == 4 * KEPT[source]
  assert summary["sources"]["aime_2024"]["num_dropped_overlong"] == 1
  assert summary["sources"]["aime_2025"]["num_dropped_overlong"] == 2
  lines = read_lines(out)
  assert len(lines) == sum(KEPT.values())  # one line per problem
  for line in lines:
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info", "rollout"} <= set(line)
    assert line["prompt"][0]["role"] == "user" and line["prompt"][0]["content"].endswith(prompts.MATH_INSTRUCTION)
    assert len(line["rollout"]) == 4
    for r in line["rollout"]:
      assert set(r["score"]) == {"score", "data_source", "ground_truth"}
      assert r["score"]["data_source"] == line["data_source"]
      assert r["score"]["ground_truth"] == line["reward_model"]["ground_truth"]
      assert isinstance(r["output"], str) and r["finish_reason"] in ("eos", "length") and 1 <= r["num_tokens"] <= 8
  assert {line["extra_info"]["index"] for line in lines if line["data_source"] == "aime_2024"} == {1, 2}  # #0 overlong
  # eval_metrics.json is exactly what the released reader computes from eval_rollout.jsonl.
  with open(os.path.join(out, results.METRICS_FILE)) as f:
    written = json.load(f)
  assert written == released_metrics(out)
  assert set(written) == set(SOURCES) and all(set(v) == {"pass@1", "pass@2", "pass@4"} for v in written.values())


def test_pass_at_k_matches_the_lines(first_run):
  out, summary = first_run
  counts = {(line["data_source"], line["extra_info"]["index"]): sum(r["score"]["score"] == 1.0 for r in line["rollout"])
            for line in read_lines(out)}
  assert 0 < sum(counts.values()) < 4 * len(counts)  # the scorer gives a mix of 0 and 1
  with open(os.path.join(out, results.METRICS_FILE)) as f:
    written = json.load(f)
  for source in SOURCES:
    per_problem = [c for (s, _), c in counts.items() if s == source]
    for k in (1, 2, 4):
      expected = np.mean([passk.pass_at_k(4, c, k) for c in per_problem])
      assert summary["sources"][source][f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
      assert written[source][f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    scores = [r["score"]["score"] for line in read_lines(out) if line["data_source"] == source for r in line["rollout"]]
    assert summary["sources"][source]["mean_accuracy"] == pytest.approx(np.mean(scores))


def test_resume_redraws_only_missing_problems_identically(first_run, model_dir, data_dir, tmp_path):
  out, summary = first_run
  resumed = str(tmp_path / "resumed")
  shutil.copytree(out, resumed)
  lines = read_lines(out)
  key = lambda line: (line["data_source"], line["extra_info"]["index"])
  # Lost: two problems' lines, and a line of ours cut short by a crash.
  lost = {("math_500", 1), ("amc23", 0)}
  kept = [line for line in lines if key(line) not in lost]
  with open(os.path.join(resumed, results.ROLLOUT_FILE), "w") as f:
    f.write("".join(json.dumps(line) + "\n" for line in kept) + json.dumps(lines[0])[:30])
  again = runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=resumed, data_dir=data_dir,
                          scorer=ParityScorer(), progress=False)
  after = read_lines(resumed)  # every line parses: the cut line is gone
  assert sorted(map(key, after)) == sorted(map(key, lines))
  assert sorted(after, key=key) == sorted(lines, key=key)  # same responses, scores, lengths
  assert again["sources"] == summary["sources"] and again["complete"]
  # A complete evaluation is not redone: no model is even loaded (its weights are moved out of reach).
  with weights_moved_away(model_dir):
    assert runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=resumed, data_dir=data_dir,
                           scorer=ParityScorer(), progress=False)["sources"] == summary["sources"]


def test_the_bar_counts_tokens_as_decode_calls_return(first_run, model_dir, data_dir, tmp_path, monkeypatch, capsys):
  """The bar's total is the token budget (problems x n x max_new_tokens); it moves after every decode call, so
  its rate and estimate are the decoding's (a per-response bar moved once per finished response). Until the first
  call returns the bar says it compiles, and then one line says how long that took (issue 44 item 5)."""
  from pacs_jax.rollout import interface
  moves = []

  class Recording(interface.BarProgress):
    def tokens(self, count):
      moves.append(("tokens", count))
      super().tokens(count)

    def __call__(self):
      moves.append(("finish", 1))
      super().__call__()

  monkeypatch.setattr(interface, "BarProgress", Recording)
  summary = runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=str(tmp_path), data_dir=data_dir,
                            scorer=ParityScorer(), progress=True)
  responses = sum(KEPT.values()) * SETTINGS.n
  assert summary["sources"] == first_run[1]["sources"]
  assert sum(c for kind, c in moves if kind == "tokens") == responses * SETTINGS.max_new_tokens
  assert sum(kind == "finish" for kind, _ in moves) == responses
  assert sum(kind == "tokens" for kind, _ in moves) >= 3  # once per decode call: 3 chunks of problems at least
  out, err = capsys.readouterr()
  assert "eval (compiling)" in err and re.search(r"^eval: compiled and first decode call in \d+\.\d s$", out, re.M), out


def test_never_rewrites_released_results_beside_it(first_run, model_dir, data_dir, tmp_path):
  """Pointed at a directory holding the released inference.py's files: its lines survive byte for byte (even a
  last line without a newline), its eval_metrics.json is kept aside, ours are appended, and a rerun resumes."""
  out, summary = first_run
  released_dir = tmp_path / "released"
  released_dir.mkdir()
  foreign = [{"data_source": "math_500", "prompt": [{"role": "user", "content": "What is 1+1? " +
                                                     prompts.MATH_INSTRUCTION}],
              "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
              "extra_info": {"split": "train", "index": 0, "answer": "2"},
              "rollout": [{"output": "\\boxed{2}", "score": {"score": 1.0, "data_source": "math_500",
                                                                "ground_truth": "2"}}] * 4}]
  foreign_bytes = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in foreign)  # save_jsonl
  foreign_bytes += '{"data_source": "gsm8k", "note": "a line nobody can parse'  # and no final newline
  (released_dir / results.ROLLOUT_FILE).write_text(foreign_bytes)
  (released_dir / results.METRICS_FILE).write_text('{"math_500": {"pass@1": 1.0}}')
  runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=str(released_dir), data_dir=data_dir,
                  scorer=ParityScorer(), progress=False)
  text = (released_dir / results.ROLLOUT_FILE).read_text()
  assert text.startswith(foreign_bytes)
  assert (released_dir / "eval_metrics.orig.json").read_text() == '{"math_500": {"pass@1": 1.0}}'
  ours = [json.loads(line) for line in text[len(foreign_bytes):].splitlines() if line]
  assert sorted(ours, key=lambda x: (x["data_source"], x["extra_info"]["index"])) == sorted(
      read_lines(out), key=lambda x: (x["data_source"], x["extra_info"]["index"]))
  with weights_moved_away(model_dir):  # a complete evaluation loads no model
    again = runner.evaluate(model_dir, ",".join(NAMES), SETTINGS, out_dir=str(released_dir), data_dir=data_dir,
                            scorer=ParityScorer(), progress=False)
  assert again["sources"] == summary["sources"]
  assert (released_dir / results.ROLLOUT_FILE).read_text() == text


def test_sharded_over_two_devices_draws_the_same_responses(first_run, model_dir, data_dir, tmp_path):
  """The CLI's multi-device path: slots split over a (data=2) mesh, same rows as on one device."""
  import jax

  from pacs_jax import sharding

  out, _ = first_run
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2])
  settings = dataclasses.replace(SETTINGS, limit=1, batch_slots=3)  # 3 slots -> 4, two per device
  runner.evaluate(model_dir, ["aime2025"], settings, out_dir=str(tmp_path), data_dir=data_dir, mesh=mesh,
                  scorer=ParityScorer(), progress=False)
  expected = [line for line in read_lines(out) if line["data_source"] == "aime_2025" and line["extra_info"]["index"] == 0]
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
    problems.resolve_data("math500")  # no default folder: the names only resolve under --data_dir
  with pytest.raises(FileNotFoundError, match="nosuch"):
    problems.resolve_data("nosuch", data_dir)
  path = os.path.join(data_dir, "amc23", "test.jsonl")
  assert problems.resolve_data(f"math500, {path},synthetic/mod3", data_dir) == [
      os.path.join(data_dir, "math500", "test.jsonl"), path, "synthetic/mod3"]


def test_cli_on_a_training_workdir(data_dir, tokenizer, tmp_path):
  """The CLI end to end on one device: checkpoint -> a temporary export -> both files in WORKDIR-eval_step_<S>,
  math-verify scores; the workdir is not written."""
  from pacs_jax.storage import checkpoint as checkpoint_lib
  from pacs_jax.storage import hf_export as export_lib

  workdir = str(tmp_path / "run")
  model = tiny_model(len(tokenizer))
  export_lib.write_model_card(workdir, model.config, tokenizer)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
  ckpt.save(3, {"params": nnx.state(model, nnx.Param)}, {},
            ml_collections.ConfigDict({"model": {"param_dtype": "float32"}}))
  ckpt.close()
  before = sorted(os.walk(workdir))
  data = ",".join(os.path.join(data_dir, name, "test.jsonl") for name in ("amc23", "math500"))
  env = dict(os.environ, XLA_FLAGS=child_env.xla_flags(), JAX_PLATFORMS="cpu")
  env["PACS_JAX_COMPILATION_CACHE"] = os.path.join(REPO, ".jax_cache")
  result = subprocess.run(
      [sys.executable, "-m", "pacs_jax.evaluate", f"--model={workdir}", f"--data={data}", "--n=2", "--limit=2",
       "--max_new_tokens=4", "--max_prompt_length=256", "--batch_slots=4", "--dtype=float32", "--reward_workers=1"],
      env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
  assert result.returncode == 0, result.stderr[-3000:]
  out = f"{workdir}-eval_step_3"
  assert sorted(os.walk(workdir)) == before
  assert "pass@2" in result.stdout and "amc23" in result.stdout
  summary = read_summary(out)
  assert summary["complete"] and set(summary["sources"]) == {"amc23", "math_500"}
  for entry in summary["sources"].values():
    assert {"pass@1", "pass@2"} <= set(entry) and entry["num_responses"] == 4
  assert len(read_lines(out)) == 4
  with open(os.path.join(out, results.METRICS_FILE)) as f:
    assert json.load(f) == released_metrics(out)


def test_the_table_names_released_sets_as_the_data_flag_does():
  """Issue 44: `--data math500,aime2024` prints math500 and aime2024 (the files keep the released math_500 and
  aime_2024)."""
  from pacs_jax.eval import runner
  entry = {"num_problems_scored": 2, "pass@1": 0.5}
  table = runner.summary_table({"sources": {"math_500": entry, "aime_2024": entry, "amc23": entry, "mine": entry}})
  names = [line.split()[0] for line in table.splitlines()[1:]]
  assert names == ["math500", "aime2024", "amc23", "mine"]
