"""The problems of an evaluation: `--data` entries resolved to data sets, their prompts encoded."""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Sequence

from pacs_jax import paths
from pacs_jax.data import prompts, sources
from pacs_jax.rewards import synthetic as synthetic_verifier

logger = logging.getLogger(__name__)

# Dataset names accepted by `--data`, as files under `--data_dir` (the layout of the prepared test sets).
KNOWN_DATASETS = {name: f"{name}/test.jsonl" for name in ("math500", "aime2024", "aime2025", "amc23", "gsm8k")}


@dataclasses.dataclass
class Problem:
  data_source: str
  index: int  # position among its data source's records (before overlong prompts are dropped)
  answer: str
  prompt_ids: list[int]
  user_message: str = ""  # the prompt's user message (the released data row's prompt[0]["content"])

  @property
  def key(self) -> tuple[str, int]:
    return (self.data_source, self.index)

  @property
  def seed_id(self) -> int:
    """The engine's prompt id: a function of (source, index) alone, so a problem's samples do not depend
    on the other problems, their order, `--limit` or chunking, and a resumed run draws what a fresh one would."""
    return zlib.crc32(f"{self.data_source}/{self.index}".encode()) & 0x7FFFFFFF


def is_synthetic(spec: str) -> bool:
  """A built-in synthetic task (`synthetic/mod3`)."""
  return synthetic_verifier.is_synthetic(spec)


def resolve_data(data: str | Sequence[str], data_dir: str | None = None) -> list[str]:
  """`--data` entries -> load_records specs: known names under `data_dir`, else paths / hf:// / synthetic/."""
  entries = [e.strip() for e in (data.split(",") if isinstance(data, str) else data)]
  specs = []
  for entry in filter(None, entries):
    if entry in KNOWN_DATASETS:
      if not data_dir:
        raise ValueError(f"--data {entry} is a dataset name: pass --data_dir (the folder holding "
                         f"{KNOWN_DATASETS[entry]}) or give the file's path")
      specs.append(paths.join(data_dir, KNOWN_DATASETS[entry]))
    elif entry.startswith(sources.HUB_PREFIX) or synthetic_verifier.is_synthetic(entry) or paths.isfile(entry):
      specs.append(entry)
    else:
      raise FileNotFoundError(f"--data {entry!r}: not a file, hf:// dataset, synthetic/<task>, nor one of "
                              f"{sorted(KNOWN_DATASETS)}")
  if not specs:
    raise ValueError("--data names no data set")
  return specs


def load_problems(specs: Sequence[str], tokenizer, max_prompt_length: int, limit: int | None = None
                  ) -> tuple[list[Problem], dict[str, int]]:
  """Problems of every spec with their prompt ids, and per data source how many overlong prompts were dropped."""
  problems, dropped, next_index = [], {}, {}
  for spec in specs:
    records = sources.load_records(spec, synthetic_size=limit or 4096, held_out=True).records[:limit]
    # The built-in synthetic prompts carry no instruction (its words are not in their vocabulary).
    instruction = None if synthetic_verifier.is_synthetic(spec) else prompts.MATH_INSTRUCTION
    prompt_ids = prompts.encode_prompts(tokenizer, [r["problem"] for r in records], instruction)
    for record, ids in zip(records, prompt_ids):
      message = prompts.user_message(record["problem"], instruction)
      source = record["data_source"]
      index = next_index.get(source, 0)
      next_index[source] = index + 1
      dropped.setdefault(source, 0)
      if len(ids) > max_prompt_length:
        dropped[source] += 1
        continue
      problems.append(Problem(source, index, record["answer"], ids.tolist(), message))
  for source, count in dropped.items():
    if count:
      logger.warning("%s: dropped %d prompts longer than %d tokens", source, count, max_prompt_length)
  return problems, dropped
