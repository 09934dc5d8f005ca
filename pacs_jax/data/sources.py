"""Dataset readers that normalise every source to records `{data_source, problem, answer}`, and the
writer of the released (verl) parquet format.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Iterable, Iterator, NamedTuple

from pacs_jax import paths
from pacs_jax.data import prompts
from pacs_jax.data.prompts import MATH_INSTRUCTION
from pacs_jax.data import synthetic_tasks
from pacs_jax.rewards import synthetic as synthetic_verifier

logger = logging.getLogger(__name__)

HUB_PREFIX = "hf://"
# Substrings of a path or hub name -> the data_source names of the released preprocessing
# (ritzz-ai/PACS src/preprocess_dataset.py, without its `_{repeat}` suffix). First match wins.
_KNOWN_SOURCES = (
    ("deepscaler", "deepscaler"),
    ("gsm8k", "gsm8k"),
    ("math500", "math_500"), ("math_500", "math_500"), ("math-500", "math_500"),
    ("aime2024", "aime_2024"), ("aime_2024", "aime_2024"), ("aime24", "aime_2024"),
    ("aime2025", "aime_2025"), ("aime_2025", "aime_2025"), ("aime25", "aime_2025"),
    ("amc23", "amc23"), ("amc2023", "amc23"),
)


# The sets the released runs validate on (scripts/pacs/*.sh data.val_files), as <name>/test.jsonl in a folder
# laid out like tests/fixtures/data (which holds a few rows of each).
RELEASED_EVAL_SETS = ("gsm8k", "math500", "aime2024", "aime2025", "amc23")


def set_name(data_source: str) -> str:
  """The name `--data` gives a released set (`math500`) for its data_source (`math_500`, the released files' key);
  any other source as it is."""
  by_source = {infer_data_source(name): name for name in RELEASED_EVAL_SETS}
  return by_source.get(data_source, data_source)


def released_eval_files(directory: str) -> list[str]:
  """`directory`/<name>/test.jsonl for each of RELEASED_EVAL_SETS; a missing one is an error naming it."""
  paths = [os.path.join(directory, name, "test.jsonl") for name in RELEASED_EVAL_SETS]
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise FileNotFoundError(f"data.val_dir={directory!r} lacks {missing} (expected <name>/test.jsonl for each of "
                            f"{RELEASED_EVAL_SETS})")
  return paths


class DataError(ValueError):
  """A malformed file or row; the message names the file and the 1-based line (JSON Lines) or the
  0-based row index (JSON arrays, parquet, hub datasets)."""


class ReadResult(NamedTuple):
  records: list[dict]
  num_skipped: int  # malformed rows skipped (only with skip_bad_rows=True)


def infer_data_source(spec: str) -> str:
  """The released data_source name for a path or hub name, else the file's stem."""
  lowered = spec.lower()
  for key, name in _KNOWN_SOURCES:
    if key in lowered:
      return name
  base = os.path.basename(spec.rstrip("/")) or spec
  return base.split(".")[0]


def normalize_answer(value: Any) -> str:
  """A ground truth as text: `27.0` -> "27", 70 -> "70", strings stripped; raises on missing ones."""
  if value is None or isinstance(value, bool):
    raise ValueError(f"answer is missing or not a number/string: {value!r}")
  if isinstance(value, int):
    return str(value)
  if isinstance(value, float):
    if not math.isfinite(value):
      raise ValueError(f"answer is not finite: {value!r}")
    return str(int(value)) if value.is_integer() else repr(value)
  if isinstance(value, str):
    if not value.strip():
      raise ValueError("answer is empty")
    return value.strip()
  raise ValueError(f"answer has unsupported type {type(value).__name__}: {value!r}")


def _problem_from_prompt(prompt: Any) -> str:
  """The problem inside a released chat prompt: the last user message, instruction suffix removed."""
  if hasattr(prompt, "tolist"):  # numpy arrays from pandas-written parquet
    prompt = prompt.tolist()
  if not isinstance(prompt, (list, tuple)) or not prompt:
    raise ValueError(f"`prompt` must be a non-empty list of chat messages, got {type(prompt).__name__}")
  users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
  if not users:
    raise ValueError("`prompt` has no user message")
  content = users[-1].get("content")
  if not isinstance(content, str):
    raise ValueError(f"user message content is not a string: {content!r}")
  return content.removesuffix(" " + MATH_INSTRUCTION)


def solution_text(row: dict, answer: str) -> str:
  """What the released preprocessing keeps in extra_info.answer (src/preprocess_dataset.py): the row's worked
  solution (MATH-500 `solution`, AIME 2024 `Solution`, AIME 2025 `solution`, GSM8K's whole `answer`), else the
  answer itself (DeepScaleR, AMC23)."""
  extra = row.get("extra_info")
  if isinstance(extra, dict) and isinstance(extra.get("answer"), str):  # already the released layout
    return extra["answer"]
  for key in ("solution", "Solution"):
    if isinstance(row.get(key), str) and row[key].strip():
      return row[key]
  if isinstance(row.get("answer"), str) and "####" in row["answer"]:
    return row["answer"]
  return answer


def normalize_row(row: Any, data_source: str | None = None, default_source: str | None = None,
                  with_solution: bool = False) -> dict:
  """One raw row (any supported layout) -> record; raises ValueError saying what is wrong.

  data_source overrides the row's own; default_source names rows that have none. `with_solution` adds
  "solution" (`solution_text`, for the released parquet's extra_info.answer).
  """
  record = _normalize_row(row, data_source, default_source)
  if with_solution:
    record["solution"] = solution_text(row, record["answer"])
  return record


def _normalize_row(row: Any, data_source: str | None, default_source: str | None) -> dict:
  if not isinstance(row, dict):
    raise ValueError(f"row is a {type(row).__name__}, expected an object")
  if "reward_model" in row:  # released (verl) layout
    problem = _problem_from_prompt(row.get("prompt"))
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
      raise ValueError("row has no reward_model.ground_truth")
    answer = normalize_answer(reward_model["ground_truth"])
    source = data_source or row.get("data_source") or default_source
    if not isinstance(source, str):
      raise ValueError(f"data_source is not a string: {source!r}")
    return {"data_source": source, "problem": problem, "answer": answer}
  problem = row["problem"] if "problem" in row else row.get("question")
  if not isinstance(problem, str) or not problem.strip():
    raise ValueError(f"problem is missing or not a non-empty string: {problem!r:.80}")
  if "answer" not in row:
    raise ValueError("row has no answer")
  answer = row["answer"]
  if isinstance(answer, str) and "####" in answer:  # GSM8K: a worked solution ending in "#### 1,234"
    answer = answer.rsplit("####", 1)[1].replace(",", "")
  return {"data_source": data_source or default_source, "problem": problem, "answer": normalize_answer(answer)}


def _collect(rows: Iterable[tuple[str, Any]], path: str, data_source: str | None,
             skip_bad_rows: bool, default_source: str | None = None, with_solution: bool = False) -> ReadResult:
  """rows: (location, raw row or a ValueError raised while reading it)."""
  default_source = default_source or infer_data_source(path)
  records, skipped = [], 0
  for where, row in rows:
    try:
      if isinstance(row, Exception):
        raise row
      records.append(normalize_row(row, data_source, default_source, with_solution))
    except (ValueError, TypeError) as e:
      if not skip_bad_rows:
        raise DataError(f"{path}: {where}: {e} (--config.data.skip_bad_rows=True skips bad rows)") from e
      skipped += 1
      logger.debug("skipping %s: %s: %s", path, where, e)
  if not records:
    raise DataError(f"{path}: no usable rows" + (f" (all {skipped} were malformed)" if skipped else
                                                  " (the file is empty)"))
  if skipped:
    logger.warning("%s: skipped %d malformed rows of %d", path, skipped, skipped + len(records))
  return ReadResult(records, skipped)


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
  with paths.open(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        yield f"line {line_number}", ValueError(f"invalid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})")
        continue
      if not line.strip():
        continue
      try:
        yield f"line {line_number}", json.loads(line)
      except json.JSONDecodeError as e:
        yield f"line {line_number}", ValueError(f"broken JSON ({e.msg} at column {e.colno})")


def _has_invalid_utf8(value: Any) -> bool:
  """Whether text decoded with surrogateescape (which keeps invalid bytes as lone surrogates) had any."""
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError:
      return True
    return False
  if isinstance(value, dict):
    return any(_has_invalid_utf8(k) or _has_invalid_utf8(v) for k, v in value.items())
  if isinstance(value, list):
    return any(_has_invalid_utf8(v) for v in value)
  return False


def read_json(path: str, data_source: str | None = None, skip_bad_rows: bool = False,
              with_solution: bool = False) -> ReadResult:
  """A JSON array of rows (DeepScaleR); a file holding JSON Lines is read as such."""
  # Invalid UTF-8 bytes survive decoding as lone surrogates, so that only the rows holding them are bad.
  text = paths.read_bytes(path).decode("utf-8", errors="surrogateescape")
  if not text.lstrip().startswith("["):
    return read_jsonl(path, data_source, skip_bad_rows, with_solution)
  try:
    rows = json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: line {e.lineno}: broken JSON ({e.msg} at column {e.colno})") from e
  if not isinstance(rows, list):
    raise DataError(f"{path}: expected a JSON array of rows, got {type(rows).__name__}")
  bad_utf8 = ValueError("invalid UTF-8")
  return _collect(((f"row {i}", bad_utf8 if _has_invalid_utf8(row) else row) for i, row in enumerate(rows)),
                  path, data_source, skip_bad_rows, with_solution=with_solution)


def read_jsonl(path: str, data_source: str | None = None, skip_bad_rows: bool = False,
               with_solution: bool = False) -> ReadResult:
  """JSON Lines (MATH-500, AIME 2024/2025, AMC23, GSM8K); errors name the 1-based line."""
  return _collect(_jsonl_rows(path), path, data_source, skip_bad_rows, with_solution=with_solution)


def read_parquet(path: str, data_source: str | None = None, skip_bad_rows: bool = False,
                 with_solution: bool = False) -> ReadResult:
  """The released preprocessed parquet (or any parquet with problem/answer columns)."""
  import pyarrow.parquet as pq

  import pyarrow as pa

  with paths.open(path, "rb") as f:
    try:
      rows = pq.read_table(f).to_pylist()
    except pa.ArrowException as e:  # pyarrow names the file '<Buffer>'
      cause = str(e).replace("Could not open Parquet input source '<Buffer>': ", "")
      raise DataError(f"{path}: not a readable parquet file ({cause})") from e
  return _collect(((f"row {i}", row) for i, row in enumerate(rows)), path, data_source, skip_bad_rows,
                  with_solution=with_solution)


def read_hub(spec: str, data_source: str | None = None, skip_bad_rows: bool = False,
             with_solution: bool = False) -> ReadResult:
  """`hf://owner/name[@config][:split]` (split defaults to train) through `datasets.load_dataset`."""
  import datasets  # optional dependency (the `hub` extra)

  name = spec.removeprefix(HUB_PREFIX)
  split = "train"
  if ":" in name:
    name, split = name.rsplit(":", 1)
  config = None
  if "@" in name:
    name, config = name.split("@", 1)
  dataset = datasets.load_dataset(name, config, split=split)
  return _collect(((f"row {i}", row) for i, row in enumerate(dataset)), spec, data_source, skip_bad_rows,
                  default_source=infer_data_source(name), with_solution=with_solution)


def load_records(spec: str, *, data_source: str | None = None, skip_bad_rows: bool = False,
                 synthetic_size: int = 4096, seed: int = 0, with_solution: bool = False,
                 held_out: bool = False) -> ReadResult:
  """Records from a file path (.json, .jsonl, .parquet), a hub path (`hf://...`) or a built-in
  synthetic task (`synthetic/<name>`: `synthetic_size` problems drawn with `seed`; `held_out`: from the task's
  test split when it has one, as evaluation and validation read it, never a training problem)."""
  if synthetic_verifier.is_synthetic(spec):
    task = synthetic_tasks.get_task(spec)
    records = (task.held_out(synthetic_size, seed) if held_out and hasattr(task, "held_out")
               else task.records(synthetic_size, seed))
    return ReadResult([dict(r, solution=r["answer"]) for r in records] if with_solution else records, 0)
  if spec.startswith(HUB_PREFIX):
    return read_hub(spec, data_source, skip_bad_rows, with_solution)
  if not paths.isfile(spec):
    what = "is a directory, not" if paths.isdir(spec) else "no such file: expected"
    raise DataError(f"{spec}: {what} a .json/.jsonl/.parquet file (or hf://owner/name, synthetic/<task>)")
  extension = os.path.splitext(spec)[1].lower()
  readers = {".json": read_json, ".jsonl": read_jsonl, ".parquet": read_parquet}
  if extension not in readers:
    raise DataError(f"{spec}: unsupported file type {extension!r}; use .json, .jsonl or .parquet")
  return readers[extension](spec, data_source, skip_bad_rows, with_solution)


def load_split(spec: str, skip_bad_rows: bool, synthetic_size: int, seed: int,
               held_out: bool = False) -> tuple[list[dict], int]:
  """Records of every comma-separated source in `spec` (as `load_records` reads one), and how many malformed
  rows were skipped."""
  records, skipped = [], 0
  for one in filter(None, (s.strip() for s in spec.split(","))):
    result = load_records(one, skip_bad_rows=skip_bad_rows, synthetic_size=synthetic_size, seed=seed,
                          held_out=held_out)
    records += result.records
    skipped += result.num_skipped
  return records, skipped


# Sources whose released data_source carries the `_{repeat}` suffix (preprocess_dataset.py process_aime_2024,
# process_aime_2025, process_amc23: "aime_2024_1" even without repetition).
REPEAT_SUFFIXED = ("aime_2024", "aime_2025", "amc23")


def released_data_source(source: str, repeat: int = 1) -> str:
  return f"{source}_{repeat}" if source in REPEAT_SUFFIXED else source


def to_verl_rows(records: list[dict], split: str = "train", repeat: int = 1) -> list[dict]:
  """Records -> rows of the released parquet format (src/preprocess_dataset.py): prompt with the instruction, rule
  reward, extra_info {split, index, answer}; AIME/AMC data sources get the `_{repeat}` suffix, and the whole
  list is repeated `repeat` times (indices restart with each copy, as `data * repeat` there)."""
  rows = [{
      "data_source": released_data_source(r["data_source"], repeat),
      "prompt": [{"role": "user", "content": prompts.user_message(r["problem"])}],
      "ability": "math",
      "reward_model": {"style": "rule", "ground_truth": r["answer"]},
      "extra_info": {"split": split, "index": i, "answer": r.get("solution", r["answer"])},
  } for i, r in enumerate(records)]
  return rows * repeat


def write_parquet(records: list[dict], path: str, split: str = "train", repeat: int = 1) -> None:
  """Writes records in the released (verl) parquet format; `read_parquet` gives them back."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  if repeat < 1:
    raise ValueError(f"repeat must be >= 1, got {repeat}")
  schema = pa.schema([
      ("data_source", pa.string()),
      ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
      ("ability", pa.string()),
      ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
      ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string())])),
  ])
  buffer = pa.BufferOutputStream()
  pq.write_table(pa.Table.from_pylist(to_verl_rows(records, split, repeat), schema=schema), buffer)
  paths.write_atomic(path, buffer.getvalue().to_pybytes())
