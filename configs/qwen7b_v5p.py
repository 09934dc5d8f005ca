"""Qwen2.5-7B, released PACS recipe, on a TPU v5p-128 slice (64 chips, 95 GB HBM each)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _released import released_recipe  # noqa: E402


def get_config(algorithm: str = "pacs"):
  c = released_recipe("qwen2.5-7b", "Qwen/Qwen2.5-7B", algorithm)
  c.hardware.tpu_topology = "v5p:4x4x4"  # --compile_only builds the mesh and compiles for this slice
  c.hardware.num_devices = 64
  c.hardware.hbm_gb = 95.0
  c.hardware.num_processes = 16  # 4 chips per v5p host; each host feeds whole prompt groups
  c.mesh.data = 1
  c.mesh.fsdp = 32
  c.mesh.tensor = 2  # 28 query / 4 kv heads
  c.train.micro_batch_prompts = 16  # 128 rows per micro-batch = 4 rows per fsdp shard; 1 prompt per host
  # Packed rows (released: `packing`): up to 160 rows, 5 per fsdp shard, where a padded micro-batch takes 128. The
  # row quantum is one 4,608-token row per shard (32 rows), so at 128 two merged micro-batches of long-tailed
  # responses (30% real tokens) take 96 of 256 rows; at 160, four take 160 of 512 (31%: 1.06x the real
  # tokens' share at the `rlvr` profile, docs/tpu.md "Length profiles").
  c.train.packing_rows = 160
  # Splash attention (attention_impl "auto" on TPU) and no matmul re-run in the backward pass: the compiled
  # train step does 1.10x (1.43x with XLA attention) the model's 6N FLOPs per token,
  # 42.6 GB per chip at its peak (docs/benchmarks.md; benchmarks/train_step_compile_tpu.py).
  c.model.remat_policy = "matmuls"
  # The LM head 1,024 positions at a time with its 16-bit logits kept for the backward pass (2.5 GB per chip per
  # micro-batch): no head matmul re-run and less compiler-optimal time
  # than 128-position chunks recomputed (docs/benchmarks.md, "Against MaxText").
  c.train.logits_chunk = 1024
  c.train.keep_logits = True
  # 4,096 concurrent sequences (64 per chip; half the step's 8,192 responses at once): the rollout with its paged
  # kernel costs 25.6 s at `rlvr` (1.15x its HBM roofline) against 42.2 s (1.38x) at 2,048, and 64.1 s (1.08x)
  # against 109.6 s at `max`, 31.5 GB per chip (benchmarks/rollout_layout.py; docs/tpu.md).
  c.rollout.slots = 4096
  return c
