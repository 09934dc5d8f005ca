"""The files of an evaluation, in the released layouts (every read and write of the output directory is here)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pacs_jax import paths
from pacs_jax.envs import python_tool
from pacs_jax.eval import passk
from pacs_jax.eval.problems import Problem

ROLLOUT_FILE = "eval_rollout.jsonl"
METRICS_FILE = "eval_metrics.json"  # exactly the released file: {data_source: {"pass@k": value}}
SUMMARY_FILE = "eval_summary.json"  # this project's: settings (for resuming), counts, accuracy, truncation
# The key of this project's lines in eval_rollout.jsonl, written first: lines without it are someone else's
# (e.g. the released inference.py's) and are never rewritten or removed.
OWN_KEY = "pacs_jax"
_OWN_PREFIX = '{"' + OWN_KEY + '":'
RELEASED_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # inference.py's pass@k list
# Settings that change the responses themselves: rows written under other values must not be mixed in.
_RESPONSE_SETTINGS = ("n", "temperature", "top_k", "top_p", "max_new_tokens", "seed", "dtype", "stop_tokens", "env",
                      "max_turns", "tool_cpu_seconds", "tool_wall_seconds", "tool_memory_mb", "tool_output_bytes")


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
                   "finish_reason": s["finish_reason"], "num_tokens": s["num_tokens"],
                   **{k: s[k] for k in python_tool.RECORD_KEYS if k in s}} for s in samples],
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
  else's): per data source and problem, pass@k = mean(1 − C(n − c, k) / C(n, k)) with c the samples scoring 1, for
  k in 1, 2, 4, ..., 256 <= n. inference.py merges rollouts by prompt text; our lines are grouped by problem
  (data source, index) instead, so distinct problems that share a prompt (the synthetic task has 10 prompts) are
  not merged into one with more than n samples. Lines from elsewhere still merge by prompt text."""
  by_source: dict[str, dict[Any, list[float]]] = {}
  with paths.open(paths.join(out_dir, ROLLOUT_FILE)) as f:
    for line in f:
      try:
        row = json.loads(line)
        source, prompt = row["data_source"], row["prompt"][0]["content"]
        scores = [r["score"]["score"] for r in row["rollout"]]
      except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        continue  # a line inference.py could not read either
      by_source.setdefault(source, {}).setdefault(own_key(row) or prompt, []).extend(scores)
  metrics = {}
  for source, merged in by_source.items():
    problems = [s for s in merged.values() if s]
    n = min(len(s) for s in problems)
    metrics[source] = {}
    for k in (k for k in RELEASED_KS if k <= n):
      total = sum(1 - math.comb(len(s) - s.count(1), k) / math.comb(len(s), k) for s in problems)
      metrics[source][f"pass@{k}"] = total / len(problems)
  _write_atomic(paths.join(out_dir, METRICS_FILE), json.dumps(metrics) + "\n")
  return metrics


class OtherEvaluation(FileExistsError, ValueError):
  """An --out that holds another evaluation's results (another model or settings): a used --out (EXIT_INPUT)."""


def check_resumable(out_dir: str, settings: dict, lines: dict, problems: Sequence[Problem]) -> None:
  """Refuses to mix in lines written with other sampling settings, another model or other answers."""
  before = (read_summary(out_dir) or {}).get("settings", {})
  if before:  # written before evaluations had an environment: single-turn ones
    before = {"env": "single_turn", **before}
  for name in _RESPONSE_SETTINGS + ("model",):
    if name in before and before[name] != settings[name]:
      raise OtherEvaluation(f"{out_dir} holds an evaluation with {name}={before[name]!r}, not {settings[name]!r}: "
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
    counts, scores, tokens, truncated, talks = [], [], [], 0, []
    for p in source_problems:
      if p.key not in lines:
        continue
      samples = lines[p.key]["rollout"]
      talks += [s for s in samples if "turns" in s]
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
    if talks:  # conversations with the tool: how often it was called, and by the solved ones
      called = [bool(s["observations"]) for s in talks]
      solved = [c for s, c in zip(talks, called) if s["score"]["score"] > 0.5]
      out[source].update({"tool_call_rate": float(np.mean(called)),
                          "turns_mean": float(np.mean([len(s["turns"]) for s in talks])),
                          "solved_with_tool": float(np.mean(solved)) if solved else 0.0})
    all_scores += scores
  overall = {"mean_accuracy": float(np.mean(all_scores)) if all_scores else None, "num_responses": len(all_scores),
             "num_problems": len(problems)}
  return {"sources": out, "overall": overall}
