"""Grain prompt pipeline: records -> token ids (`prompts`) -> overlong prompts dropped -> a seeded shuffle per
epoch -> global batches of prompts, each split across JAX processes. Checkpointable."""

from __future__ import annotations

import logging
import sys
from typing import Any, Sequence

import grain
import numpy as np

from pacs_jax.data import prompts
from pacs_jax.data.prompts import MATH_INSTRUCTION

logger = logging.getLogger(__name__)


def pad_prompts(prompt_ids: Sequence[np.ndarray], pad_id: int, length: int | None = None):
  """Left-pads prompts to `length` (default: the longest) -> (ids [B, P] int32, mask [B, P] int32, 1 = real)."""
  longest = max((len(x) for x in prompt_ids), default=0)
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"a prompt has {longest} tokens, more than the padded length {length}")
  ids = np.full((len(prompt_ids), length), pad_id, dtype=np.int32)
  mask = np.zeros((len(prompt_ids), length), dtype=np.int32)
  for row, x in enumerate(prompt_ids):
    if len(x):
      ids[row, length - len(x):] = x
      mask[row, length - len(x):] = 1
  return ids, mask


class TooFewPrompts(ValueError):
  """Fewer prompts fit max_prompt_length than one batch needs."""


class PromptPipeline:
  """Batches of prompts for one JAX process.

  Every process tokenizes and filters the same records, so all agree on the kept prompts and on
  each global batch of `batch_size` prompts; process p takes the p-th contiguous slice of it. An
  epoch is one pass over a fresh permutation (grain's index shuffle reseeded per epoch) cut into
  whole batches (the remainder is left out of that epoch, as verl's drop_last). A batch is a dict:
    prompt_ids  list of int32 arrays [T_i] (unpadded; see `pad_prompts`)
    answer, data_source, problem  lists of str
    index       int64 array: each prompt's position in `records`
    step, epoch ints (the batch's position in the stream)
  `iterator()` is a grain iterator whose `get_state()` is a JSON-able dict for checkpoints.
  """

  def __init__(self, records: Sequence[dict], tokenizer, *, batch_size: int, max_prompt_length: int,
               seed: int = 0, num_epochs: int | None = None, shuffle: bool = True, drop_remainder: bool = True,
               instruction: str | None = MATH_INSTRUCTION, process_index: int | None = None,
               process_count: int | None = None):
    if process_index is None or process_count is None:
      import jax  # only for the defaults, so that the data side stays usable without devices

      process_index = jax.process_index() if process_index is None else process_index
      process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if batch_size <= 0 or max_prompt_length <= 0:
      raise ValueError(f"batch_size ({batch_size}) and max_prompt_length ({max_prompt_length}) must be positive")
    if drop_remainder and batch_size % process_count:
      raise ValueError(f"batch_size {batch_size} is not divisible by the {process_count} processes")
    if num_epochs is not None and num_epochs <= 0:
      raise ValueError(f"num_epochs must be positive or None (endless), got {num_epochs}")
    if not 0 <= seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    self.batch_size = batch_size
    self.process_index, self.process_count = process_index, process_count
    self.num_epochs = num_epochs

    prompt_ids = prompts.encode_prompts(tokenizer, [r["problem"] for r in records], instruction)
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) <= max_prompt_length]
    self.num_records = len(records)
    self.num_dropped = len(records) - len(keep)
    if self.num_dropped:
      logger.warning("dropped %d of %d prompts longer than max_prompt_length=%d tokens", self.num_dropped,
                     len(records), max_prompt_length)
    self.num_prompts = len(keep)
    if self.num_prompts == 0 or (drop_remainder and self.num_prompts < batch_size):
      raise TooFewPrompts(f"only {self.num_prompts} of {len(records)} prompts fit max_prompt_length="
                          f"{max_prompt_length}: fewer than one batch of {batch_size}")
    self._prompt_ids = [prompt_ids[i] for i in keep]
    self._answers = [records[i]["answer"] for i in keep]
    self._data_sources = [records[i]["data_source"] for i in keep]
    self._problems = [records[i]["problem"] for i in keep]
    self._indices = np.asarray(keep, dtype=np.int64)

    self.steps_per_epoch = (self.num_prompts // batch_size if drop_remainder
                            else -(-self.num_prompts // batch_size))
    self.num_steps = None if num_epochs is None else num_epochs * self.steps_per_epoch
    positions = grain.MapDataset.source(range(self.num_prompts))
    # Item e * N + k of the shuffled dataset is the k-th prompt of epoch e (grain reseeds per epoch).
    self._order = positions.shuffle(seed=seed) if shuffle else positions
    steps = grain.MapDataset.range(sys.maxsize if self.num_steps is None else self.num_steps)
    self.dataset = steps.map(self._make_batch)

  def _local_slice(self, size: int) -> slice:
    """This process's contiguous share of a global batch of `size` prompts: equal shares when the
    processes divide `size` (always, with drop_remainder), else shares differing by one prompt."""
    bounds = np.linspace(0, size, self.process_count + 1).astype(int)
    return slice(bounds[self.process_index], bounds[self.process_index + 1])

  def _make_batch(self, step: int) -> dict[str, Any]:
    epoch, batch_in_epoch = divmod(step, self.steps_per_epoch)
    start = batch_in_epoch * self.batch_size
    size = min(self.batch_size, self.num_prompts - start)
    local = range(start, start + size)[self._local_slice(size)]
    positions = [self._order[epoch * self.num_prompts + k] for k in local]
    return {
        "prompt_ids": [self._prompt_ids[p] for p in positions],
        "answer": [self._answers[p] for p in positions],
        "data_source": [self._data_sources[p] for p in positions],
        "problem": [self._problems[p] for p in positions],
        "index": self._indices[positions] if positions else np.zeros((0,), np.int64),
        "step": step,
        "epoch": epoch,
    }

  def iterator(self, state: dict | None = None) -> grain.DatasetIterator:
    """A checkpointable iterator over this process's batches, resumed from `state` when given."""
    # Batches are cheap slices of pre-tokenized prompts: no prefetch threads, so state is exact and cheap.
    it = iter(self.dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    if state is not None:
      it.set_state(state)
    return it

  def __iter__(self):
    return self.iterator()

  def __len__(self) -> int:
    if self.num_steps is None:
      raise TypeError("an endless pipeline (num_epochs=None) has no length")
    return self.num_steps
