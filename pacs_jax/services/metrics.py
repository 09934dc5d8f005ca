"""Per-step metrics to tensorBoardX, `metrics.jsonl`, optionally wandb, and a one-line console summary (process 0
only).

Each row is one newline-terminated append, so a kill leaves at most one cut-off last line. On start the
file is repaired to the rows before the first step this run will log (a partial line and rows a kill left
beyond the restored checkpoint are dropped), so a resumed run ends with exactly an uninterrupted run's rows.
TensorBoard gets the same cut through `purge_step`: a new event file starts with a marker that makes
TensorBoard discard events at or after that step from the earlier files.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from typing import Any

import jax
import numpy as np
from absl import logging

from pacs_jax import paths
from pacs_jax.services import multihost

# The console line's metrics and their names there: `reward` is the verifier's mean; an objective that shapes its
# rewards (DAPO's overlong penalty) also shows what its loss saw as `shaped_reward`.
CONSOLE_KEYS = {"reward/mean": "reward", "reward/shaped_mean": "shaped_reward", "entropy": "entropy", "loss": "loss",
                "grad_norm": "grad_norm", "response_length/mean": "response_length", "timing/step_s": "step_s",
                "val/accuracy/all": "val_accuracy"}
METRICS_FILE = "metrics.jsonl"
BAD_SUFFIX = ".bad"  # metrics.jsonl.bad: the lines a resume set aside (`repair`)
TENSORBOARD_DIR = "tensorboard"


def _plain(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray, jax.Array)):
    v = np.asarray(v).item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN/Inf
  return v


def _console_value(v: Any) -> str | None:
  if isinstance(v, (int, float)):
    return f"{v:.4g}"
  if v in ("nan", "inf", "-inf"):  # non-finite floats, as _plain writes them
    return v
  return None


class MetricsWriter:
  def __init__(self, workdir: str, resume_step: int | None = None, tracker=None):
    """`resume_step`: the step of the restored checkpoint (this run logs the steps after it), or None for a
    fresh start (it logs from step 0: rows an earlier, killed attempt left are dropped). `tracker`: one more
    destination of every row, `log(step, row)` and `close()` (`tracking.start`'s wandb run)."""
    self.active = jax.process_index() == 0
    self.path = paths.join(workdir, METRICS_FILE)
    self.tb, self.tracker = None, tracker
    if not self.active:
      return
    first_step = 0 if resume_step is None else resume_step + 1
    paths.makedirs(workdir)
    repair(self.path, first_step)
    self.tb = _summary_writer(paths.join(workdir, TENSORBOARD_DIR), purge_step=first_step)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.active:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in sorted(metrics.items())}}
    paths.append(self.path, json.dumps(row) + "\n")
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        self.tb.add_scalar(k, v, step)
    self.tb.flush()
    if self.tracker is not None:
      self.tracker.log(step, row)
    shown = ((name, _console_value(row.get(k))) for k, name in CONSOLE_KEYS.items())
    summary = "  ".join(f"{name}={v}" for name, v in shown if v)
    if not summary:  # a row of nothing the console shows (e.g. validation of another name only)
      return
    logging.info("step %d  %s", step, summary)
    print(f"step {step:5d}  {summary}", flush=True)

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()
    if self.tracker is not None:
      self.tracker.close()


def _reject_constant(name: str):
  raise ValueError(f"{name} is not JSON")  # NaN, Infinity: this writer spells them as strings


def _finite(value: Any) -> bool:
  if isinstance(value, float):
    return math.isfinite(value)  # (1e400 parses as inf)
  if isinstance(value, dict):
    return all(_finite(v) for v in value.values())
  if isinstance(value, list):
    return all(_finite(v) for v in value)
  return True


def parse_row(line: bytes) -> dict | None:
  """The row a metrics.jsonl line holds, or None unless it is one JSON object with an integer `step` >= 0 and
  finite numbers only (a line cut off by a kill, garbage, a hand-edited row with NaN or a step "3")."""
  try:
    row = json.loads(line, parse_constant=_reject_constant)
  except ValueError:  # (a UnicodeDecodeError too)
    return None
  if not isinstance(row, dict) or type(row.get("step")) is not int or row["step"] < 0 or not _finite(row):
    return None
  return row


def read_rows(path: str) -> list[dict]:
  """The rows of a metrics file (a cut-off last line or any other line that is not a row is left out)."""
  if not paths.exists(path):
    return []
  rows = (parse_row(line) for line in paths.read_bytes(path).split(b"\n"))
  return [row for row in rows if row is not None]


