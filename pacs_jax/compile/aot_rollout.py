"""The rollout's side of `--compile_only` beyond the top decode program: the slot ladder's decode programs
(`rollout/slot_rungs.py`) and the rollout costed with its paged attention kernel at length profiles
(`rollout_cost`), each decode step at the time of the rung that holds its busy slots."""

from __future__ import annotations

import math

import jax
import ml_collections
import numpy as np

from pacs_jax.compile import aot_measure, length_profile, rollout_cost
from pacs_jax.compile.target import Target

RUNG_PREFIX = "decode_rung"


def rung_name(slots: int) -> str:
  return f"{RUNG_PREFIX}[slots={slots}]"


def rung_programs(engine, run, report_cls, sample_params, decode_state, sampling, flops_per_token: float,
                  resident: float, pauses: int = 0) -> None:
  """Compiles the decode program of each rung below the engine's slot count (at the top page budget) through
  `run(report, lower, resident)` (aot.compile_run's). Their calls are costed per decode step by
  `rollout_at_profiles`, not counted as calls of the step."""
  for rung in getattr(engine, "slot_rungs", ())[:-1]:
    run(report_cls(rung_name(rung), "rollout", 0.0, flops_per_token * rung * engine.steps_per_call),
        lambda b=rung: engine.lower_decode(sample_params, decode_state, None, sampling, pauses=pauses, rung=b),
        lambda c: resident)


def rollout_at_profiles(cfg: ml_collections.ConfigDict, tgt: Target, reports: list, decode_state,
                        rollout_weights: float, engine) -> list[rollout_cost.RolloutCost]:
  """The rollout costed with its paged attention kernel (`rollout_cost`) at `max` and at `compile.length_profile`:
  the compiler's time per decode step at the top page budget (and at each rung of the slot ladder), the KV cache's
  bytes per token (every layer) from the decode state's pages [layers, pages, page size, 2K, H], the compiler's
  HBM rate. [] where the compiler gives no time (a GPU compiled for without one) or no decode program compiled."""
  decode = [p for p in reports if p.name.startswith("decode[") and not p.error and p.optimal_s]
  rates = aot_measure.device_rates(tgt.devices[0])
  if not decode or rates is None or decode_state is None:
    return []
  B = engine.max_concurrent_decodes
  step_s = {B: decode[-1].optimal_s / engine.steps_per_call}  # the top page budget's (the last compiled)
  for rung in getattr(engine, "slot_rungs", ())[:-1]:
    compiled = [p for p in reports if p.name == rung_name(rung) and not p.error and p.optimal_s]
    if compiled:
      step_s[rung] = compiled[0].optimal_s / engine.steps_per_call
  pages = max(jax.tree.leaves(decode_state), key=lambda a: math.prod(a.shape))  # [layers, A, ps, 2K, H]
  kv_per_token = pages.shape[0] * pages.shape[3] * pages.shape[4] * np.dtype(pages.dtype).itemsize
  n, P, R = cfg.rollout.n, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
  out = []
  for profile in dict.fromkeys([length_profile.MAX, length_profile.resolve(cfg.compile.length_profile)]):
    prompts, responses = length_profile.sample(profile, cfg.train.batch_prompts, n, P, R, seed=cfg.seed)
    out.append(rollout_cost.cost(profile.name, prompts, responses, B, step_s, kv_per_token, rollout_weights,
                                 len(tgt.devices), rates[1], shards=getattr(engine, "page_shards", 1)))
  return out
