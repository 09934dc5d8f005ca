"""The response and prompt lengths a run's update is costed at (`compile.length_profile`): how many packed rows
(trainer/sequence_packing.py) a step's micro-batches take, and what share of the padded rows' tokens are real.

- `max`: every prompt at `data.max_prompt_length` and every response at `rollout.max_new_tokens` (the padded
  layout's own assumption, and the worst case).
- `rlvr`: the stand-in for an RLVR run from a Qwen2.5-7B-class base on DeepScaleR-like prompts (no published run's
  length histogram could be read here): responses of mean 0.3 x max_new_tokens with 5% at the cap, prompts of
  mean 150 tokens (docs/tpu.md, "Length profiles").
- a path to a past run's metrics.jsonl: its last 50 steps' mean response length (`response_length/mean`) and the
  share that reached the cap (`response_length/clip_ratio`), prompts as `rlvr`'s.

Lengths are drawn (seeded) for one step's rows: a prompt per group of n, each response its own (the share at the
cap exactly at R, the rest from a gamma of shape 2 with the mean that makes the profile's, cut to [1, R]).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from pacs_jax import paths
from pacs_jax.services import metrics
from pacs_jax.trainer import sequence_packing

PROFILES = ("max", "rlvr")
RLVR_RESPONSE_FRACTION, RLVR_AT_CAP, RLVR_PROMPT_MEAN = 0.3, 0.05, 150.0


@dataclasses.dataclass(frozen=True)
class LengthProfile:
  name: str
  response_mean: float | None  # tokens; None: response_fraction x R
  response_fraction: float
  at_cap: float  # share of responses that reach R
  prompt_mean: float | None  # tokens; None: every prompt at P

  def mean_response(self, R: int) -> float:
    return min(float(R), self.response_mean if self.response_mean is not None else self.response_fraction * R)


MAX = LengthProfile("max", None, 1.0, 1.0, None)
RLVR = LengthProfile("rlvr", None, RLVR_RESPONSE_FRACTION, RLVR_AT_CAP, RLVR_PROMPT_MEAN)


def resolve(value: str) -> LengthProfile:
  """`compile.length_profile` -> its profile: "max", "rlvr" or a metrics.jsonl path (ValueError naming the file)."""
  if value in ("max", ""):
    return MAX
  if value == "rlvr":
    return RLVR
  if not paths.exists(value):
    raise ValueError(f"compile.length_profile: {value!r} is neither one of {PROFILES} nor a metrics.jsonl file")
  rows = [r for r in metrics.read_rows(value) if "response_length/mean" in r][-50:]
  if not rows:
    raise ValueError(f"compile.length_profile: {value} has no row with response_length/mean")
  mean = float(np.mean([r["response_length/mean"] for r in rows]))
  at_cap = float(np.mean([r.get("response_length/clip_ratio", 0.0) for r in rows]))
  return LengthProfile(os.path.basename(os.path.dirname(os.path.abspath(value))) or value, mean, 0.0, at_cap,
                       RLVR_PROMPT_MEAN)


def sample(profile: LengthProfile, groups: int, n: int, P: int, R: int, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray]:
  """(prompt lengths, response lengths) [groups * n] of one step's rows, prompt-major."""
  if profile.prompt_mean is None and profile.at_cap >= 1.0:
    return np.full(groups * n, P), np.full(groups * n, R)
  rng = np.random.default_rng(seed)
  if profile.prompt_mean is None:
    prompts = np.full(groups, P)
  else:
    prompts = np.clip(np.rint(rng.gamma(4.0, profile.prompt_mean / 4.0, groups)), 1, P)
  rows = groups * n
  capped = rng.random(rows) < profile.at_cap
  rest = max((profile.mean_response(R) - profile.at_cap * R) / max(1.0 - profile.at_cap, 1e-9), 1.0)
  responses = np.clip(np.rint(rng.gamma(2.0, rest / 2.0, rows)), 1, R)
  responses[capped] = R
  return np.repeat(prompts, n).astype(np.int64), responses.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class StepRows:
  """One step at a profile: the packed micro-batches (each `merge` padded ones, in `rows` rows: the step's rung)
  and the token shares."""
  profile: LengthProfile
  rows: int  # b: the rung every packed micro-batch of the step takes
  merge: int  # f: padded micro-batches per packed one
  real_share: float  # real tokens / the padded rows' tokens (m x (P + R) per micro-batch)
  packed_share: float  # packed tokens (b x T per packed micro-batch) / the padded rows' tokens
  mean_prompt: float
  mean_response: float


def step_rows(profile: LengthProfile, layout, batch_rows: int, n: int, seed: int = 0) -> StepRows:
  """How a step of `batch_rows` rows (micro-batches of `layout.m`, k a mini-batch) packs at `profile` on `layout`'s
  ladder (as `packing.packed_rows` packs a real step)."""
  P, R, m, T = layout.P, layout.R, layout.m, layout.row_tokens or layout.P + layout.R
  prompts, responses = sample(profile, batch_rows // n, n, P, R, seed)
  lengths = prompts + responses
  ladder = layout.row_ladder or sequence_packing.ladder(m, 1, 8)
  needed = sequence_packing.rows_by_merge(lengths, n, m, layout.k, T)
  merge, rows = sequence_packing.choose(needed, ladder[-1], ladder)
  padded_tokens = float(batch_rows * (P + R))
  return StepRows(profile, rows, merge, float(lengths.sum()) / padded_tokens,
                  batch_rows // (m * merge) * rows * T / padded_tokens, float(prompts.mean()), float(responses.mean()))
