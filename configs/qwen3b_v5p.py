"""Qwen2.5-3B, released PACS recipe, on a TPU v5p-64 slice (32 chips, 95 GB HBM each)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _released import released_recipe  # noqa: E402


def get_config(algorithm: str = "pacs"):
  c = released_recipe("qwen2.5-3b", "Qwen/Qwen2.5-3B", algorithm)
  c.hardware.tpu_topology = "v5p:2x4x4"  # --compile_only builds the mesh and compiles for this slice
  c.hardware.num_devices = 32
  c.hardware.hbm_gb = 95.0
  c.hardware.num_processes = 8  # 4 chips per v5p host; each host feeds whole prompt groups
  c.mesh.data = 1
  c.mesh.fsdp = 16  # weights and Adam state sharded 16 ways, batch rows over fsdp
  c.mesh.tensor = 2  # 16 query / 2 kv heads split over 2 chips: halves attention and KV cache per chip
  c.train.micro_batch_prompts = 8  # 64 rows of 4,608 tokens per micro-batch = 4 rows per fsdp shard; 1 prompt per host
  # Packed rows (released: `packing`): up to 80 rows, 5 per fsdp shard, where a padded micro-batch takes 64. The
  # row quantum is one 4,608-token row per shard (16 rows), so at 64 two merged micro-batches of long-tailed
  # responses (30% real tokens) take 48 of 128 rows; at 80, four take 80 of 256 (31%: 1.06x the real
  # tokens' share at the `rlvr` profile, docs/tpu.md "Length profiles").
  c.train.packing_rows = 80
  # Splash attention (attention_impl "auto" on TPU) and no matmul re-run in the backward pass: the compiled
  # train step does 1.17x (1.56x with XLA attention) the model's 6N FLOPs per token,
  # 32.9 GB per chip at its peak (docs/benchmarks.md; benchmarks/train_step_compile_tpu.py).
  c.model.remat_policy = "matmuls"
  # The LM head 1,024 positions at a time with its 16-bit logits kept for the backward pass (2.5 GB per chip per
  # micro-batch): no head matmul re-run (train step FLOPs 1.17x 6N, not 1.20x), and 6% less compiler-optimal time
  # than 128-position chunks recomputed (docs/benchmarks.md, "Against MaxText").
  c.train.logits_chunk = 1024
  c.train.keep_logits = True
  c.rollout.slots = 2048  # concurrent sequences (128 per chip); the rest queue (continuous batching)
  return c
