"""The study's report: pass@k mean and spread over seeds per algorithm (before and after training), each algorithm's
difference from PACS with a paired-bootstrap interval (`eval.paired`), tables in the paper's layout (methods as rows,
pass@k as columns) and two figures (training curves with seed bands; pass@k curves before and after)."""

from __future__ import annotations

import os

import numpy as np

from pacs_jax.eval import paired
from pacs_jax.study import heldout
from pacs_jax.study.study_settings import REFERENCE

BASE = "base"
# The paper's row order (the baselines, PACS last), the newer baselines between.
LABELS = {BASE: "Base model", "ppo": "PPO", "grpo": "GRPO", "dapo": "DAPO", "drgrpo": "Dr. GRPO", "gspo": "GSPO",
          "pacs": "PACS"}
COLORS = {BASE: "0.4", "pacs": "C0", "grpo": "C1", "ppo": "C2", "dapo": "C3", "drgrpo": "C4", "gspo": "C5"}
TABLE_KS = (1, 16, 256)
CURVES = (("reward/mean", "reward (train, mean)"), ("entropy", "entropy (nats per token)"))
CALL_CURVE = ("tools/call_rate", "tool-call rate (train)")  # the tool task's third panel
FIGURE_FILES = {"curves": "study_curves.png", "pass_at_k": "study_pass_at_k.png"}
TABLE_FILE = "study_table.md"


def _spread(values: list[float]) -> dict:
  a = np.asarray(values, np.float64)
  return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "min": float(a.min()),
          "max": float(a.max()), "n_seeds": len(a)}


def pass_at_k_summary(result: dict, group: str = heldout.OVERALL) -> dict[str, dict[str, dict]]:
  """{"base" or algorithm: {k: {mean, std (over seeds, ddof 1), min, max, n_seeds}}} of held-out pass@k."""
  tables: dict[str, list[dict]] = {}
  for run in result["runs"]:
    if "base" in run:
      tables.setdefault(BASE, []).append(run["base"]["pass_at_k"][group])
    tables.setdefault(run["algorithm"], []).append(run["trained"]["pass_at_k"][group])
  return {name: {k: _spread([t[k] for t in rows]) for k in rows[0]}
          for name, rows in sorted(tables.items(), key=lambda item: _row_order(item[0]))}


def _row_order(name: str) -> tuple[float, str]:
  """Rows as LABELS orders them; an objective it does not name goes before PACS, by name."""
  order = list(LABELS)
  return (order.index(name) if name in order else order.index(REFERENCE) - 0.5, name)


def correct_grid(result: dict, algorithm: str, seeds: list[int]) -> np.ndarray:
  """[S, U] the trained models' correct counts of `algorithm`, one row per seed in `seeds`."""
  by_seed = {run["seed"]: run["trained"]["correct"] for run in result["runs"] if run["algorithm"] == algorithm}
  return np.array([by_seed[seed] for seed in seeds], np.int64)


def differences(result: dict, ks=TABLE_KS) -> dict[str, dict[str, dict]]:
  """{algorithm: {k: {diff, low, high, resolved, n_seeds, n_problems}}}: held-out pass@k of PACS minus the algorithm's
  (positive: PACS ahead) with its paired-bootstrap interval (`eval.paired.paired_difference`) over the seeds both
  ran and every held-out problem; ks beyond the samples per problem are left out."""
  n = result["settings"]["eval_n"]
  seeds_of: dict[str, set[int]] = {}
  for run in result["runs"]:
    seeds_of.setdefault(run["algorithm"], set()).add(run["seed"])
  if REFERENCE not in seeds_of:
    return {}
  out = {}
  for name in sorted(set(seeds_of) - {REFERENCE}, key=_row_order):
    seeds = sorted(seeds_of[name] & seeds_of[REFERENCE])
    if not seeds:
      continue
    ref, other = correct_grid(result, REFERENCE, seeds), correct_grid(result, name, seeds)
    out[name] = {str(k): paired.paired_difference(ref, other, n, k) | {"n_seeds": len(seeds),
                                                                      "n_problems": ref.shape[1]}
                 for k in ks if k <= n}
  return out


def _points(x: float) -> str:
  return f"{100 * x:+.1f}"


