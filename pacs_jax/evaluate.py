"""`python -m pacs_jax.evaluate --model DIR_OR_WORKDIR --data math500,aime2024 --data_dir DIR --n 32`: pass@k per
data source, written in the released layouts (`eval_rollout.jsonl`, `eval_metrics.json`) beside the weights, with
`eval_summary.json` (resumable). `--data synthetic/mod3` alone evaluates the demo's task at the demo's sizes."""

import ml_collections
from absl import flags

from pacs_jax import errors

if __name__ == "__main__":  # (before the imports below, which take seconds)
  errors.stop_on_ctrl_c("evaluate")

from pacs_jax import config  # pylint: disable=wrong-import-position
from pacs_jax.eval import eval_settings as settings_lib

_MODEL = flags.DEFINE_string("model", None, "Hugging Face model directory, or a training workdir (never written: its "
                             "checkpoint is read into a temporary folder).", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a workdir (default: the latest).")
_DATA = flags.DEFINE_list("data", ["math500", "aime2024", "aime2025", "amc23"],
                          "Data sets: names (math500, aime2024, aime2025, amc23, gsm8k) under --data_dir, or "
                          ".json/.jsonl/.parquet paths, hf://owner/name[:split], synthetic/<task>.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Folder holding <name>/test.jsonl for the named data sets.")
_OUT = flags.DEFINE_string("out", None, "Output directory (default: the evaluated model directory; for a "
                            "workdir W, W-eval_step_<S> beside it).")
_CHUNK = flags.DEFINE_integer("chunk_problems", 0, "Problems per generate call and file append (0: ~4x batch_slots "
                              "responses).")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N problems of each data set (default: all; 64 of a "
                              "synthetic task).")

# The sampling, length and worker flags set fields of `eval.eval_settings.eval_config()` (the training config's names,
# defaults and checks): --flag -> (field, help).
CONFIG_FLAGS = {
    "n": ("rollout.n", "Samples per problem; pass@k is reported for k = 1, 2, 4, ... <= n."),
    "temperature": ("rollout.temperature", "Sampling temperature (0: greedy)."),
    "top_p": ("rollout.top_p", "Nucleus sampling mass (1: off)."),
    "top_k": ("rollout.top_k", "Top-k sampling (0: off; not with top_p < 1)."),
    "max_new_tokens": ("rollout.max_new_tokens", "Most tokens per response."),
    "max_prompt_length": ("data.max_prompt_length", "Longer prompts are dropped (and counted)."),
    "batch_slots": ("rollout.slots", "Concurrent decodes (each holds a KV cache of max_prompt_length + "
                    "max_new_tokens rows)."),
    "seed": ("seed", "Sampling seed."),
    "dtype": ("model.dtype", "Weights and compute dtype."),
    "stop_tokens": ("rollout.stop_tokens", '"released" (the tokenizer\'s EOS + generation_config.json\'s, as the '
                    'released inference.py with vLLM), "chat" (also <|im_end|>, <|endoftext|>), or ids.'),
    "tensor_parallel": ("mesh.tensor", "Devices per model replica; the slots are split over the replicas (all "
                        "local devices)."),
    "reward_workers": ("reward_workers", "Reward worker processes."),
    "reward_timeout_s": ("reward_timeout_s", "Per-response verification timeout (then scores 0)."),
    "reward_fn": ("reward.fn", "The reward, package.module:function (default: math-verify)."),
    "env": ("env.name", '"single_turn", or "python_tool": each sample a conversation with the Python tool '
            "(docs/tools.md), scored by its episode."),
    "max_turns": ("env.max_turns", "With --env=python_tool: the model's turns per conversation."),
    "tool_output_bytes": ("env.output_bytes", "With --env=python_tool: of a program's output, what comes back."),
    "tool_workers": ("env.workers", "With --env=python_tool: programs run at once."),
}


def _define_config_flags() -> None:
  defaults = settings_lib.eval_config()
  for name, (field, help_) in CONFIG_FLAGS.items():
    default = config.get_field(defaults, field)
    if field == "model.dtype":
      flags.DEFINE_enum(name, default, config.DTYPE_NAMES, help_)
    else:
      define = {int: flags.DEFINE_integer, float: flags.DEFINE_float, str: flags.DEFINE_string}[type(default)]
      define(name, default, help_)


_define_config_flags()


def eval_config_from_flags(synthetic: dict | None = None) -> ml_collections.ConfigDict:
  """The evaluation config the flags describe, validated; a bad value is a usage error naming its flag. With only
  synthetic data, flags left unset take the demo's sizes (`synthetic`: `eval_settings.synthetic_defaults`)."""
  cfg = settings_lib.eval_config()
  synthetic = synthetic or {}
  for name, (field, _) in CONFIG_FLAGS.items():
    unset = not flags.FLAGS[name].present and field in synthetic
    config.set_field(cfg, field, synthetic[field] if unset else flags.FLAGS[name].value)
  try:
    config.validate_eval(cfg)
  except config.ConfigError as e:
    flag = next(f"--{n}" for n, (field, _) in CONFIG_FLAGS.items() if str(e).startswith(f"config.{field}:"))
    raise config.ConfigError(f"{flag}: {e}") from e
  return cfg


def main(argv):
  errors.no_arguments_quiet_logs(argv)
  from pacs_jax.services import runtime
  runtime.start_command_line()
  errors.watch_storage(_MODEL.value, _OUT.value)
  import jax

  from pacs_jax import sharding
  from pacs_jax.eval import problems, results, runner

  try:
    data = problems.resolve_data(_DATA.value, _DATA_DIR.value)
  except ValueError as e:  # (a missing file is a FileNotFoundError: the same exit status, EXIT_INPUT)
    raise errors.InputError(str(e)) from e
  synthetic_only = all(problems.is_synthetic(spec) for spec in data)
  cfg = eval_config_from_flags(settings_lib.synthetic_defaults(data) if synthetic_only else None)
  limit = _LIMIT.value or (settings_lib.SYNTHETIC_LIMIT if synthetic_only else None)
  settings = settings_lib.EvalSettings.from_config(cfg, chunk_problems=_CHUNK.value, limit=limit)
  mesh = None
  if jax.device_count() > 1:
    mesh = sharding.make_mesh(data=-1, fsdp=1, tensor=cfg.mesh.tensor)
  # An expected failure (a missing file, a checkpoint that does not restore, bad data) ends in one line.
  metrics = runner.evaluate(_MODEL.value, data, settings, out_dir=_OUT.value, step=_STEP.value, mesh=mesh,
                            reward_workers=cfg.reward_workers, reward_timeout_s=cfg.reward_timeout_s,
                            reward_fn=cfg.reward.fn)
  print(runner.summary_table(metrics))
  print(f"wrote {results.ROLLOUT_FILE}, {results.METRICS_FILE} and {results.SUMMARY_FILE} in {metrics['out_dir']}")


if __name__ == "__main__":
  errors.run("evaluate", main)
