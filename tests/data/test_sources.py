"""Readers of every released data file (a few real rows of each: tests/fixtures/data), malformed rows, the released
parquet format and its CLI."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from pacs_jax.data import prompts, sources

# (file under tests/fixtures/data, its rows (tests/fixtures/data/SOURCES.md), data_source)
SHARED_FILES = [
    ("math500/test.jsonl", 20, "math_500"),
    ("aime2024/test.jsonl", 10, "aime_2024"),
    ("aime2025/test.jsonl", 20, "aime_2025"),
    ("amc23/test.jsonl", 20, "amc23"),
    ("gsm8k/test.jsonl", 20, "gsm8k"),
    ("deepscaler/train/aime.json", 40, "deepscaler"),
    ("deepscaler/test/aime.json", 20, "deepscaler"),
    ("deepscaler/test/amc.json", 20, "deepscaler"),
    ("deepscaler/test/math.json", 20, "deepscaler"),
]


@pytest.mark.parametrize("relative_path, count, data_source", SHARED_FILES)
def test_released_file_reads_with_its_count(released_data, relative_path, count, data_source):
  records, skipped = sources.load_records(os.path.join(released_data, relative_path))
  assert (len(records), skipped) == (count, 0)
  for record in records:
    assert set(record) == {"data_source", "problem", "answer"}
    assert record["data_source"] == data_source
    assert isinstance(record["problem"], str) and record["problem"].strip()
    assert isinstance(record["answer"], str) and record["answer"] and record["answer"] == record["answer"].strip()


def test_deepscaler_math_train_has_four_rows_without_answers(released_data):
  # The source's 7,474 rows have 2 with "answer": null and 2 with "answer": "" (its rows 886, 1009, 5328, 5330);
  # the fixture keeps rows 0-39 and 886, 887, 1009, 5328, 5329, 5330, so they are its rows 40, 42, 43, 45.
  path = os.path.join(released_data, "deepscaler/train/math.json")
  with pytest.raises(sources.DataError, match=r"math\.json: row 40: answer is missing"):
    sources.load_records(path)
  records, skipped = sources.load_records(path, skip_bad_rows=True)
  assert (len(records), skipped) == (42, 4)
  with open(path) as f:
    raw = json.load(f)
  assert len(raw) == 46
  assert records[40]["problem"] == raw[41]["problem"]  # rows after a skipped one keep their order
  assert records[41]["problem"] == raw[44]["problem"]


def test_answers_are_normalised(released_data):
  amc, _ = sources.load_records(os.path.join(released_data, "amc23/test.jsonl"))
  assert amc[0]["answer"] == "27"  # 27.0 in the file
  aime25, _ = sources.load_records(os.path.join(released_data, "aime2025/test.jsonl"))
  assert aime25[0]["answer"] == "70"  # an integer in the file
  aime24, _ = sources.load_records(os.path.join(released_data, "deepscaler/test/aime.json"))
  assert aime24[1]["answer"] == "025"  # strings are kept as written
  gsm8k, _ = sources.load_records(os.path.join(released_data, "gsm8k/test.jsonl"))
  assert gsm8k[0]["answer"] == "18"
  assert gsm8k[0]["problem"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
  assert all("," not in r["answer"] and "#" not in r["answer"] for r in gsm8k)
  assert sources.normalize_answer(0.5) == "0.5" and sources.normalize_answer(-3.0) == "-3"


def test_data_source_can_be_overridden(released_data):
  records, _ = sources.load_records(os.path.join(released_data, "amc23/test.jsonl"), data_source="amc")
  assert {r["data_source"] for r in records} == {"amc"}


def _write(path, text):
  with open(path, "w") as f:
    f.write(text)
  return str(path)


def test_malformed_jsonl_rows(tmp_path):
  path = _write(tmp_path / "bad.jsonl", "\n".join([
      json.dumps({"problem": "1+1?", "answer": "2"}),
      json.dumps({"problem": "no answer here"}),
      json.dumps({"problem": 12, "answer": "3"}),
      '{"problem": "broken", "answer": ',
      "",
      json.dumps({"problem": "2+2?", "answer": 4}),
  ]) + "\n")
  with pytest.raises(sources.DataError, match=r"bad\.jsonl: line 2: row has no answer"):
    sources.load_records(path)
  records, skipped = sources.load_records(path, skip_bad_rows=True)
  assert skipped == 3
  assert records == [{"data_source": "bad", "problem": "1+1?", "answer": "2"},
                     {"data_source": "bad", "problem": "2+2?", "answer": "4"}]
  good = json.dumps({"problem": "1+1?", "answer": "2"})
  for bad_line, reason in [(json.dumps({"problem": "p"}), "row has no answer"),
                           (json.dumps({"problem": 12, "answer": "3"}), "problem is missing or not a non-empty string"),
                           (json.dumps({"problem": "p", "answer": None}), "answer is missing"),
                           ('{"problem": "p", "answer": ', "broken JSON")]:
    single = _write(tmp_path / "single.jsonl", good + "\n" + bad_line + "\n")
    with pytest.raises(sources.DataError, match=r"single\.jsonl: line 2: " + reason):
      sources.load_records(single)


def test_malformed_json_array_rows(tmp_path):
  rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}, ["not", "a", "row"],
          {"problem": "c", "answer": ""}, {"problem": "d", "answer": True}]
  path = _write(tmp_path / "bad.json", json.dumps(rows))
  with pytest.raises(sources.DataError, match=r"bad\.json: row 1: answer is missing"):
    sources.load_records(path)
  assert sources.load_records(path, skip_bad_rows=True) == ([{"data_source": "bad", "problem": "a", "answer": "1"}], 4)
  broken = _write(tmp_path / "broken.json", '[\n{"problem": "a",\n "answer": }\n]')
  with pytest.raises(sources.DataError, match=r"broken\.json: line 3: broken JSON"):
    sources.load_records(broken, skip_bad_rows=True)


def test_dispatch_errors(tmp_path):
  with pytest.raises(sources.DataError, match=r"missing\.json: no such file: expected a \.json/\.jsonl/\.parquet"):
    sources.load_records(str(tmp_path / "missing.json"))
  with pytest.raises(sources.DataError, match=rf"{tmp_path}: is a directory, not a \.json/\.jsonl/\.parquet file"):
    sources.load_records(str(tmp_path))
  with pytest.raises(sources.DataError, match=r"fake\.parquet: not a readable parquet file \(Parquet magic bytes"):
    sources.load_records(_write(tmp_path / "fake.parquet", "not parquet"))
  with pytest.raises(sources.DataError, match="unsupported file type '.csv'"):
    sources.load_records(_write(tmp_path / "x.csv", "a,b\n"))
  records, skipped = sources.load_records("synthetic/mod3", synthetic_size=10, seed=1)
  assert len(records) == 10 and skipped == 0 and records[0]["data_source"] == "synthetic/mod3"


def test_json_file_holding_json_lines(tmp_path):
  lines = [{"problem": "p", "answer": "1"}, {"question": "q", "answer": "x #### 1,000"}]
  path = _write(tmp_path / "lines.json", "".join(json.dumps(line) + "\n" for line in lines))
  assert sources.load_records(path).records == [{"data_source": "lines", "problem": "p", "answer": "1"},
                                                {"data_source": "lines", "problem": "q", "answer": "1000"}]


def test_parquet_round_trip(released_data, tmp_path):
  records = (sources.load_records(os.path.join(released_data, "math500/test.jsonl")).records[:20]
             + sources.load_records(os.path.join(released_data, "gsm8k/test.jsonl")).records[:20])
  path = str(tmp_path / "out" / "test.parquet")
  sources.write_parquet(records, path, split="test")
  assert sources.load_records(path) == (records, 0)

  rows = pq.read_table(path).to_pylist()
  assert rows[0] == {
      "data_source": "math_500",
      "prompt": [{"role": "user", "content": records[0]["problem"] + " Please reason step by step, and put your "
                                             "final answer within \\boxed{}."}],
      "ability": "math",
      "reward_model": {"style": "rule", "ground_truth": records[0]["answer"]},
      "extra_info": {"split": "test", "index": 0, "answer": records[0]["answer"]},
  }
  assert [r["extra_info"]["index"] for r in rows] == list(range(40))


def test_released_parquet_written_by_pandas(tmp_path):
  # The released preprocessing writes with pandas (answer kept in extra_info, repeat suffix in data_source).
  import pandas as pd
  rows = [{"data_source": "aime_2024_1", "prompt": [{"role": "user", "content": "Find x. " + prompts.MATH_INSTRUCTION}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "204"},
           "extra_info": {"split": "train", "index": 0, "answer": "solution text"}}]
  path = str(tmp_path / "released.parquet")
  pd.DataFrame(rows).to_parquet(path)
  assert sources.load_records(path).records == [{"data_source": "aime_2024_1", "problem": "Find x.", "answer": "204"}]


def test_hub_spec_goes_through_datasets(monkeypatch):
  import datasets
  calls = []

  def fake_load_dataset(name, config=None, split=None):
    calls.append((name, config, split))
    return [{"problem": "p", "answer": "1", "solution": "s"}]

  monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
  records, _ = sources.load_records("hf://agentica-org/DeepScaleR-Preview-Dataset")
  assert records == [{"data_source": "deepscaler", "problem": "p", "answer": "1"}]
  sources.load_records("hf://owner/name@config:test")
  assert calls == [("agentica-org/DeepScaleR-Preview-Dataset", None, "train"), ("owner/name", "config", "test")]


def test_prepare_cli(released_data, tmp_path):
  output = str(tmp_path / "amc.parquet")
  result = subprocess.run(
      [sys.executable, "-m", "pacs_jax.data.prepare", "--input", os.path.join(released_data, "amc23/test.jsonl"),
       "--output", output, "--data_source", "amc23_1"],
      capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert result.returncode == 0, result.stderr
  assert "20 rows (20 records x 1), 0 skipped" in result.stdout
  records, _ = sources.load_records(output)
  expected, _ = sources.load_records(os.path.join(released_data, "amc23/test.jsonl"), data_source="amc23_1")
  assert records == expected


def released_preprocess(example, idx, source, repeat):
  """ritzz-ai/PACS src/preprocess_dataset.py process_* for our files' field names (AIME 2024's Problem/Solution/
  Answer are lower-case here; AIME 2025 has no solution: its extra_info.answer falls back to the answer)."""
  instruction = "Please reason step by step, and put your final answer within \\boxed{}."
  question, answer = example.get("problem", example.get("question")), example["answer"]
  extra_answer = {"gsm8k": answer, "math_500": example.get("solution"), "aime_2024": example.get("solution"),
                  "aime_2025": example.get("solution"), "amc23": answer}[source]
  ground_truth = answer.split("####")[-1].strip() if source == "gsm8k" else answer
  data_source = f"{source}_{repeat}" if source in ("aime_2024", "aime_2025", "amc23") else source
  return {"data_source": data_source, "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
          "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(ground_truth)},
          "extra_info": {"split": "train", "index": idx, "answer": str(extra_answer or answer)}}


@pytest.mark.parametrize("name, source, repeat", [("aime2024", "aime_2024", 2), ("aime2025", "aime_2025", 1),
                                                  ("amc23", "amc23", 8), ("math500", "math_500", 1),
                                                  ("gsm8k", "gsm8k", 1)])
def test_prepare_writes_the_released_schema(released_data, tmp_path, name, source, repeat):
  """extra_info.answer and `--repeat` (rows repeated whole, `_{repeat}` suffix for AIME/AMC) as released."""
  import pandas as pd
  src = os.path.join(released_data, name, "test.jsonl")
  output = str(tmp_path / f"{name}.parquet")
  result = subprocess.run([sys.executable, "-m", "pacs_jax.data.prepare", "--input", src, "--output", output,
                           "--repeat", str(repeat)], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert result.returncode == 0, result.stderr
  with open(src) as f:
    raw = [json.loads(line) for line in f][:20]
  frame = pd.read_parquet(output)  # as the released code reads it (datasets/pandas)
  assert list(frame.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
  rows = frame.to_dict("records")
  count = len(rows) // repeat
  assert len(rows) == count * repeat
  for i, example in enumerate(raw):
    want = released_preprocess(example, i, source, repeat)
    got = rows[i]
    assert got["data_source"] == want["data_source"]
    assert [dict(m) for m in got["prompt"]] == want["prompt"]
    assert got["reward_model"]["ground_truth"] == normalize(want["reward_model"]["ground_truth"], source)
    if source == "amc23":  # extra_info.answer is the ground truth there
      want["extra_info"]["answer"] = normalize(want["extra_info"]["answer"], source)
    assert dict(got["extra_info"]) == want["extra_info"], i
  assert rows[count]["extra_info"]["index"] == 0 if repeat > 1 else True  # the copy restarts its indices
  assert {r["data_source"] for r in rows} == {released_preprocess(raw[0], 0, source, repeat)["data_source"]}


def normalize(answer: str, source: str) -> str:
  """This project's documented ground-truth normalisation (docs/differences.md): AMC's "27.0" -> "27", GSM8K's
  "1,234" -> "1234"."""
  if source == "amc23":
    return sources.normalize_answer(float(answer))
  return sources.normalize_answer(answer.replace(",", "") if source == "gsm8k" else answer)


def test_released_eval_files(released_data, tmp_path):
  paths = sources.released_eval_files(released_data)
  assert [os.path.relpath(p, released_data) for p in paths] == [
      "gsm8k/test.jsonl", "math500/test.jsonl", "aime2024/test.jsonl", "aime2025/test.jsonl", "amc23/test.jsonl"]
  assert {sources.infer_data_source(p) for p in paths} == {"gsm8k", "math_500", "aime_2024", "aime_2025", "amc23"}
  with pytest.raises(FileNotFoundError, match="gsm8k"):
    sources.released_eval_files(str(tmp_path))
