"""Qwen2.5-3B, released PACS recipe, on one 8-GPU node (8 x H100 80 GB)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _released import released_recipe  # noqa: E402


def get_config(algorithm: str = "pacs"):
  c = released_recipe("qwen2.5-3b", "Qwen/Qwen2.5-3B", algorithm)
  c.hardware.gpu_target, c.hardware.gpu_topology = "h100-sxm-80gb", "1x1x8"  # --compile_only compiles for these
  c.hardware.num_devices = 8
  c.hardware.hbm_gb = 80.0
  c.hardware.num_processes = 1
  c.mesh.data = 1
  c.mesh.fsdp = 8
  c.mesh.tensor = 1
  c.train.micro_batch_prompts = 1  # 8 rows = 1 row per GPU per micro-batch
  c.rollout.slots = 512
  return c
