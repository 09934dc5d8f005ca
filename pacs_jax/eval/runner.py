"""pass@k evaluation: n sampled responses per problem, scored, appended to `eval_rollout.jsonl` chunk by chunk
(so a restart skips what is written) and summarised per data source in `eval_metrics.json`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pacs_jax import paths
from pacs_jax.data import sources, synthetic
from pacs_jax.eval import passk

logger = logging.getLogger(__name__)

ROLLOUT_FILE = "eval_rollout.jsonl"
METRICS_FILE = "eval_metrics.json"
# Dataset names accepted by `--data`, as files under `--data_dir` (the layout of the prepared test sets).
KNOWN_DATASETS = {name: f"{name}/test.jsonl" for name in ("math500", "aime2024", "aime2025", "amc23", "gsm8k")}
DTYPES = ("bfloat16", "float32")
# Settings that change the responses themselves: rows written under other values must not be mixed in.
_RESPONSE_SETTINGS = ("n", "temperature", "top_k", "top_p", "max_new_tokens", "seed", "dtype")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  n: int = 32
  temperature: float = 0.6
  top_k: int = 0
  top_p: float = 0.95
  max_new_tokens: int = 4096
  max_prompt_length: int = 1024  # longer prompts are dropped (and counted), never truncated
  seed: int = 0
  dtype: str = "bfloat16"  # weights and compute
  batch_slots: int = 256  # concurrent decodes; each holds a KV cache of max_prompt_length + max_new_tokens rows
  chunk_problems: int = 0  # problems per generate call and file append; 0: enough for 4x batch_slots responses
  limit: int | None = None  # first `limit` problems of each data file

  def __post_init__(self):
    if self.n < 1 or self.max_new_tokens < 1 or self.max_prompt_length < 1 or self.batch_slots < 1:
      raise ValueError(f"n, max_new_tokens, max_prompt_length and batch_slots must be positive: {self}")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
    if self.limit is not None and self.limit < 1:
      raise ValueError(f"limit must be positive, got {self.limit}")

  def problems_per_chunk(self) -> int:
    return self.chunk_problems or max(1, -(-4 * self.batch_slots // self.n))


@dataclasses.dataclass
class Problem:
  data_source: str
  index: int  # position among its data source's records (before overlong prompts are dropped)
  answer: str
  prompt_ids: list[int]

  @property
  def key(self) -> tuple[str, int]:
    return (self.data_source, self.index)

  @property
  def seed_id(self) -> int:
    """The engine's prompt id: a function of (source, index) alone, so a problem's samples do not depend
    on the other problems, their order, `--limit` or chunking, and a resumed run draws what a fresh one would."""
    return zlib.crc32(f"{self.data_source}/{self.index}".encode()) & 0x7FFFFFFF


# ----------------------------------------------------------------------------------------------
# Inputs: data and model


def resolve_data(data: str | Sequence[str], data_dir: str | None = None) -> list[str]:
  """`--data` entries -> load_records specs: known names under `data_dir`, else paths / hf:// / synthetic/."""
  entries = [e.strip() for e in (data.split(",") if isinstance(data, str) else data)]
  specs = []
  for entry in filter(None, entries):
    if entry in KNOWN_DATASETS:
      if not data_dir:
        raise ValueError(f"--data {entry} is a dataset name: pass --data_dir (the folder holding "
                         f"{KNOWN_DATASETS[entry]}) or give the file's path")
      specs.append(paths.join(data_dir, KNOWN_DATASETS[entry]))
    elif entry.startswith(sources.HUB_PREFIX) or synthetic.is_synthetic(entry) or paths.isfile(entry):
      specs.append(entry)
    else:
      raise FileNotFoundError(f"--data {entry!r}: not a file, hf:// dataset, synthetic/<task>, nor one of "
                              f"{sorted(KNOWN_DATASETS)}")
  if not specs:
    raise ValueError("--data names no data set")
  return specs


