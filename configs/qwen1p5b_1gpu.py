"""Small replication on one GPU (80 GB): Qwen2.5-1.5B with the released PACS loss, a smaller batch.

The objective, n = 8, RLOO, class weights and lr are the released ones; the batch is 128 prompts (4
mini-batches of 32) and responses are capped at 2,048 tokens so a step fits one GPU's memory and time. Use `--config.model.preset=qwen2.5-0.5b
--config.model.hf_path=Qwen/Qwen2.5-0.5B` for the 0.5B model.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _released import released_recipe  # noqa: E402


def get_config(algorithm: str = "pacs"):
  c = released_recipe("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", algorithm)
  c.hardware.gpu_target, c.hardware.gpu_topology = "h100-sxm-80gb", "1x1x1"  # --compile_only compiles for these
  c.hardware.num_devices = 1
  c.hardware.hbm_gb = 80.0
  c.hardware.num_processes = 1
  c.mesh.data = 1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.train.batch_prompts = 128
  c.train.mini_batch_prompts = 32
  c.train.micro_batch_prompts = 1
  c.rollout.max_new_tokens = 2048
  c.rollout.slots = 128
  c.reward_workers = 4
  return c
