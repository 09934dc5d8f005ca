"""Weights & Biases logging beside TensorBoard and metrics.jsonl (config section `wandb`, process 0 only): the
config once, then every metrics row at its step. The run id lives in the workdir, so a resumed run continues the
same wandb run; a service that cannot be reached costs one warning line and the run goes on without it."""

from __future__ import annotations

import logging as std_logging
import os
import secrets
import string
from typing import Any

import jax
import ml_collections
from absl import logging

from pacs_jax import paths

RUN_ID_FILE = "wandb_run_id"


def run_id(workdir: str) -> str:
  """The workdir's wandb run id: the one a previous start wrote, else a new one, written before wandb starts (a
  run killed during its first start resumes the same id)."""
  path = paths.join(workdir, RUN_ID_FILE)
  if paths.isfile(path):
    kept = paths.read_text(path).strip()
    if kept:
      return kept
  new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # as wandb's own ids
  paths.write_atomic(path, new + "\n")
  return new


class WandbRun:
  """One wandb run: `log(step, row)` per metrics row; every wandb failure is one warning and then silence."""

  def __init__(self, run):
    self.run, self.failed = run, False

  def log(self, step: int, row: dict[str, Any]) -> None:
    if self.failed:
      return
    try:
      self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)
    except Exception as e:  # noqa: BLE001 (logging must never stop training)
      self.failed = True
      logging.warning("wandb: logging stopped (%s: %s); metrics.jsonl and TensorBoard go on", type(e).__name__,
                      _first_line(e))

  def close(self) -> None:
    try:
      self.run.finish()
    except Exception as e:  # noqa: BLE001
      logging.warning("wandb: finishing the run failed (%s: %s)", type(e).__name__, _first_line(e))


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [""])[0][:200]


def start(cfg: ml_collections.ConfigDict, workdir: str) -> WandbRun | None:
  """The run's wandb run (None when `wandb.enabled` is off, on processes other than 0, or when wandb cannot
  start: one warning line). Offline files go under a local workdir (`<workdir>/wandb`, for `wandb sync`)."""
  settings = cfg.get("wandb")
  if settings is None or not settings.enabled or jax.process_index() != 0:
    return None
  # wandb keeps its own debug logs in files; through the root logger its errors would repeat ours with a traceback.
  std_logging.getLogger("wandb").propagate = False
  os.environ.setdefault("WANDB_SILENT", "true")  # its banner lines; one line of ours names the run instead
  try:
    import wandb
    run = wandb.init(
        project=settings.project, entity=settings.entity or None,
        name=settings.name or os.path.basename(paths.normalize(workdir).rstrip("/")),
        tags=[t.strip() for t in settings.tags.split(",") if t.strip()] or None, mode=settings.mode,
        id=run_id(workdir), resume="allow", config=cfg.to_dict(),
        dir=None if paths.is_remote(workdir) else paths.normalize(workdir),
        settings=wandb.Settings(init_timeout=settings.init_timeout_s, console="off", silent=True))
  except Exception as e:  # noqa: BLE001 (no service, no login, no network: the run goes on without wandb)
    logging.warning("wandb: not logging to %s (%s: %s); metrics.jsonl and TensorBoard go on", settings.project,
                    type(e).__name__, _first_line(e))
    return None
  where = run.url if settings.mode == "online" else f"{settings.mode}, {run.dir}"
  print(f"wandb: run {run.id} ({where})", flush=True)
  return WandbRun(run)
