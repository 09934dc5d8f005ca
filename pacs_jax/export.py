"""`python -m pacs_jax.export --workdir W [--step S] --out DIR`: a training checkpoint -> a Hugging Face directory.

The result (weights, config.json, tokenizer files) loads unchanged in transformers, and so in vLLM.
"""

from absl import app, flags, logging

from pacs_jax import config

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (holds checkpoints/ and model/).", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_DTYPE = flags.DEFINE_enum("dtype", None, config.DTYPE_NAMES, "Convert weights (default: as trained).")
_SHARD = flags.DEFINE_string("max_shard_size", "5GB", "Split weight files at this size.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it reads at INFO
  from pacs_jax.storage import checkpoint, export as export_lib
  from pacs_jax.train import runtime
  runtime.prefer_cpu_without_accelerators()
  try:
    path = export_lib.export(_WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value,
                             max_shard_size=_SHARD.value)
  except (FileNotFoundError, checkpoint.NoRestorableCheckpoint) as e:
    raise SystemExit(f"export: {e}") from None  # one message, no traceback
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
