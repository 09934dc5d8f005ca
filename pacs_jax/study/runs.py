"""The study's runs: for each algorithm and seed, the project's Trainer from the warmed-up base model, pass@k on the
held-out problems before and after training, and the run's metrics rows; everything into one JSON table."""

from __future__ import annotations

import contextlib
import json
import os
import time

import jax

from pacs_jax.data import synthetic_tasks
from pacs_jax.services import metrics as metrics_lib
from pacs_jax.study import heldout
from pacs_jax.study import study_settings as settings_lib
from pacs_jax.study import warmup
from pacs_jax.trainer import loop, warm_base

RESULTS_FILE = "study.json"
DIGEST_FILE = "study_summary.json"  # the same without the metrics rows
SCHEMA_VERSION = 1
# Metric keys that measure the machine, not the run: left out of the rows compared for determinism.
MACHINE_KEYS = ("timing/", "throughput/")


def eval_seed(seed: int) -> int:
  """The pass@k sampling seed of a run seed (before and after training alike)."""
  return 1_000_003 * (seed + 1)


def run_one(algorithm: str, seed: int, base_dir: str, s: settings_lib.StudySettings, out_dir: str,
            records: list[dict], evaluate_base: bool) -> dict:
  """Trains one run with the Trainer (in `out_dir/runs/<algorithm>-seed<seed>`) and returns its record: pass@k after
  training (and of the base model, when `evaluate_base`), correct counts per problem, and its metrics rows."""
  cfg = settings_lib.train_config(algorithm, seed, base_dir, s)
  workdir = os.path.join(out_dir, "runs", f"{algorithm}-seed{seed}")
  started, cpu_started = time.perf_counter(), time.process_time()
  trainer = loop.Trainer(cfg, workdir, devices=jax.devices()[:1])
  record = {"algorithm": algorithm, "seed": seed, "workdir": os.path.relpath(workdir, out_dir)}
  eval_cpu_s = 0.0

  def evaluate() -> dict:
    nonlocal eval_cpu_s
    eval_started = time.process_time()
    counts, called = heldout.correct_counts(trainer, records, s.eval_n, eval_seed(seed))
    eval_cpu_s += time.process_time() - eval_started
    out = {"pass_at_k": _keyed(heldout.pass_at_k(records, counts, s.eval_n, by_terms=bool(s.eval_terms))),
           "correct": counts.tolist()}
    if called is not None:  # the tool task: samples per problem that called the tool
      out.update(called=called.tolist(), call_rate=float(called.sum() / (s.eval_n * len(records))))
    return out

  if evaluate_base:
    record["base"] = evaluate()
  with open(os.path.join(workdir, "train.log"), "a") as log, contextlib.redirect_stdout(log):
    trainer.run()  # its per-step lines go to the run's train.log, the study prints one line per run
  record["trained"] = evaluate()
  record["metrics"] = metrics_lib.read_rows(os.path.join(workdir, metrics_lib.METRICS_FILE))
  # The machine may be shared: this process's CPU time (all its threads) beside the wall time, and the part of it
  # the pass@k sampling took (docs/study.md estimates the study's time on an idle machine from these).
  record.update(wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu_started, eval_cpu_s=eval_cpu_s)
  return record


def _keyed(table: dict[str, dict[int, float]]) -> dict[str, dict[str, float]]:
  """JSON keys: {"all": {"1": 0.12, ...}}."""
  return {group: {str(k): v for k, v in row.items()} for group, row in table.items()}


def deterministic_rows(rows: list[dict]) -> list[dict]:
  """Metrics rows without the machine's timings (what the same seed must reproduce bit for bit)."""
  return [{k: v for k, v in row.items() if not k.startswith(MACHINE_KEYS)} for row in rows]