def repair(path: str, first_step: int) -> None:
  """Keeps the rows logged before `first_step` and drops those of steps the resumed run will log again. Any line
  that is not a row (`parse_row`: cut short by a kill, damaged, hand-edited) never stops the resume: it is set
  aside, appended to `<path>.bad`, with one warning naming the file and the line numbers."""
  if not paths.exists(path):
    return
  data = paths.read_bytes(path)
  keep, bad = [], {}
  for number, line in enumerate(data.split(b"\n"), start=1):
    if not line.strip():
      continue
    row = parse_row(line)
    if row is None:
      bad[number] = line
    elif row["step"] < first_step:
      keep.append(line + b"\n")
  if bad:
    paths.append(path + BAD_SUFFIX, b"".join(line + b"\n" for line in bad.values()))
    logging.warning("%s: line(s) %s not a finite-valued JSON row each (cut off by a kill, or edited): set aside "
                    "in %s", path, ", ".join(map(str, bad)), path + BAD_SUFFIX)
  repaired = b"".join(keep)
  if repaired != data:
    paths.write_atomic(path, repaired)


class _ObjectRecordWriter:
  """Event records for an object-store log dir: buffered, and the whole file uploaded at each flush."""

  def __init__(self, path: str):
    self.path, self.buffer = path, bytearray()
    self.failing = False

  def write(self, data: bytes) -> None:
    self.buffer += data

  def flush(self) -> None:
    """Uploads the whole file; a failure (tensorboardX flushes from its own thread, where an exception would print
    a traceback and stop the thread) is one warning, and the next flush uploads everything again."""
    try:
      paths.write_atomic(self.path, bytes(self.buffer))
    except Exception as e:  # noqa: BLE001 (an unreachable store: the main thread's writes report it)
      if not self.failing:
        logging.warning("%s: TensorBoard events not uploaded (%s: %s); retrying at the next flush", self.path,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
      self.failing = True
    else:
      self.failing = False

  def close(self) -> None:
    self.flush()


class _ObjectRecordWriterFactory:
  def open(self, path: str) -> _ObjectRecordWriter:
    return _ObjectRecordWriter(path)

  def directory_check(self, path: str) -> None:
    pass  # object stores have no directories


def _summary_writer(logdir: str, purge_step: int):
  """tensorboardX's SummaryWriter, imported only here. Its own gs:// writer is a second GCS client
  (google-cloud-storage, own credentials); a gs:// log dir is written through the same path layer as everything
  else instead."""
  with _without_torch():
    from tensorboardX import SummaryWriter, record_writer
  record_writer.register_writer_factory("gs", _ObjectRecordWriterFactory())
  return SummaryWriter(logdir, purge_step=purge_step)


@contextlib.contextmanager
def _without_torch():
  """tensorboardX imports torch where it is installed (1.5 s of every run's start), only to take torch tensors as
  values; this writer logs floats. Unless torch is loaded already, it is hidden while tensorboardX is imported
  (tensorboardX then takes numpy arrays, its fallback), and importable again afterwards."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError
  try:
    yield
  finally:
    if hide and sys.modules.get("torch", False) is None:
      del sys.modules["torch"]


def warn_skipped_updates(step: int, skipped_total: float, skipped_before: int, updates: int) -> int:
  """Warns when this step skipped updates for a non-finite gradient; returns the new running total."""
  skipped = int(skipped_total) - skipped_before
  if skipped:
    logging.warning("step %d: %d of %d updates skipped (non-finite gradient)%s", step, skipped, updates,
                    ": the parameters did not change" if skipped >= updates else "")
  return int(skipped_total)


def prompt_texts(tokenizer, prompts: list[list[int]], indices: list[int]) -> list[str]:
  """Prompt texts as the released dumps show them (special tokens dropped), one per row of `indices`."""
  texts = {i: tokenizer.decode(prompts[i], skip_special_tokens=True) for i in set(indices)}
  return [texts[i] for i in indices]


def dump_generations(directory: str, step: int, inputs: list[str], outputs: list[str], scores, data_sources,
                     ground_truths, extra: dict[str, list] | None = None) -> str:
  """Writes `directory/<step>.jsonl`, one line per response, as the released RayPPOTrainer._dump_generations:
  {input, output, score, step} plus the reward function's extra fields (data_source, ground_truth)."""
  path = paths.join(directory, multihost.process_file_name(step, ".jsonl"))
  columns = {"input": inputs, "output": outputs, "score": [float(x) for x in scores], "step": [step] * len(inputs),
             "data_source": list(data_sources), "ground_truth": list(ground_truths), **(extra or {})}
  lines = (json.dumps({k: v[i] for k, v in columns.items()}, ensure_ascii=False) + "\n" for i in range(len(inputs)))
  paths.write_atomic(path, "".join(lines).encode("utf-8"))
  return path
