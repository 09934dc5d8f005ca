"""`--compile_only` of a tool run (env.name "python_tool", docs/tools.md): its rollout decodes with the turn end as a
pause id, and each tool's output continues the paused slots (`Engine.continue_slots`) in buckets of inserted tokens.
The continue programs are compiled here at the largest call (every slot continued at once) for each bucket an
observation can take; a single-turn run has none and its programs take no pause ids (the same programs as before
conversations existed)."""

from __future__ import annotations

import ml_collections

from pacs_jax.envs import env as env_lib
from pacs_jax.rollout import budget as budget_lib

SINGLE_TURN = "single_turn"
# What an observation holds besides the program's output, bounded in tokens by its bytes (a byte-level BPE token
# holds at least one byte): the template's tool turn around it and the sandbox's note on an output cut or a failure.
TEMPLATE_BYTES = len((env_lib.QWEN25.before + env_lib.QWEN25.after).encode()) + 64


def pause_count(cfg: ml_collections.ConfigDict) -> int:
  """Pause ids a run's rollout decodes with: a conversation's one turn end (`ToolRollout.pause_ids`), or none."""
  return 0 if cfg.env.name == SINGLE_TURN else 1


def observation_tokens(cfg: ml_collections.ConfigDict, engine) -> int:
  """Most tokens one continuation inserts: the sandbox's `env.output_bytes` and the template around them, within the
  response's `rollout.max_new_tokens` (an observation counts against it) and a slot's rows."""
  return min(int(cfg.env.output_bytes) + TEMPLATE_BYTES, cfg.rollout.max_new_tokens, engine.continue_buckets[-1])


def continue_buckets(cfg: ml_collections.ConfigDict, engine) -> tuple[int, ...]:
  """The continue buckets a conversation's observations take: each up to the longest observation's."""
  top = engine.continue_bucket_length(observation_tokens(cfg, engine))
  return tuple(b for b in engine.continue_buckets if b <= top)


def continue_programs(cfg: ml_collections.ConfigDict, engine, run, report_cls, sample_params, decode_state, sampling,
                      waves: int, flops_per_token: float, resident: float) -> None:
  """Compiles a tool run's continue programs through `run(report, lower, resident)` (aot.compile_run's): `requests`
  the slots padded to a power of two (every slot paused at once), one program per bucket of `continue_buckets`. The
  step's calls are bounded at the longest bucket: each wave's slots continued together after each turn but the last
  (`env.max_turns` - 1 of them)."""
  if not pause_count(cfg):
    return
  requests = budget_lib.next_pow2(engine.max_concurrent_decodes)
  buckets = continue_buckets(cfg, engine)
  for T in buckets:
    calls = waves * (cfg.env.max_turns - 1) if T == buckets[-1] else 0.0
    run(report_cls(f"continue[Q={requests},T={T}]", "rollout", calls, flops_per_token * requests * T),
        lambda T=T: engine.lower_continue(sample_params, decode_state, requests, T, sampling, pauses=1),
        lambda c: resident)
