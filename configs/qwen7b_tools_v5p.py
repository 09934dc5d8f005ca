"""Qwen2.5-7B, released PACS recipe with a Python tool (tool-integrated RL, docs/tools.md), on one TPU v5p-8 host.

A response is a conversation (env.name "python_tool"): a model turn whose last ```python block holds code runs it in
the host's sandbox, its output returns as Qwen2.5's chat template's tool turn (`<tool_response>`, the default
ToolTemplate QWEN25) and the model goes on, up to 4 turns; a turn without one is the answer. The rollout decodes
with the turn end `<|im_end|>` as a pause id and continues the paused slots with each observation.

A conversation rollout runs on one process (config/env_checks.py), so this is the one-host 7B recipe
(configs/qwen7b_lora_v5p8.py: rank-32 LoRA, 4 chips) rather than the 16-host full-parameter one
(configs/qwen7b_v5p.py). `--compile_only` compiles its programs for v5p:2x2x1, the continue programs included.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen7b_lora_v5p8 import get_config as lora_v5p8  # noqa: E402


def get_config(algorithm: str = "pacs"):
  c = lora_v5p8(algorithm)
  c.env.name = "python_tool"
  c.env.max_turns = 4  # the model's turns: up to 3 programs run, then the answer
  # The sandbox on a v5p host (208 vCPUs, 448 GB): 32 programs at once, each up to 2 s of CPU (4 s wall) in 1 GB.
  c.env.workers = 32
  c.env.cpu_seconds = 2.0
  c.env.wall_seconds = 4.0
  c.env.memory_mb = 1024
  # 1 KB of a program's output comes back: an observation (template included) is at most 1,172 tokens, so a
  # continuation takes the continue buckets up to 2,048 inserted tokens. Observations share max_new_tokens.
  c.env.output_bytes = 1024
  c.rollout.mode = "sync"  # a conversation rollout runs in the step (env_checks.py)
  # 128 slots, not the LoRA recipe's 512: a continue call reads each continued slot's whole KV prefix at once, and
  # with every slot continued together it needs 165 GB of temporaries per chip at 512 slots (109 GB at 256, at the
  # shortest bucket); at 128 its peak is 58 GB (16 inserted tokens) to 76 GB (2,048) per chip.
  c.rollout.slots = 128
  return c
