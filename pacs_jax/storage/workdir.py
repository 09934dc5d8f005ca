"""The layout of a training workdir, named once: what training writes and export/evaluate read."""

from __future__ import annotations

import os

from pacs_jax import paths

CHECKPOINT_DIR = "checkpoints"  # Orbax's steps
SET_ASIDE_DIR = "checkpoints_set_aside"  # beside CHECKPOINT_DIR: damaged or discarded steps
MODEL_DIR = "model"  # the policy's HF config.json and tokenizer, written when training starts
LOCK_FILE = "trainer.lock"  # one trainer per workdir


def checkpoint_dir(workdir: str) -> str:
  return paths.join(workdir, CHECKPOINT_DIR)


def model_dir(workdir: str) -> str:
  return paths.join(workdir, MODEL_DIR)



def default_workdir(config_path: str, algorithm: str) -> str:
  """runs/<config file name>-<algorithm>: the demo and each of its baselines train their own run."""
  return os.path.join("runs", f"{os.path.splitext(os.path.basename(config_path))[0]}-{algorithm}")
