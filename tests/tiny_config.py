"""The tiny demo config cut to a two-step in-process run (no validation, synchronous saves, one reward worker), for
tests that train through one plug point (a named reward, a rollout engine)."""

import os

from pacs_jax import config as config_lib

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.py")


def two_steps(**overrides):
  base = {"steps": 2, "eval_every": 0, "train.batch_prompts": 8, "train.mini_batch_prompts": 4,
          "checkpoint.async_save": False, "reward_workers": 1}
  return config_lib.load_config_file(TINY, {**base, **overrides})
