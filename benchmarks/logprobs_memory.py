"""Compiled temporary memory of the chunked token log-probs vs the size of the bf16 logits (compile only).

  python benchmarks/logprobs_memory.py                      # V = 151,936, T = 4096, B = 1
  python benchmarks/logprobs_memory.py --seq_len 512 --batch 4 --chunk_size 256
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pacs_jax.models import chunked_logprobs as lp


def temp_bytes(fn, *shapes) -> int:
  return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--vocab", type=int, default=151_936)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--chunk_size", type=int, default=lp.DEFAULT_CHUNK_SIZE)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  parser.add_argument("--skip_naive", action="store_true", help="skip the unchunked log_softmax baseline")
  args = parser.parse_args()

  B, T, V, C = args.batch, args.seq_len, args.vocab, args.chunk_size
  dtype = jnp.dtype(args.dtype)
  logits = jax.ShapeDtypeStruct((B, T, V), dtype)
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
  logits_bytes = B * T * V * dtype.itemsize

  def naive(x, t):  # what the chunking avoids: a full fp32 log-softmax
    logp_all = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp_all, t[..., None], axis=-1)[..., 0]

  def both_sum(x, t):
    logp, entropy = lp.token_logprobs_and_entropy(x, t, chunk_size=C)
    return jnp.sum(logp) + jnp.sum(entropy)

  cases = {
      "token_logprobs": lambda x, t: lp.token_logprobs(x, t, chunk_size=C),
      "token_logprobs_and_entropy": lambda x, t: lp.token_logprobs_and_entropy(x, t, chunk_size=C),
      "grad of logprobs+entropy": jax.grad(both_sum),
  }
  if not args.skip_naive:
    cases["naive log_softmax+gather"] = naive

  print(f"backend={jax.default_backend()} B={B} T={T} V={V} dtype={dtype.name} chunk_size={C}")
  print(f"logits: {logits_bytes / 2**20:,.1f} MiB")
  print(f"{'function':30s} {'temp MiB':>12s} {'temp / logits':>14s}")
  for name, fn in cases.items():
    temp = temp_bytes(fn, logits, tokens)
    print(f"{name:30s} {temp / 2**20:12,.1f} {temp / logits_bytes:14.3f}")


if __name__ == "__main__":
  main()
