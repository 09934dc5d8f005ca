"""Qwen2.5-7B with the released PACS loss, LoRA on one GPU (80 GB), a smaller batch.

As configs/qwen1p5b_1gpu.py (128 prompts in 4 mini-batches of 32, responses capped at 2,048 tokens), on the 7B:
only rank-32 adapters on every projection of every layer are trained (docs/lora.md); the base weights stay frozen
and are the frozen reference. `--compile_only` compiles every program for one H100 80 GB (docs/gpu.md has the figures
next to the full run's, which does not fit one GPU). The rollout phase peaks at 60.3 GB, above the 75% of a GPU's
memory jax takes by default: run with XLA_PYTHON_CLIENT_MEM_FRACTION=0.9.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _released import released_recipe  # noqa: E402


def get_config(algorithm: str = "pacs"):
  c = released_recipe("qwen2.5-7b", "Qwen/Qwen2.5-7B", algorithm)
  c.hardware.gpu_target, c.hardware.gpu_topology = "h100-sxm-80gb", "1x1x1"  # --compile_only compiles for these
  c.hardware.num_devices = 1
  c.hardware.hbm_gb = 80.0
  c.hardware.num_processes = 1
  c.mesh.data = 1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
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
  # half the memory (15 GB, not 30). The adapters and their Adam moments are fp32 whatever this is.
  c.model.param_dtype = "bfloat16"
  # remat_policy "nothing" (the recipe's): a micro-batch's 8 rows of 2,560 tokens keep only each layer's input.
  c.train.batch_prompts = 128
  c.train.mini_batch_prompts = 32
  c.train.micro_batch_prompts = 1
  c.rollout.max_new_tokens = 2048
  c.rollout.slots = 128
  c.reward_workers = 4
  return c
