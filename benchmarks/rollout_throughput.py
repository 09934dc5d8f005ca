"""Rollout engine throughput (random weights): prefill and decode tokens/s, and the fraction of the memory
bandwidth roofline a decode step reaches (weights + KV cache read once per step).

  python benchmarks/rollout_throughput.py --preset tiny --dtype float32
  python benchmarks/rollout_throughput.py --preset qwen2.5-0.5b --batch 8 --prompt_len 128 --new_tokens 128 \
      --memory_bandwidth_gbps 3350      # e.g. H100 SXM HBM3
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import families
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import sampling, scheduler


def timed(fn, repeats: int) -> float:
  """Best wall time of `fn()` (blocking on its result) over `repeats` runs."""
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny", choices=sorted(families.preset_names()))
  parser.add_argument("--batch", type=int, default=8, help="decode slots (and prompts prefilled at once)")
  parser.add_argument("--prompt_len", type=int, default=128)
  parser.add_argument("--new_tokens", type=int, default=128, help="decode steps timed (cache = prompt_len + this)")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  parser.add_argument("--steps_per_call", type=int, default=16, help="decode steps per device call")
  parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel size (mesh over all devices if > 1 "
                      "device: fsdp = devices / tensor)")
  parser.add_argument("--memory_bandwidth_gbps", type=float, default=None,
                      help="memory bandwidth of one device in GB/s for the roofline (e.g. 3350 H100, 2765 v5p, 819 v5e)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--page_size", type=int, default=64)
  args = parser.parse_args()

  dtype = jnp.dtype(args.dtype)
  config = families.preset(args.preset, param_dtype=dtype, dtype=dtype)
  mesh = sharding.make_mesh(fsdp=-1, tensor=args.tensor) if jax.device_count() > 1 else None
  model = sharding.create_sharded(lambda: families.causal_lm(config, rngs=nnx.Rngs(0)), mesh, "sample")
  B, P, R = args.batch, args.prompt_len, args.new_tokens
  engine = engine_lib.Engine(model, max_concurrent_decodes=B, max_prefill_length=P, max_decode_length=R,
                             mesh=mesh, steps_per_call=args.steps_per_call, page_size=args.page_size)
  params = engine.load_params(model)
  del model
  method, no_eos = sampling.Temperature(1.0), ()
  prompts = np.random.default_rng(0).integers(0, config.vocab_size, size=(B, P)).astype(np.int32)
  lengths = np.full((B,), P, np.int32)

  # Prefill: B prompts of P tokens in one call.
  prefill_s = timed(lambda: engine.prefill_batch(params, prompts, lengths), args.repeats + 1)

  # Decode: all slots busy for R steps, no EOS; the first (compiling) pass is not timed.
  def fill():
    state = engine.init_decode_state()
    state, _ = scheduler.prefill_insert(engine, params, state, prompts.tolist(), list(range(B)), list(range(B)),
                                        list(range(B)), [0] * B, [R + 1] * B, 0, method, no_eos)
    return jax.block_until_ready(state)

  def decode(state):
    """Until every slot has generated R tokens (budget and cache both end there); returns the state,
    the decode steps and the KV rows each step read (all slots, summed), with page budgets chosen as `generate` does."""
    steps, rows_read, rows, active = 0, 0, np.full(B, P), np.ones(B, bool)
    while active.any():
      page_budget = engine.policy.page_budget(rows, active)
      state, out = engine.decode(params, state, B + 1, method, no_eos, page_budget)
      emitted, active, lengths = out.emitted, np.asarray(out.active), out.lengths
      done = int(np.asarray(emitted).any(axis=0).sum())  # the host reads results each call, as `generate` does
      steps, rows_read = steps + done, rows_read + done * engine.policy.rows_read(page_budget)
      rows = np.asarray(lengths)
    return jax.block_until_ready(state), steps, rows_read

  # Bytes one device reads per decode step: its shard of every weight, and of every layer's KV cache
  # rows in the step's page budget (live pages, padded to the budget).
  shard_bytes = lambda x: x.addressable_shards[0].data.nbytes
  param_bytes = sum(shard_bytes(x) for x in jax.tree.leaves(params))
  state = fill()
  kv_bytes = shard_bytes(state.cache.pages)
  kv_rows = state.cache.pages.shape[1] * state.cache.pages.shape[2]  # rows the page pool holds
  decode(state)  # compiles every page budget (the state is donated)
  best = math.inf
  for _ in range(args.repeats):
    state = fill()
    start = time.perf_counter()
    _, steps, rows_read = decode(state)
    best = min(best, (time.perf_counter() - start) / steps)
  step_s = best
  kv_step_bytes = kv_bytes * rows_read / steps / kv_rows

  print(f"backend={jax.default_backend()} devices={jax.device_count()} preset={args.preset} dtype={dtype.name} "
        f"slots={B} prompt_len={P} new_tokens={R} cache_rows={engine.cache_length} "
        f"params={sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M")
  print(f"prefill: {B * P / prefill_s:12,.0f} tokens/s  ({prefill_s * 1e3:.1f} ms for {B}x{P})")
  print(f"decode:  {B / step_s:12,.0f} tokens/s  ({step_s * 1e3:.2f} ms/step, {B} slots)")
  print(f"page budgets {engine.page_budgets}: {rows_read / steps:,.0f} of {kv_rows:,} KV rows "
        f"read per step on average")
  print(f"bytes read per decode step and device: weights {param_bytes / 1e6:,.1f} MB + KV cache "
        f"{kv_step_bytes / 1e6:,.1f} MB (whole cache {kv_bytes / 1e6:,.1f} MB)")
  if args.memory_bandwidth_gbps:
    roofline_s = (param_bytes + kv_step_bytes) / (args.memory_bandwidth_gbps * 1e9)
    print(f"roofline: {roofline_s * 1e3:.2f} ms/step at {args.memory_bandwidth_gbps:g} GB/s -> "
          f"{roofline_s / step_s:.1%} of the bandwidth roofline")


if __name__ == "__main__":
  main()
