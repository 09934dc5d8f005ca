"""Qwen2.5-7B, released PACS recipe (batch, lengths, objective), LoRA on one TPU v5p-8 host (4 chips, 95 GB HBM each).

The full-parameter recipe needs a v5p-128 (configs/qwen7b_v5p.py). Here only rank-32 adapters on every projection
of every layer are trained (docs/lora.md); the base weights stay frozen and are the frozen reference, so one host
holds the run. `--compile_only` compiles every program for v5p:2x2x1 (docs/tpu.md has the figures next to the full
run's on the same host).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _released import released_recipe  # noqa: E402


def get_config(algorithm: str = "pacs"):
  c = released_recipe("qwen2.5-7b", "Qwen/Qwen2.5-7B", algorithm)
  c.hardware.tpu_topology = "v5p:2x2x1"  # --compile_only builds the mesh and compiles for this host
  c.hardware.num_devices = 4
  c.hardware.hbm_gb = 95.0
  c.hardware.num_processes = 1
  c.mesh.data = 1
  c.mesh.fsdp = 2
  c.mesh.tensor = 2  # 28 query / 4 kv heads
  # Adapters on q, k, v, o, gate, up and down (LoRA Without Regret: the MLP's matter most; rank barely matters
  # for RL, which learns few bits per episode). alpha 32 at rank 32: scale 1.
  c.lora.rank = 32
  c.lora.alpha = 32.0
  c.lora.targets = "q,k,v,o,gate,up,down"
  # Learning rate: the released full fine-tuning rate 1e-6 (train.lr) x lora.lr_multiplier 10 = 1e-5. Thinking
  # Machines' "LoRA Without Regret" (2025) finds LoRA's best learning rate about 10x full fine-tuning's, RL included.
  c.lora.lr_multiplier = 10.0
  # The base is frozen and Qwen2.5-7B's checkpoint is bf16: held in bf16 it computes exactly what fp32 would (every
  # weight is cast to the bf16 compute dtype before use, and the merge rounds W + scale·AB to bf16 either way), in
  # half the memory. The adapters and their Adam moments are fp32 whatever this is.
  c.model.param_dtype = "bfloat16"
  c.train.micro_batch_prompts = 1  # 8 rows of 4,608 tokens per micro-batch: 4 rows per fsdp shard
  # No matmul re-run in the backward pass: 21% less compiler-optimal time per update than "nothing" (244 vs 309 s),
  # at 64 GB of temporaries per chip (13 GB with "nothing"): the saved matmul outputs include each adapter's.
  c.model.remat_policy = "matmuls"
  c.train.logits_chunk = 1024
  c.train.keep_logits = True
  # 64 prompts' groups at once: 34 GB of KV cache per chip. 768 slots (51 GB) leave 8% free in the rollout phase,
  # for no gain: decode is bound by reading the cache, and a step's decode costs 388 s of compiler-optimal time either way.
  c.rollout.slots = 512
  return c
