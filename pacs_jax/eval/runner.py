"""pass@k evaluation: n sampled responses per problem, scored, written in the released layouts (ritzz-ai/PACS
src/inference.py): `eval_rollout.jsonl` (one line per problem, appended once all its samples are scored, so a
restart skips what is written) and `eval_metrics.json` ({data_source: {"pass@k": value}}); settings, counts and
accuracies in `eval_summary.json`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
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
METRICS_FILE = "eval_metrics.json"  # exactly the released file: {data_source: {"pass@k": value}}
SUMMARY_FILE = "eval_summary.json"  # this project's: settings (for resuming), counts, accuracy, truncation
# The key of this project's lines in eval_rollout.jsonl, written first: lines without it are someone else's
# (e.g. the released inference.py's) and are never rewritten or removed.
OWN_KEY = "pacs_jax"
_OWN_PREFIX = '{"' + OWN_KEY + '":'
RELEASED_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # inference.py's pass@k list
# Dataset names accepted by `--data`, as files under `--data_dir` (the layout of the prepared test sets).
KNOWN_DATASETS = {name: f"{name}/test.jsonl" for name in ("math500", "aime2024", "aime2025", "amc23", "gsm8k")}
DTYPES = ("bfloat16", "float32")
# Settings that change the responses themselves: rows written under other values must not be mixed in.
_RESPONSE_SETTINGS = ("n", "temperature", "top_k", "top_p", "max_new_tokens", "seed", "dtype", "stop_tokens")


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
  stop_tokens: str = "released"  # as config.rollout.stop_tokens; inference.py stops as the released rollout
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
  user_message: str = ""  # the prompt's user message (the released data row's prompt[0]["content"])

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
      message = f"{record['problem']} {instruction}" if instruction else record["problem"]
      source = record["data_source"]
      index = next_index.get(source, 0)
      next_index[source] = index + 1
      dropped.setdefault(source, 0)
      if len(ids) > max_prompt_length:
        dropped[source] += 1
        continue
      problems.append(Problem(source, index, record["answer"], ids.tolist(), message))
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
# The files (small functions: every read and write of the output directory is here)


def problem_line(problem: Problem, samples: Sequence[dict]) -> dict:
  """One eval_rollout.jsonl line: the released data row (preprocess_dataset.py layout) plus `rollout`, a list of
  {output, score: {score, data_source, ground_truth}} (reward_function.compute_score's dict) with this
  project's extras; our key comes first (see OWN_KEY)."""
  return {
      OWN_KEY: {"data_source": problem.data_source, "index": problem.index},
      "data_source": problem.data_source,
      "prompt": [{"role": "user", "content": problem.user_message}],
      "ability": "math",
      "reward_model": {"style": "rule", "ground_truth": problem.answer},
      "extra_info": {"split": "test", "index": problem.index, "answer": problem.answer},
      "rollout": [{"output": s["output"],
                   "score": {"score": s["score"], "data_source": problem.data_source, "ground_truth": problem.answer},
                   "finish_reason": s["finish_reason"], "num_tokens": s["num_tokens"]} for s in samples],
  }


def own_key(line: dict) -> tuple[str, int] | None:
  """(data_source, problem index) of a line this project wrote; None for anyone else's."""
  own = line.get(OWN_KEY) if isinstance(line, dict) else None
  if not isinstance(own, dict):
    return None
  try:
    return (own["data_source"], int(own["index"]))
  except (KeyError, TypeError, ValueError):
    return None


def read_rollout(path: str) -> tuple[dict[tuple[str, int], dict], int]:
  """(this project's complete lines by (data_source, index), the number of other lines). Reads only."""
  if not paths.isfile(path):
    return {}, 0
  own, others = {}, 0
  with paths.open(path) as f:
    for line in f:
      if not line.endswith("\n"):
        break  # cut short by a crash: `repair_tail` deals with it
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        others += 1
        continue
      key = own_key(row)
      if key is None:
        others += 1
      else:
        own.setdefault(key, row)
  return own, others


def repair_tail(path: str) -> None:
  """Makes appends start on a fresh line: a last line of ours cut short by a crash is cut off (we wrote it);
  anything else is left as it is and only followed by a newline."""
  if not paths.isfile(path):
    return
  data = paths.read_bytes(path)
  if not data or data.endswith(b"\n"):
    return
  start = data.rfind(b"\n") + 1
  paths.write_atomic(path, data[:start] if data[start:].startswith(_OWN_PREFIX.encode()) else data + b"\n")


def append_lines(path: str, lines: Sequence[dict]) -> None:
  paths.append(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))  # one write


