"""Converts a dataset file (or hf:// path, or synthetic/<task>) to the released verl parquet format
(ritzz-ai/PACS src/preprocess_dataset.py: extra_info.answer, and `--repeat` with the `_{repeat}` data_source
suffix of AIME/AMC).

  python -m pacs_jax.data.prepare --input deepscaler.json --output train.parquet [--data_source NAME] [--repeat 8]
"""

from absl import app, flags, logging

from pacs_jax.data import sources

_INPUT = flags.DEFINE_string("input", None, "Data file (.json/.jsonl/.parquet), hf://owner/name or synthetic/<task>.",
                             required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Parquet file to write.", required=True)
_DATA_SOURCE = flags.DEFINE_string("data_source", None, "data_source of every row (default: from the input name).")
_SPLIT = flags.DEFINE_string("split", "train", "extra_info.split of every row.")
_SKIP_BAD_ROWS = flags.DEFINE_bool("skip_bad_rows", False, "Skip (and count) malformed rows instead of failing.")
_SYNTHETIC_SIZE = flags.DEFINE_integer("synthetic_size", 4096, "Problems to draw for a synthetic/<task> input.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for a synthetic/<task> input.")
_REPEAT = flags.DEFINE_integer("repeat", 1, "Write every row this many times (the released AIME/AMC sets for "
                               "pass@256: --repeat 8 with n = 32); aime_2024, aime_2025 and amc23 data sources get "
                               "the suffix _<repeat>, as the released preprocessing (also for 1).", lower_bound=1)


def main(argv):
  del argv
  result = sources.load_records(_INPUT.value, data_source=_DATA_SOURCE.value, skip_bad_rows=_SKIP_BAD_ROWS.value,
                                synthetic_size=_SYNTHETIC_SIZE.value, seed=_SEED.value, with_solution=True)
  sources.write_parquet(result.records, _OUTPUT.value, split=_SPLIT.value, repeat=_REPEAT.value)
  rows = len(result.records) * _REPEAT.value
  logging.info("wrote %d rows to %s (%d malformed rows skipped)", rows, _OUTPUT.value, result.num_skipped)
  print(f"{_OUTPUT.value}: {rows} rows ({len(result.records)} records x {_REPEAT.value}), {result.num_skipped} skipped")


if __name__ == "__main__":
  app.run(main)
