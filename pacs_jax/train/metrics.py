"""Per-step metrics to tensorBoardX, `metrics.jsonl` and a one-line console summary (process 0 only)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import numpy as np
from absl import logging

CONSOLE_KEYS = ("reward/mean", "entropy", "loss", "grad_norm", "response_length/mean", "timing/step_s")


def _plain(v: Any) -> Any:
  if isinstance(v, (np.generic, np.ndarray, jax.Array)):
    v = np.asarray(v).item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # JSON has no NaN/Inf
  return v


class MetricsWriter:
  def __init__(self, workdir: str, resume_step: int = 0):
    self.active = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb = None
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    _truncate_after(self.path, resume_step)
    from tensorboardX import SummaryWriter
    self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.active:
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in sorted(metrics.items())}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        self.tb.add_scalar(k, v, step)
    self.tb.flush()
    summary = "  ".join(f"{k.split('/')[-1] if k != 'reward/mean' else 'reward'}={row[k]:.4g}"
                        for k in CONSOLE_KEYS if isinstance(row.get(k), (int, float)))
    logging.info("step %d  %s", step, summary)
    print(f"step {step:5d}  {summary}", flush=True)

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


def _truncate_after(path: str, step: int) -> None:
  """Drops rows logged after the checkpoint we resume from (a kill may have outrun the last save)."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    rows = [line for line in f if line.strip()]
  keep = [line for line in rows if json.loads(line)["step"] <= step]
  if len(keep) != len(rows):
    with open(path, "w") as f:
      f.writelines(keep)
