"""The rollout costed whole (issue 42): the compiler's time for the decode steps outside the paged attention kernel
plus the kernel's own reads, which the compiler's cost model leaves out (a Pallas kernel gets no time), at a length
profile's responses, with continuous batching's tail.

A step's responses (`length_profile.sample`: prompts p_i, responses l_i) go to the slots as the scheduler hands
them out (each to the first free slot, in order), so the rollout takes S decode steps (the last slot's end) and
step t reads, in the kernel, the live KV rows of its busy slots: c_t = sum over busy i of (p_i + tokens so far).
The estimate is

  sum_t (the compiler's time per decode step at the top page budget, over the slot ladder's rung for step t's
         busy slots: weights, matmuls, sampling)
  + sum_t c_t x (KV bytes per token, every layer) / chips / (the chip's HBM bytes per second)

and the roofline for the same work reads the rollout weights once per step and the same live KV rows:
(S x weight bytes per chip + sum_t c_t x KV bytes per token / chips) / HBM bytes per second. Tokens per second per
chip are sum_i l_i / time / chips. The HBM rate is the compiler's own (`aot_measure.device_rates`: 2.35 TB/s on
v5p), the one behind its optimal times. With a slot ladder (`rollout/slot_rungs.py`) a step of the tail (no request
waiting, k slots busy) runs in the smallest rung b with b / Z >= ceil(k / Z) (busy slots spread evenly over the Z
batch shards); without one every step runs over all slots.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np


@dataclasses.dataclass(frozen=True)
class RolloutCost:
  profile: str
  steps: int  # S: decode steps of the step's rollout
  tokens: int  # generated tokens
  outside_s: float  # the compiler's time of each decode step (everything but the kernel), at its rung, summed
  kernel_bytes: float  # per chip: the live KV rows the kernel reads over the rollout
  kernel_s: float  # kernel_bytes / HBM bytes per second
  roofline_s: float  # (S x weight bytes + kernel_bytes) per chip / HBM bytes per second
  chips: int
  mean_busy: float  # slots busy per step, on average (continuous batching's tail lowers it)
  rung_steps: dict[int, int] = dataclasses.field(default_factory=dict)  # decode steps run in each rung (slots)

  @property
  def estimate_s(self) -> float:
    return self.outside_s + self.kernel_s

  def tokens_per_s(self, seconds: float) -> float:
    """Generated tokens per second per chip in `seconds`."""
    return self.tokens / seconds / self.chips


def schedule(prompts: np.ndarray, responses: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
  """(live KV rows [S], busy slots [S]) per decode step of responses `responses` [N] after prompts `prompts` [N],
  each to the first free slot in order (continuous batching)."""
  free = [0] * min(slots, len(responses))  # the step each slot is free from
  starts = np.zeros(len(responses), np.int64)
  for i, length in enumerate(responses):
    start = heapq.heappop(free)
    starts[i] = start
    heapq.heappush(free, start + int(length))
  steps = int((starts + responses).max()) if len(responses) else 0
  ends = starts + responses
  count, offset = np.zeros(steps + 1, np.int64), np.zeros(steps + 1, np.int64)
  np.add.at(count, starts, 1)
  np.add.at(count, ends, -1)
  np.add.at(offset, starts, prompts - starts)  # a busy response's live rows at step t: p + (t - start)
  np.add.at(offset, ends, -(prompts - starts))
  busy, base = np.cumsum(count)[:steps], np.cumsum(offset)[:steps]
  return base + busy * np.arange(steps), busy


def rungs_of(busy: np.ndarray, rungs: list[int], shards: int) -> np.ndarray:
  """The rung (slots) each decode step runs in, busy [S] slots per step: the smallest of `rungs` (ascending, the
  last all slots) whose slots per shard hold ceil(busy / shards)."""
  per_shard = -(-np.asarray(busy, np.int64) // shards)
  capacity = np.array(rungs, np.int64) // shards
  return np.array(rungs, np.int64)[np.minimum(np.searchsorted(capacity, per_shard), len(rungs) - 1)]


def cost(profile_name: str, prompts: np.ndarray, responses: np.ndarray, slots: int, step_s: float | dict[int, float],
         kv_bytes_per_token: float, weight_bytes: float, chips: int, hbm_bytes_per_s: float,
         shards: int = 1) -> RolloutCost:
  """The rollout of `responses` after `prompts` on `slots` slots: `step_s` the compiler's time per decode step
  (outside the kernel), or {rung slots: its time} of a slot ladder (with `slots` among them) over `shards` batch
  shards, `kv_bytes_per_token` the KV cache's bytes per token over every layer (all chips), `weight_bytes` the
  rollout weights per chip."""
  step_s = dict(step_s) if isinstance(step_s, dict) else {slots: float(step_s)}
  live, busy = schedule(prompts, responses, slots)
  rung = rungs_of(busy, sorted(step_s), shards)
  per_rung = {int(b): int((rung == b).sum()) for b in sorted(step_s)}
  kernel_bytes = float(live.sum()) * kv_bytes_per_token / chips
  steps = len(live)
  return RolloutCost(profile_name, steps, int(responses.sum()), sum(step_s[b] * k for b, k in per_rung.items()),
                     kernel_bytes, kernel_bytes / hbm_bytes_per_s,
                     (steps * weight_bytes + kernel_bytes) / hbm_bytes_per_s, chips,
                     float(busy.mean()) if steps else 0.0, per_rung)
