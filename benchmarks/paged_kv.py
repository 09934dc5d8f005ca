"""KV rows read per decode step and KV bytes held by the paged cache, against what a dense windowed cache would read
and hold in the same decode calls (`rollout/dense_figures.py`), for a rollout whose response lengths are long-tailed:
most short (up to new_tokens / 8), one in `--long_every` at the maximum (random weights, per-prompt token budgets,
no EOS).

  python benchmarks/paged_kv.py                       # tiny model on CPU
  python benchmarks/paged_kv.py --kv_pages 160        # a pool of 160 pages of 16 rows (0.56x the dense cache)
  python benchmarks/paged_kv.py --slots 64 --new_tokens 1024 --page_size 64
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax.models import families
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import dense_figures, sampling, scheduler


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny", choices=sorted(families.preset_names()))
  parser.add_argument("--slots", type=int, default=16)
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--prompt_len", type=int, default=32, help="prompts of prompt_len / 4 .. prompt_len tokens")
  parser.add_argument("--new_tokens", type=int, default=256)
  parser.add_argument("--page_size", type=int, default=16)
  parser.add_argument("--long_every", type=int, default=8, help="one request in this many runs to new_tokens")
  parser.add_argument("--steps_per_call", type=int, default=16)
  parser.add_argument("--kv_pages", type=int, default=0, help="the page pool (0: every slot at full length)")
  args = parser.parse_args()

  config = families.preset(args.preset)
  model = families.causal_lm(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, size=n).tolist()
             for n in rng.integers(max(1, args.prompt_len // 4), args.prompt_len + 1, size=args.requests)]
  budgets = rng.integers(1, args.new_tokens // 8 + 1, size=args.requests)
  budgets[rng.permutation(args.requests)[:args.requests // args.long_every]] = args.new_tokens
  kw = dict(max_new_tokens=budgets.tolist(), sampling=sampling.Temperature(1.0), seed=0)
  common = dict(max_concurrent_decodes=args.slots, max_prefill_length=args.prompt_len,
                max_decode_length=args.new_tokens, steps_per_call=args.steps_per_call)
  engine = engine_lib.Engine(model, page_size=args.page_size, kv_pages=args.kv_pages, **common)
  row_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_size * jnp.dtype(config.dtype).itemsize
  params = engine.load_params(model)
  # The dense cache at its best: windows from one page up, so it reads no more than the longest row needs.
  stats = dense_figures.DenseFigures.of(engine, min_window=args.page_size)
  start = time.perf_counter()
  completions = scheduler.generate(engine, params, prompts, stats=stats, **kw)
  print(f"paged rollout: {time.perf_counter() - start:.1f} s (compiles included)")
  if args.kv_pages:  # a pool that runs short makes slots wait, never changes a token
    roomy = engine_lib.Engine(model, page_size=args.page_size, **common)
    same = scheduler.generate(roomy, roomy.load_params(model), prompts, **kw)
    assert [c.tokens for c in completions] == [c.tokens for c in same], "a smaller page pool changed the tokens"
    print(f"--kv_pages {args.kv_pages}: the same tokens as a pool of every slot's pages")
  lengths = np.array([len(c.tokens) for c in completions])
  print(f"backend={jax.default_backend()} preset={args.preset} slots={args.slots} requests={args.requests} "
        f"cache_rows={engine.cache_length} page_size={args.page_size}")
  print(f"response lengths: median {np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, "
        f"max {lengths.max()}, {np.mean(lengths == args.new_tokens):.0%} at the maximum of {args.new_tokens}")
  figures = {"paged": (stats.rows_per_step, stats.peak_rows_held),
             "dense windowed": (stats.dense_rows_per_step, stats.dense_rows_held)}
  for name, (per_step, held) in figures.items():
    print(f"{name:>15}: {per_step:8,.0f} KV rows read per decode step (mean over {stats.steps} steps), "
          f"{held * row_bytes / 2**20:8.2f} MiB KV held at most ({held:,} rows)")
  pool = engine.page_shards * engine.pages_per_shard * args.page_size
  print(f"paged / dense windowed: {stats.rows_per_step / stats.dense_rows_per_step:.2f}x the rows read per step, "
        f"{stats.peak_rows_held / stats.dense_rows_held:.2f}x the KV bytes held "
        f"(page pool: {pool:,} rows allocated, {pool / stats.dense_rows_held:.2f}x)")


if __name__ == "__main__":
  main()
