"""`python -m pacs_jax.study [--out DIR] [--task sum11|tools] [--shrunk] [--algorithms ...|all] [--seeds ...]`: PACS and
the objectives it is compared with (any registered ones; PACS, GRPO and PPO by default) from one warmed-up tiny base
model on the graded task `synthetic/sum11` (same settings for all, several seeds), held-out pass@k for k = 1 ... 256
before and after training, each algorithm's difference from PACS with a paired-bootstrap interval; writes
`study.json`, a table (`study_table.md`) and two figures into DIR (docs/study.md). `--task tools`: PACS against GRPO
on the tool demo's task, in conversations with the Python tool, pass@k with the tool for k = 1 ... 16 and its call
rate (docs/tools.md)."""

import dataclasses
import os
import time

from absl import app, flags

from pacs_jax import errors

_OUT = flags.DEFINE_string("out", "runs/study", "Where the runs, study.json, the table and the figures go.")
_CACHE = flags.DEFINE_string("cache_dir", None, "Where the warmed-up base model is cached (default: OUT/base_models).")
_TASK = flags.DEFINE_enum("task", "sum11", ["sum11", "tools"], "sum11: the graded sums, single turn; tools: the tool "
                          "demo's products, PACS against GRPO in conversations with the Python tool (docs/tools.md).")
_SHRUNK = flags.DEFINE_bool("shrunk", False, "The tests' study: 2 steps, 2 seeds, a few problems (checks the "
                            "pipeline, measures nothing).")
_SEEDS = flags.DEFINE_list("seeds", None, "Seeds (default: the task's, 0-5 for sum11, 0-2 for tools).")
_ALGORITHMS = flags.DEFINE_list("algorithms", None, "Registered objectives (pacs, grpo, ppo, dapo, drgrpo, gspo, ...) "
                                "or all (default: pacs,grpo,ppo for sum11, pacs,grpo for tools).")


def main(argv):
  errors.no_arguments_quiet_logs(argv)
  # Every seed of an algorithm runs the same programs: compiled once, read back from OUT/compile_cache after.
  os.environ.setdefault("PACS_JAX_COMPILATION_CACHE", os.path.join(os.path.abspath(_OUT.value), "compile_cache"))
  from pacs_jax.services import runtime
  runtime.start_command_line()
  import jax
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every program, however loaded the machine
  from pacs_jax.study import report, runs, study_settings as settings_lib

  full, shrunk = settings_lib.TASKS[_TASK.value]
  s = shrunk if _SHRUNK.value else full
  if _SEEDS.value:
    try:
      s = dataclasses.replace(s, seeds=tuple(int(x) for x in _SEEDS.value))
    except ValueError as e:
      raise app.UsageError(f"--seeds: integers, got {_SEEDS.value}") from e
  if _ALGORITHMS.value:
    try:
      s = dataclasses.replace(s, algorithms=settings_lib.algorithms_from_flag(_ALGORITHMS.value))
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  started, cpu_started = time.perf_counter(), time.process_time()
  result = runs.run_study(s, _OUT.value, _CACHE.value or os.path.join(_OUT.value, "base_models"))
  written = report.write(result, _OUT.value)
  # This process's CPU time beside the wall time: the machine may be shared. A resumed study adds a line.
  timing = {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started,
            "runs_trained": result.pop("runs_trained")}
  result.setdefault("invocations", []).append(timing)
  runs.write_json(os.path.join(_OUT.value, runs.RESULTS_FILE), result)
  runs.write_json(os.path.join(_OUT.value, runs.DIGEST_FILE), runs.digest(result))
  print(report.report_text(result["summary"]))
  print(f"wrote {runs.RESULTS_FILE}, {runs.DIGEST_FILE}, {', '.join(os.path.basename(p) for p in written.values())} "
        f"in {_OUT.value} ({timing['wall_s'] / 60:.1f} min, {timing['cpu_s'] / 60:.1f} CPU min)")
  problem = None if _SHRUNK.value else report.headroom_problem(result["summary"]["pass_at_k"])
  if problem:  # the files are written; the study measured little (the shrunk study's numbers mean nothing)
    raise SystemExit(f"study: {problem}: the comparison has no headroom to show")


if __name__ == "__main__":
  errors.run("study", main)