def _write_atomic(path: str, text: str) -> None:
  paths.write_atomic(path, text)


def read_summary(out_dir: str) -> dict | None:
  path = paths.join(out_dir, SUMMARY_FILE)
  if not paths.isfile(path):
    return None
  with paths.open(path) as f:
    return json.load(f)


def write_summary(out_dir: str, summary: dict) -> None:
  _write_atomic(paths.join(out_dir, SUMMARY_FILE), json.dumps(summary, indent=2) + "\n")


def keep_foreign_metrics(out_dir: str) -> None:
  """An eval_metrics.json this project did not write (no summary of ours beside it) is copied to
  eval_metrics.orig.json before the first rewrite, so nothing someone else wrote is lost."""
  path = paths.join(out_dir, METRICS_FILE)
  backup = paths.join(out_dir, "eval_metrics.orig.json")
  if paths.isfile(path) and read_summary(out_dir) is None and not paths.exists(backup):
    paths.write_atomic(backup, paths.read_bytes(path))


def write_released_metrics(out_dir: str) -> dict[str, dict[str, float]]:
  """eval_metrics.json as inference.py computes it from every line of eval_rollout.jsonl (ours and anyone
  else's): per data source, rollouts merged by prompt text, n = the first problem's count, and
  pass@k = mean(1 − C(n − c, k) / C(n, k)) with c the samples scoring 1, for k in 1, 2, 4, ..., 256 <= n."""
  by_source: dict[str, dict[str, list[float]]] = {}
  with paths.open(paths.join(out_dir, ROLLOUT_FILE)) as f:
    for line in f:
      try:
        row = json.loads(line)
        source, prompt = row["data_source"], row["prompt"][0]["content"]
        scores = [r["score"]["score"] for r in row["rollout"]]
      except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        continue  # a line inference.py could not read either
      by_source.setdefault(source, {}).setdefault(prompt, []).extend(scores)
  metrics = {}
  for source, merged in by_source.items():
    problems = list(merged.values())
    n = len(problems[0])
    metrics[source] = {}
    for k in (k for k in RELEASED_KS if k <= n):
      total = sum(1 - math.comb(n - s.count(1), k) / math.comb(n, k) for s in problems)
      metrics[source][f"pass@{k}"] = total / len(problems)
  _write_atomic(paths.join(out_dir, METRICS_FILE), json.dumps(metrics) + "\n")
  return metrics


def check_resumable(out_dir: str, settings: dict, lines: dict, problems: Sequence[Problem]) -> None:
  """Refuses to mix in lines written with other sampling settings, another model or other answers."""
  before = (read_summary(out_dir) or {}).get("settings", {})
  for name in _RESPONSE_SETTINGS + ("model",):
    if name in before and before[name] != settings[name]:
      raise ValueError(f"{out_dir} holds an evaluation with {name}={before[name]!r}, not {settings[name]!r}: "
                       f"use another --out, or move {ROLLOUT_FILE} and {SUMMARY_FILE} away")
  answers = {p.key: p.answer for p in problems}
  for (source, index), line in lines.items():
    if len(line.get("rollout", ())) != settings["n"]:
      raise ValueError(f"{out_dir}/{ROLLOUT_FILE}: {source} #{index} has {len(line.get('rollout', ()))} samples, "
                       f"not n={settings['n']}")
    answer = line.get("reward_model", {}).get("ground_truth")
    if (source, index) in answers and answer != answers[(source, index)]:
      raise ValueError(f"{out_dir}/{ROLLOUT_FILE}: {source} #{index} has answer {answer!r} there but "
                       f"{answers[(source, index)]!r} in the data: the data changed; use another --out")