def differences_table(diffs: dict[str, dict[str, dict]]) -> str:
  """PACS minus each algorithm (rows) at each k (columns), in points with the 95% interval; resolved ones bold."""
  if not diffs:
    return ""
  ks = list(next(iter(diffs.values())))
  lines = ["| PACS minus | " + " | ".join(f"pass@{k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
  for name, row in diffs.items():
    cells = []
    for k in ks:
      d = row[k]
      cell = f"{_points(d['diff'])} [{_points(d['low'])}, {_points(d['high'])}]"
      cells.append(f"**{cell}**" if d["resolved"] else cell)
    lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
  first = next(iter(next(iter(diffs.values())).values()))
  lines.append(f"\nHeld-out pass@k of PACS minus the method's, in percentage points, with the {100 * paired.LEVEL:g}% "
               f"interval of a paired bootstrap over {first['n_seeds']} seeds and {first['n_problems']} problems "
               f"({paired.REPLICATES} replicates); bold: the interval excludes 0.")
  return "\n".join(lines)


def resolved_statement(diffs: dict[str, dict[str, dict]]) -> str:
  """Which differences the intervals resolve, in words."""
  ahead, behind, open_ = [], [], []
  for name, row in diffs.items():
    for k, d in row.items():
      what = f"{LABELS.get(name, name)} at pass@{k} ({_points(d['diff'])})"
      (ahead if d["resolved"] and d["diff"] > 0 else behind if d["resolved"] else open_).append(what)
  lines = [f"PACS ahead, resolved: {', '.join(ahead) or 'none'}.",
           f"PACS behind, resolved: {', '.join(behind) or 'none'}.",
           f"Not resolved (the interval contains 0): {', '.join(open_) or 'none'}."]
  return "\n".join(lines)


# The base model leaves the study something to measure (issue 25): held-out pass@1 below this, and pass@k at the
# largest k at least this many times pass@1 (as a base LLM on AIME).
MAX_BASE_PASS_AT_1, MIN_BASE_HEADROOM = 0.3, 2.0


def headroom_problem(summary: dict[str, dict[str, dict]]) -> str | None:
  """What is wrong with the base model's held-out pass@k (mean over seeds) for this study, or None."""
  base = summary[BASE]
  top = max(base, key=int)
  p1, p_top = base["1"]["mean"], base[top]["mean"]
  if p1 >= MAX_BASE_PASS_AT_1:
    return f"the base model's held-out pass@1 is {p1:.3f}, not below {MAX_BASE_PASS_AT_1}"
  if p_top < MIN_BASE_HEADROOM * p1:
    return f"the base model's held-out pass@{top} ({p_top:.3f}) is under {MIN_BASE_HEADROOM:g}x its pass@1 ({p1:.3f})"
  return None


def call_rate_summary(result: dict) -> dict[str, dict] | None:
  """{"base" or algorithm: spread over seeds} of the held-out samples' tool-call rate (the tool task; else None)."""
  if "call_rate" not in result["runs"][0]["trained"]:
    return None
  rates: dict[str, list[float]] = {}
  for run in result["runs"]:
    if "base" in run:
      rates.setdefault(BASE, []).append(run["base"]["call_rate"])
    rates.setdefault(run["algorithm"], []).append(run["trained"]["call_rate"])
  return {name: _spread(values) for name, values in sorted(rates.items(), key=lambda item: _row_order(item[0]))}


def markdown_table(summary: dict[str, dict[str, dict]], ks=TABLE_KS, calls: dict[str, dict] | None = None) -> str:
  """Methods as rows, held-out pass@k (percent, mean ± standard deviation over seeds) as columns; with `calls`, the
  held-out samples' tool-call rate as the last column."""
  ks = [str(k) for k in ks if str(k) in next(iter(summary.values()))]
  seeds = {s[ks[0]]["n_seeds"] for s in summary.values()}
  extra = " tool calls |" if calls else ""
  lines = ["| method | " + " | ".join(f"pass@{k}" for k in ks) + " |" + extra, "|---" * (len(ks) + 1 + bool(calls))
           + "|"]
  for name, row in summary.items():
    cells = [f"{100 * row[k]['mean']:.1f} ± {100 * row[k]['std']:.1f}" for k in ks]
    if calls:
      cells.append(f"{100 * calls[name]['mean']:.1f} ± {100 * calls[name]['std']:.1f}")
    lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
  lines.append(f"\nHeld-out pass@k in percent, mean ± standard deviation over {'/'.join(map(str, sorted(seeds)))} "
               "seeds" + ("; tool calls: the share of held-out samples that called the tool." if calls else "."))
  return "\n".join(lines)


def curve_bands(result: dict, key: str, window: int) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                          np.ndarray]]:
  """{algorithm: (steps, mean, min, max)} of a metric over seeds, each seed's values first smoothed by a trailing
  mean over `window` steps."""
  from pacs_jax.study import compare_runs

  by_algorithm: dict[str, list[np.ndarray]] = {}
  steps = {}
  for run in result["runs"]:
    s, v = compare_runs.series(run["metrics"], key)
    by_algorithm.setdefault(run["algorithm"], []).append(compare_runs.smooth(v, window))
    steps[run["algorithm"]] = s
  out = {}
  for name, values in by_algorithm.items():
    length = min(len(v) for v in values)
    stacked = np.stack([v[:length] for v in values])  # [seeds, steps]
    out[name] = (steps[name][:length], stacked.mean(0), stacked.min(0), stacked.max(0))
  return out