def load_problems(specs: Sequence[str], tokenizer, max_prompt_length: int, limit: int | None = None
                  ) -> tuple[list[Problem], dict[str, int]]:
  """Problems of every spec with their prompt ids, and per data source how many overlong prompts were dropped."""
  problems, dropped, next_index = [], {}, {}
  for spec in specs:
    records = sources.load_records(spec, synthetic_size=limit or 4096).records[:limit]
    # The built-in synthetic prompts carry no instruction (its words are not in their vocabulary).
    instruction = None if synthetic.is_synthetic(spec) else sources.MATH_INSTRUCTION
    prompt_ids = _encode(tokenizer, [r["problem"] for r in records], instruction)
    for record, ids in zip(records, prompt_ids):
      source = record["data_source"]
      index = next_index.get(source, 0)
      next_index[source] = index + 1
      dropped.setdefault(source, 0)
      if len(ids) > max_prompt_length:
        dropped[source] += 1
        continue
      problems.append(Problem(source, index, record["answer"], ids.tolist()))
  for source, count in dropped.items():
    if count:
      logger.warning("%s: dropped %d prompts longer than %d tokens", source, count, max_prompt_length)
  return problems, dropped


def _encode(tokenizer, problems, instruction):
  from pacs_jax.data import pipeline  # grain is imported only when there is something to encode
  return pipeline.encode_prompts(tokenizer, problems, instruction)


def is_workdir(path: str) -> bool:
  return paths.isdir(paths.join(path, "checkpoints")) and paths.isfile(paths.join(path, "model", "config.json"))


def resolve_model(path: str, step: int | None = None) -> str:
  """A Hugging Face directory to evaluate: `path` itself, or a training workdir's checkpoint exported to
  `path/export_step_<S>` (latest step by default; reused when already there)."""
  if not is_workdir(path):
    if not paths.isfile(paths.join(path, "config.json")):
      raise FileNotFoundError(f"--model {path}: neither a Hugging Face directory (config.json) nor a training "
                              "workdir (checkpoints/ and model/)")
    return path
  from pacs_jax.train import export_lib
  if step is None:
    step = export_lib.latest_step(path)
  out = paths.join(path, f"export_step_{step}")
  if not paths.isfile(paths.join(out, "config.json")):
    if paths.is_remote(out):  # config.json is uploaded last: a directory without it is incomplete
      export_lib.export(path, out, step=step)
    else:  # exported beside, then renamed: a crash mid-export leaves no directory that looks complete
      partial = f"{out}.partial-{os.getpid()}"
      export_lib.export(path, partial, step=step)
      os.replace(partial, out)
  return out


# ----------------------------------------------------------------------------------------------
# The files


def read_rollout(path: str) -> dict[tuple[str, int, int], dict]:
  """Rows of an existing rollout file by (data_source, problem_index, sample_index), first one kept.

  A line cut short by a crash, or a duplicated row, is dropped and the file rewritten without it, so
  appends after it start on a clean line.
  """
  if not paths.isfile(path):
    return {}
  rows, clean = {}, True
  with paths.open(path) as f:
    for line_number, line in enumerate(f, start=1):
      try:
        row = json.loads(line)
        key = (row["data_source"], int(row["problem_index"]), int(row["sample_index"]))
      except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        logger.warning("%s: line %d is not a complete row; dropping it", path, line_number)
        clean = False
        continue
      clean &= line.endswith("\n") and key not in rows
      rows.setdefault(key, row)
  if not clean:
    _write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows.values()))
  return rows


def _write_atomic(path: str, text: str) -> None:
  paths.write_atomic(path, text)


def check_resumable(out_dir: str, settings: dict, rows: dict, problems: Sequence[Problem]) -> None:
  """Refuses to mix in rows written with other sampling settings, another model or other answers."""
  path = paths.join(out_dir, METRICS_FILE)
  if paths.isfile(path):
    with paths.open(path) as f:
      before = json.load(f).get("settings", {})
    for name in _RESPONSE_SETTINGS + ("model",):
      if name in before and before[name] != settings[name]:
        raise ValueError(f"{out_dir} holds an evaluation with {name}={before[name]!r}, not {settings[name]!r}: "
                         f"use another --out, or delete {ROLLOUT_FILE} and {METRICS_FILE} there")
  answers = {p.key: p.answer for p in problems}
  for (source, index, sample), row in rows.items():
    if sample >= settings["n"]:
      raise ValueError(f"{out_dir}/{ROLLOUT_FILE} has sample {sample} of {source} #{index}, beyond n={settings['n']}")
    if (source, index) in answers and row.get("answer") != answers[(source, index)]:
      raise ValueError(f"{out_dir}/{ROLLOUT_FILE}: {source} #{index} has answer {row.get('answer')!r} there but "
                       f"{answers[(source, index)]!r} in the data: the data changed; use another --out")