def compute_metrics(lines: dict, problems: Sequence[Problem], n: int, dropped: dict[str, int]) -> dict[str, Any]:
  """Over this project's lines, per data source: pass@k (k = 1, 2, 4, ... <= n) over the problems scored, mean
  accuracy, counts, truncation; plus the overall mean accuracy."""
  per_source: dict[str, list[Problem]] = {source: [] for source in dropped}
  for p in problems:
    per_source.setdefault(p.data_source, []).append(p)
  out, all_scores = {}, []
  for source, source_problems in per_source.items():
    counts, scores, tokens, truncated = [], [], [], 0
    for p in source_problems:
      if p.key not in lines:
        continue
      samples = lines[p.key]["rollout"]
      counts.append(int(sum(s["score"]["score"] > 0.5 for s in samples)))
      scores += [float(s["score"]["score"]) for s in samples]
      tokens += [int(s["num_tokens"]) for s in samples]
      truncated += sum(s["finish_reason"] == "length" for s in samples)
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
  returns the summary written to `eval_summary.json` (settings, and per data source pass@k and counts over
  this evaluation's problems).

  `scorer`: anything with `score_batch(responses, answers, data_sources) -> (scores, stats)`
  (default: a math-verify `RewardScorer` with `reward_workers` processes).
  """
  import jax
  import jax.numpy as jnp
  from tqdm.auto import tqdm

  from pacs_jax.models import hf
  from pacs_jax.rewards import math as rewards_lib
  from pacs_jax.rollout import engine as engine_lib
  from pacs_jax.rollout import scheduler
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
  lines, others = read_rollout(rollout_path)
  if others:
    logger.warning("%s holds %d lines this project did not write: they are kept as they are", rollout_path, others)
  check_resumable(out_dir, recorded, lines, problems)
  keep_foreign_metrics(out_dir)

  def write_metrics(complete: bool) -> dict[str, Any]:
    summary = {"complete": complete, "settings": recorded} | compute_metrics(lines, problems, n, dropped)
    write_summary(out_dir, summary)
    if paths.isfile(rollout_path):
      write_released_metrics(out_dir)
    return summary

  todo = [p for p in problems if p.key not in lines]
  summary = write_metrics(complete=not todo)  # records the settings before the first (long) chunk
  if not todo:
    return summary

  dtype = getattr(jnp, settings.dtype)
  chunk = settings.problems_per_chunk()
  with paths.local_dir(model_dir) as local_model, (
      jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
    eos, _ = hf.stop_and_mask_ids(tokenizer, local_model, settings.stop_tokens)
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
  repair_tail(rollout_path)
  try:
    for start in range(0, len(todo), chunk):
      batch = todo[start:start + chunk]
      completions = scheduler.generate(
          engine, params, [p.prompt_ids for p in batch], n=n, max_new_tokens=settings.max_new_tokens,
          sampling=sampling, seed=settings.seed, eos_ids=eos, prompt_ids=[p.seed_id for p in batch])
      texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
      scores, _ = scorer.score_batch(texts, [batch[c.prompt_index].answer for c in completions],
                                     [batch[c.prompt_index].data_source for c in completions])
      samples: list[list[dict]] = [[None] * n for _ in batch]
      for c, text, score in zip(completions, texts, scores):
        samples[c.prompt_index][c.sample_index] = {"output": text, "score": float(score),
                                                   "finish_reason": c.finish_reason, "num_tokens": len(c.tokens)}
      new = [problem_line(p, s) for p, s in zip(batch, samples)]  # every problem's n samples are scored
      append_lines(rollout_path, new)
      lines.update({p.key: line for p, line in zip(batch, new)})
      summary = write_metrics(complete=start + chunk >= len(todo))
      bar.update(len(batch) * n)
      bar.set_postfix(accuracy=f"{summary['overall']['mean_accuracy'] or 0:.3f}")
  finally:
    bar.close()
    if own_scorer:
      scorer.close()
  return summary


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