def plot(result: dict, out_dir: str) -> dict[str, str]:
  """Writes the two figures into `out_dir`; returns {figure: path}."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = result["settings"]["steps"]
  window = max(1, steps // 20)
  curves = CURVES + ((CALL_CURVE,) if CALL_CURVE[0] in result["runs"][0]["metrics"][0] else ())
  fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), constrained_layout=True)
  for ax, (key, title) in zip(axes, curves):
    for name, (s, mean, low, high) in curve_bands(result, key, window).items():
      ax.plot(s, mean, color=COLORS.get(name), label=LABELS.get(name, name))
      ax.fill_between(s, low, high, color=COLORS.get(name), alpha=0.2, linewidth=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0].legend(title=f"mean, band: min-max over seeds; trailing mean of {window} steps", fontsize=8,
                 title_fontsize=8)
  paths = {"curves": os.path.join(out_dir, FIGURE_FILES["curves"])}
  fig.savefig(paths["curves"], dpi=80)
  plt.close(fig)

  summary = pass_at_k_summary(result)
  algorithms = [a for a in summary if a != BASE]
  cols = min(3, len(algorithms))
  rows = -(-len(algorithms) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), sharey=True, constrained_layout=True,
                           squeeze=False)
  for ax in axes.flat[len(algorithms):]:
    ax.set_visible(False)
  for ax, name in zip(axes.flat, algorithms):
    for label, row, style in (("before (base)", summary[BASE], "--"), ("after", summary[name], "-")):
      ks = [int(k) for k in row]
      mean = np.array([row[k]["mean"] for k in row])
      color = COLORS.get(BASE if style == "--" else name)
      ax.plot(ks, mean, style, color=color, marker="o", markersize=3, label=label)
      ax.fill_between(ks, [row[k]["min"] for k in row], [row[k]["max"] for k in row], color=color, alpha=0.2,
                      linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{LABELS.get(name, name)}: held-out pass@k", fontsize=10)
    ax.set_xlabel("k")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  paths["pass_at_k"] = os.path.join(out_dir, FIGURE_FILES["pass_at_k"])
  fig.savefig(paths["pass_at_k"], dpi=80)
  plt.close(fig)
  return paths


def write(result: dict, out_dir: str) -> dict[str, str]:
  """The summary into `result["summary"]`, the markdown table and the figures into `out_dir`; returns the paths."""
  result["summary"] = {"pass_at_k": pass_at_k_summary(result),
                       "pass_at_k_by_terms": {g: pass_at_k_summary(result, g) for g in
                                              sorted(result["runs"][0]["trained"]["pass_at_k"]) if g != heldout.OVERALL}}
  result["summary"]["differences"] = differences(result)
  calls = call_rate_summary(result)
  if calls:
    result["summary"]["call_rate"] = calls
  result["summary"]["bootstrap"] = {"replicates": paired.REPLICATES, "seed": paired.BOOTSTRAP_SEED,
                                    "level": paired.LEVEL}
  paths = plot(result, out_dir)
  paths["table"] = os.path.join(out_dir, TABLE_FILE)
  with open(paths["table"], "w") as f:
    f.write(report_text(result["summary"]) + "\n")
  return paths


def report_text(summary: dict) -> str:
  """The means table, the differences table and the statement of what is resolved (`study_table.md`)."""
  parts = [markdown_table(summary["pass_at_k"], calls=summary.get("call_rate"))]
  if summary.get("differences"):
    parts += [differences_table(summary["differences"]), resolved_statement(summary["differences"])]
  return "\n\n".join(parts)