def compute_metrics(rows: dict, problems: Sequence[Problem], n: int, dropped: dict[str, int]) -> dict[str, Any]:
  """Per data source: pass@k (k = 1, 2, 4, ... <= n) over problems with all n samples scored, mean accuracy,
  counts, truncation; plus the overall mean accuracy."""
  per_source: dict[str, list[Problem]] = {source: [] for source in dropped}
  for p in problems:
    per_source.setdefault(p.data_source, []).append(p)
  out, all_scores = {}, []
  for source, source_problems in per_source.items():
    counts, scores, tokens, truncated = [], [], [], 0
    for p in source_problems:
      samples = [rows.get(p.key + (s,)) for s in range(n)]
      if any(r is None for r in samples):
        continue
      counts.append(int(sum(r["score"] > 0.5 for r in samples)))
      scores += [float(r["score"]) for r in samples]
      tokens += [int(r["num_tokens"]) for r in samples]
      truncated += sum(r["finish_reason"] == "length" for r in samples)
    entry = passk.pass_at_k_table({source: counts}, n)[source] if counts else {}
    out[source] = {f"pass@{k}": v for k, v in entry.items()}
    out[source].update({
        "mean_accuracy": float(np.mean(scores)) if scores else None,
        "num_problems": len(source_problems), "num_problems_scored": len(counts), "num_responses": len(scores),
        "num_dropped_overlong": dropped.get(source, 0),
        "truncated_fraction": truncated / len(scores) if scores else None,
        "mean_response_tokens": float(np.mean(tokens)) if tokens else None,
    })
    all_scores += scores
  overall = {"mean_accuracy": float(np.mean(all_scores)) if all_scores else None, "num_responses": len(all_scores),
             "num_problems": len(problems)}
  return {"sources": out, "overall": overall}


# ----------------------------------------------------------------------------------------------
# The run