def run_study(s: settings_lib.StudySettings, out_dir: str, cache_dir: str, log=print) -> dict:
  """Builds (or reuses) the base model, runs every algorithm x seed (a run already in `out_dir/study.json` with
  the same settings is kept) and writes `out_dir/study.json` after each run; returns its content (with
  `runs_trained`: how many runs this call trained)."""
  os.makedirs(out_dir, exist_ok=True)
  base_dir = base_model_dir(s, cache_dir)
  with open(os.path.join(base_dir, warmup.DONE_FILE)) as f:
    warmup_record = json.load(f)
  log(f"base model: {base_dir} (warm-up loss {warmup_record['final_loss']:.3f})")
  task = synthetic_tasks.get_task(s.warmup.task)
  records = heldout.problems(task, s.eval_problems, s.eval_terms)
  path = os.path.join(out_dir, RESULTS_FILE)
  result = _previous(path, s) or {"schema_version": SCHEMA_VERSION, "settings": s.to_dict(), "runs": []}
  result["settings"] = _with_runs_of(result["settings"], s)
  result.update(base_model=_portable(base_dir, out_dir), warmup=warmup_record, held_out=[r["problem"] for r in records],
                eval_seeds={str(seed): eval_seed(seed) for seed in s.seeds})
  done = {(r["algorithm"], r["seed"]) for r in result["runs"]}
  result["runs_trained"] = 0
  for seed in s.seeds:
    for name in s.algorithms:
      if (name, seed) in done:
        continue
      log(f"{name} seed {seed}: training {s.steps} steps")
      has_base = any(r["seed"] == seed and "base" in r for r in result["runs"])
      record = run_one(name, seed, base_dir, s, out_dir, records, evaluate_base=not has_base)
      result["runs"].append(record)
      result["runs_trained"] += 1
      p = record["trained"]["pass_at_k"][heldout.OVERALL]
      log(f"{name} seed {seed}: pass@1 {p['1']:.3f}, pass@{s.eval_n} {p[str(s.eval_n)]:.3f} "
          f"({record['wall_s']:.0f} s)")
      write_json(path, result)
  return result


def base_model_dir(s: settings_lib.StudySettings, cache_dir: str) -> str:
  """The study's base model under `cache_dir`, built once and reused: the graded task's warm-up (study/warmup.py),
  or the tool demo's (trainer/warm_base.py, init seed 0), in a folder named by a hash of its settings."""
  if s.task != settings_lib.TOOL_TASK:
    return warmup.base_model_dir(s.warmup, cache_dir)
  workdir = os.path.join(cache_dir, warmup.settings_key(s.task, s.warmup))
  cfg = settings_lib.tool_config(s.algorithms[0], 0, "", s)
  cfg.model.warmup = s.task
  warm_base.resolve(cfg, workdir, s.warmup)
  return cfg.model.hf_path


def _portable(path: str, out_dir: str) -> str:
  """`path` as the study's files record it: relative to `out_dir` when inside it, else its last component (no
  machine's temporary directory in the published summary)."""
  relative = os.path.relpath(path, out_dir)
  return os.path.basename(os.path.normpath(path)) if relative.startswith(os.pardir) else relative


RUN_KEYS = ("algorithms", "seeds")  # which runs a study holds; every other setting must match to add runs to it


def _previous(path: str, s: settings_lib.StudySettings) -> dict | None:
  """The study already in `path` when it has these settings but for its algorithms and seeds (a restarted study
  keeps its finished runs; more seeds or algorithms add runs to it)."""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    previous = json.load(f)
  settings = previous.get("settings", {})
  same = previous.get("schema_version") == SCHEMA_VERSION and {
      k: v for k, v in settings.items() if k not in RUN_KEYS} == {
          k: v for k, v in json.loads(json.dumps(s.to_dict())).items() if k not in RUN_KEYS}
  return previous if same else None


def _with_runs_of(settings: dict, s: settings_lib.StudySettings) -> dict:
  """`settings` naming the union of its algorithms and seeds and `s`'s (all_algorithms' order, seeds sorted)."""
  algorithms = set(settings["algorithms"]) | set(s.algorithms)
  order = settings_lib.all_algorithms()
  return settings | {"algorithms": sorted(algorithms, key=lambda a: (order.index(a) if a in order else len(order), a)),
                     "seeds": sorted(set(settings["seeds"]) | set(s.seeds))}


def digest(result: dict) -> dict:
  """`study.json` without the metrics rows (a few tens of kB): settings, summary, every run's pass@k and counts."""
  runs = [{k: v for k, v in run.items() if k != "metrics"} for run in result["runs"]]
  return {k: v for k, v in result.items() if k != "runs"} | {"runs": runs}


def write_json(path: str, result: dict) -> None:
  staging = path + ".tmp"
  with open(staging, "w") as f:
    json.dump(result, f, indent=1)
  os.replace(staging, path)
