"""`python -m pacs_jax.export --workdir W [--step S] --out DIR [--overwrite] [--adapter]`: a training checkpoint -> a
Hugging Face directory.

The result (weights, config.json, tokenizer files) loads unchanged in transformers, and so in vLLM; a LoRA run's
has its adapters merged into the base (model.hf_path). With --adapter, a LoRA run's adapters alone as a PEFT adapter
folder (adapter_config.json, adapter_model.safetensors) for `peft.PeftModel.from_pretrained(base, DIR)` or vLLM.
"""

from absl import flags

from pacs_jax import errors

if __name__ == "__main__":  # (before the imports below, which take seconds)
  errors.stop_on_ctrl_c("export")

from pacs_jax import config  # pylint: disable=wrong-import-position

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (holds checkpoints/ and model/).", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_DTYPE = flags.DEFINE_enum("dtype", None, config.DTYPE_NAMES, "Convert weights (default: as trained).")
_SHARD = flags.DEFINE_string("max_shard_size", "5GB", "Split weight files at this size.")
_ADAPTER = flags.DEFINE_bool("adapter", False, "A LoRA run's adapters alone, as a PEFT adapter folder (refused for a "
                             "full-parameter run).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a previous export in --out (only the files it wrote; "
                               "a folder holding other files is refused).")


def main(argv):
  errors.no_arguments_quiet_logs(argv)
  from pacs_jax.storage import hf_export as export_lib
  from pacs_jax.services import runtime
  runtime.start_command_line()
  errors.watch_storage(_WORKDIR.value, _OUT.value)
  path = export_lib.export(_WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value,
                           max_shard_size=_SHARD.value, overwrite=_OVERWRITE.value, adapter=_ADAPTER.value)
  print(f"wrote {path}")


if __name__ == "__main__":
  errors.run("export", main)