def evaluate(model: str, data: str | Sequence[str], settings: EvalSettings, *, out_dir: str | None = None,
             data_dir: str | None = None, step: int | None = None, mesh=None, scorer=None, reward_workers: int = 2,
             reward_timeout_s: float = 10.0, progress: bool = True) -> dict[str, Any]:
  """Samples, scores and writes what is missing from `out_dir` (default: beside the evaluated weights);
  returns the metrics written to `eval_metrics.json`.

  `scorer`: anything with `score_batch(responses, answers, data_sources) -> (scores, stats)`
  (default: a math-verify `RewardScorer` with `reward_workers` processes).
  """
  import jax
  import jax.numpy as jnp
  from tqdm.auto import tqdm

  from pacs_jax.models import hf
  from pacs_jax.rewards import math as rewards_lib
  from pacs_jax.rollout import engine as engine_lib
  from pacs_jax.rollout import sampling as sampling_lib

  sampling = sampling_lib.from_config(settings.temperature, settings.top_k, settings.top_p)
  specs = resolve_data(data, data_dir)
  model_dir = resolve_model(model, step)
  out_dir = out_dir or model_dir
  paths.makedirs(out_dir)
  with paths.local_dir(model_dir, exclude=(".safetensors",)) as local_model:  # a gs:// model: a local copy
    tokenizer = hf.load_tokenizer(local_model)
  problems, dropped = load_problems(specs, tokenizer, settings.max_prompt_length, settings.limit)
  if not problems:
    raise ValueError(f"no problem of {specs} fits max_prompt_length={settings.max_prompt_length} "
                     f"(dropped per source: {dropped})")
  n = settings.n
  recorded = dataclasses.asdict(settings) | {"model": paths.canonical(model_dir), "data": specs}
  rollout_path = paths.join(out_dir, ROLLOUT_FILE)
  rows = read_rollout(rollout_path)
  check_resumable(out_dir, recorded, rows, problems)

  def write_metrics(complete: bool) -> dict[str, Any]:
    metrics = {"complete": complete, "settings": recorded} | compute_metrics(rows, problems, n, dropped)
    _write_atomic(paths.join(out_dir, METRICS_FILE), json.dumps(metrics, indent=2) + "\n")
    return metrics

  todo = [p for p in problems if any(p.key + (s,) not in rows for s in range(n))]
  metrics = write_metrics(complete=not todo)  # records the settings before the first (long) chunk
  if not todo:
    return metrics

  dtype = getattr(jnp, settings.dtype)
  chunk = settings.problems_per_chunk()
  with paths.local_dir(model_dir) as local_model, (
      jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
    eos = hf.eos_token_ids(tokenizer, local_model)
    policy, _ = hf.load_pretrained(local_model, dtype=dtype, mesh=mesh, compute_dtype=dtype)
  # No more slots than one chunk can fill (the KV cache is allocated per slot), and a multiple of the model
  # replicas so that the slots split evenly over them instead of being replicated.
  replicas = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
  slots = -(-min(settings.batch_slots, chunk * n) // replicas) * replicas
  engine = engine_lib.Engine(policy, max_concurrent_decodes=slots,
                             max_prefill_length=settings.max_prompt_length,
                             max_decode_length=settings.max_new_tokens, mesh=mesh, eos_ids=eos)
  params = engine.load_params(policy)
  del policy
  own_scorer = scorer is None
  if own_scorer:
    scorer = rewards_lib.RewardScorer(num_workers=reward_workers, timeout_s=reward_timeout_s)
  bar = tqdm(total=len(problems) * n, initial=len(problems) * n - len(todo) * n, unit="response",
             desc="eval", disable=not progress, dynamic_ncols=True)
  try:
    for start in range(0, len(todo), chunk):
      batch = todo[start:start + chunk]
      completions = engine_lib.generate(
          engine, params, [p.prompt_ids for p in batch], n=n, max_new_tokens=settings.max_new_tokens,
          sampling=sampling, seed=settings.seed, eos_ids=eos, prompt_ids=[p.seed_id for p in batch])
      # Samples already on file (a problem cut short by a crash) are redrawn identically and not written twice.
      completions = [c for c in completions if batch[c.prompt_index].key + (c.sample_index,) not in rows]
      texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
      scores, _ = scorer.score_batch(texts, [batch[c.prompt_index].answer for c in completions],
                                     [batch[c.prompt_index].data_source for c in completions])
      new = []
      for c, text, score in zip(completions, texts, scores):
        p = batch[c.prompt_index]
        row = {"data_source": p.data_source, "problem_index": p.index, "sample_index": c.sample_index,
               "answer": p.answer, "score": float(score), "finish_reason": c.finish_reason,
               "num_tokens": len(c.tokens), "response": text}
        rows[p.key + (c.sample_index,)] = row
        new.append(json.dumps(row) + "\n")
      paths.append(rollout_path, "".join(new))  # one write: a kill cuts at most this chunk
      metrics = write_metrics(complete=start + chunk >= len(todo))
      bar.update(len(batch) * n)
      bar.set_postfix(accuracy=f"{metrics['overall']['mean_accuracy'] or 0:.3f}")
  finally:
    bar.close()
    if own_scorer:
      scorer.close()
  return metrics


def summary_table(metrics: dict[str, Any]) -> str:
  """Plain-text table: one row per data source, pass@k columns in percent."""
  by_source = metrics["sources"]
  ks = sorted({int(name[5:]) for entry in by_source.values() for name in entry if name.startswith("pass@")})
  header = ["data_source", "problems"] + [f"pass@{k}" for k in ks]
  lines = [header]
  for source, entry in by_source.items():
    lines.append([source, str(entry["num_problems_scored"])] +
                 [f"{100 * entry[f'pass@{k}']:.2f}" if f"pass@{k}" in entry else "-" for k in ks])
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
                   for line in lines)
