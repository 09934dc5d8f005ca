"""`python -m pacs_jax.evaluate --model DIR_OR_WORKDIR --data math500,aime2024 --data_dir DIR --n 32`: pass@k per
data source, written in the released layouts (`eval_rollout.jsonl`, `eval_metrics.json`) beside the weights, with
`eval_summary.json` (resumable)."""

import os

from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory, or a training workdir (its checkpoint "
                             "is exported to WORKDIR/export_step_<S> first).", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a workdir (default: the latest).")
_DATA = flags.DEFINE_list("data", ["math500", "aime2024", "aime2025", "amc23"],
                          "Data sets: names (math500, aime2024, aime2025, amc23, gsm8k) under --data_dir, or "
                          ".json/.jsonl/.parquet paths, hf://owner/name[:split], synthetic/<task>.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Folder holding <name>/test.jsonl for the named data sets.")
_OUT = flags.DEFINE_string("out", None, "Output directory (default: the evaluated model directory).")
_N = flags.DEFINE_integer("n", 32, "Samples per problem; pass@k is reported for k = 1, 2, 4, ... <= n.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature (0: greedy).")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass (1: off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off; not with top_p < 1).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 4096, "Most tokens per response.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_length", 1024, "Longer prompts are dropped (and counted).")
_SLOTS = flags.DEFINE_integer("batch_slots", 256, "Concurrent decodes (each holds a KV cache of "
                              "max_prompt_length + max_new_tokens rows).")
_CHUNK = flags.DEFINE_integer("chunk_problems", 0, "Problems per generate call and file append (0: ~4x batch_slots "
                              "responses).")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N problems of each data set.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and compute dtype.")
_STOP = flags.DEFINE_string("stop_tokens", "released", '"released" (the tokenizer\'s EOS + generation_config.json\'s, '
                            'as the released inference.py with vLLM), "chat" (also <|im_end|>, <|endoftext|>), or ids.')
_TENSOR = flags.DEFINE_integer("tensor_parallel", 1, "Devices per model replica; the slots are split over the "
                               "replicas (all local devices).")
_WORKERS = flags.DEFINE_integer("reward_workers", 4, "math-verify worker processes.")
_TIMEOUT = flags.DEFINE_float("reward_timeout_s", 10.0, "Per-response verification timeout (then scores 0).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it reads at INFO
  import jax

  if os.environ.get("PACS_JAX_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["PACS_JAX_COMPILATION_CACHE"])
  from pacs_jax import sharding
  from pacs_jax.eval import problems, results, runner

  try:  # bad flags get a usage message, not a traceback
    data = problems.resolve_data(_DATA.value, _DATA_DIR.value)
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(str(e)) from e
  settings = runner.EvalSettings(
      n=_N.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
      max_new_tokens=_MAX_NEW.value, max_prompt_length=_MAX_PROMPT.value, seed=_SEED.value, dtype=_DTYPE.value,
      stop_tokens=_STOP.value,
      batch_slots=_SLOTS.value, chunk_problems=_CHUNK.value, limit=_LIMIT.value)
  mesh = None
  if jax.device_count() > 1:
    mesh = sharding.make_mesh(data=-1, fsdp=1, tensor=_TENSOR.value)
  from pacs_jax import paths
  from pacs_jax.data import sources
  from pacs_jax.storage import checkpoint
  try:
    metrics = runner.evaluate(_MODEL.value, data, settings, out_dir=_OUT.value, step=_STEP.value, mesh=mesh,
                              reward_workers=_WORKERS.value, reward_timeout_s=_TIMEOUT.value)
  except (FileNotFoundError, checkpoint.NoRestorableCheckpoint, sources.DataError) as e:
    raise SystemExit(f"evaluate: {e}") from None  # one message, no traceback
  print(runner.summary_table(metrics))
  out_dir = _OUT.value or metrics["settings"]["model"]
  print(f"wrote {results.ROLLOUT_FILE}, {results.METRICS_FILE} and {results.SUMMARY_FILE} in {paths.normalize(out_dir)}")


if __name__ == "__main__":
  app.run(main)
