"""`python -m pacs_jax.compare RUN_DIR... [--out compare.png]`: several training runs in one figure (reward,
validation accuracy, entropy, response length, step time) and a summary table on the console."""

import os

from absl import app, flags

_OUT = flags.DEFINE_string("out", "compare.png", "Where the figure goes (PNG).")
_LABELS = flags.DEFINE_list("labels", None, "A name per run (default: each workdir's folder name).")
_SMOOTHING = flags.DEFINE_integer("smoothing", 0, "Trailing mean over this many steps (0: a twentieth of the run).")
_TITLE = flags.DEFINE_string("title", "", "Figure title.")


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    raise app.UsageError("give one or more training workdirs (each holds metrics.jsonl)")
  labels = _LABELS.value or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
  if len(labels) != len(run_dirs) or len(set(labels)) != len(labels):
    raise app.UsageError(f"--labels: {len(run_dirs)} distinct names needed, got {labels}")
  from pacs_jax.study import compare_runs
  try:
    runs = {label: compare_runs.read_run(d) for label, d in zip(labels, run_dirs)}
  except FileNotFoundError as e:
    raise SystemExit(f"compare: {e}") from None
  compare_runs.plot(runs, _OUT.value, smoothing=_SMOOTHING.value, title=_TITLE.value)
  print(compare_runs.format_table(compare_runs.summary_rows(runs)))
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
