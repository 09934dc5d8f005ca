"""The slot ladder (`rollout.slot_rungs`, rollout/slot_rungs.py) on this machine: a long-tailed rollout (one request
in 8 runs to --new_tokens, the rest to 8-32 tokens; random weights, temperature 1) timed over every slot and with
the ladder, interleaved, in one run; the tokens are the same.

  python benchmarks/slot_ladder.py                  # a 4-layer, 512-wide model on CPU, 32 slots, 64 requests
  python benchmarks/slot_ladder.py --preset tiny --rungs 4

On TPU the compiler's estimate decides (`--compile_only` prints the rollout by rung when a config sets the ladder):
docs/tpu.md says what it gave.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from flax import nnx

from pacs_jax.models import families
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import sampling, scheduler


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="mid", choices=["mid"] + sorted(families.preset_names()),
                      help="mid: tiny at hidden 512, 4 layers (decode compute-bound on a CPU)")
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--rungs", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  config = (families.preset("tiny", hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=64)
            if args.preset == "mid" else families.preset(args.preset))
  model = families.causal_lm(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, config.vocab_size, size=int(n)).tolist() for n in rng.integers(8, 32, size=args.requests)]
  budgets = [args.new_tokens if i % 8 == 0 else int(rng.integers(8, 32)) for i in range(args.requests)]
  kw = dict(max_new_tokens=budgets, sampling=sampling.Temperature(1.0), seed=1)
  engines = {rungs: engine_lib.Engine(model, max_concurrent_decodes=args.slots, max_prefill_length=32,
                                      max_decode_length=args.new_tokens, steps_per_call=16, page_size=16,
                                      slot_rungs=rungs) for rungs in (1, args.rungs)}
  params = engines[1].load_params(model)
  times = {rungs: [] for rungs in engines}
  tokens = {}
  for rungs, engine in engines.items():  # compile every program first
    tokens[rungs] = [c.tokens for c in scheduler.generate(engine, params, prompts, **kw)]
  for _ in range(args.repeats):
    for rungs, engine in engines.items():
      start = time.perf_counter()
      scheduler.generate(engine, params, prompts, **kw)
      times[rungs].append(time.perf_counter() - start)
  assert tokens[1] == tokens[args.rungs], "the ladder changed a token"
  every, ladder = min(times[1]), min(times[args.rungs])
  print(f"{args.requests} requests on {args.slots} slots, {sum(map(len, tokens[1]))} tokens, best of {args.repeats}:")
  print(f"  every slot {engines[1].slot_rungs}: {every:.3f} s")
  print(f"  slot ladder {engines[args.rungs].slot_rungs}: {ladder:.3f} s ({every / ladder:.2f}x faster, same tokens)")


if __name__ == "__main__":
  main()
