"""The trainer's side of split devices (`rollout.devices` > 0, `rollout/placement.py`) and of the phase metrics.

`meshes` cuts the run's devices into the trainer's mesh and the rollout's (None: shared, as without a split);
`make_rollout` builds the run's rollout on the rollout's mesh (`placement.SplitRollout`, whose weights are pushed
device to device) or, shared, the trainer's in-process engine as before. `phase_metrics` is each step's row of
wall times and overlap:

- `timing/rollout_wall_s`: the rollout that made this step's responses, from its start to its last response, on
  whichever thread ran it (one_step_off: the background one, started during the previous step);
- `timing/update_wall_s`: this step's update (from the scored responses to the new weights and metrics on the
  host: `stages.Clock`'s "update" lap, which blocks on them);
- `timing/overlap_s`: the seconds this step's rollout ran while the previous step's update did, and
  `timing/overlap_fraction` those seconds over the shorter of the two (0 for a rollout run in the step itself);
- with split devices, the weight pushes since the last row (`placement.PushStats`: `weights/pushes`,
  `weights/push_bytes`, `weights/push_s`).
"""

from __future__ import annotations

from typing import Any

import jax

from pacs_jax import sharding
from pacs_jax.rollout import placement
from pacs_jax.trainer import programs as programs_lib


def meshes(cfg, devices) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
  """(the trainer's mesh, the rollout's or None): the trainer's laid out by `cfg.mesh` on its devices."""
  trainer_devices, rollout_devices = placement.split_devices(devices, cfg.rollout.devices)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=trainer_devices)
  if not rollout_devices:
    return mesh, None
  return mesh, placement.rollout_mesh(rollout_devices, dict(mesh.shape)["tensor"])


def make_rollout(cfg, model, mesh, rollout_mesh, eos_ids):
  """The run's rollout: on `rollout_mesh` fed by pushes from `mesh`, or (None) on `mesh` itself."""
  if rollout_mesh is None:
    return programs_lib.make_rollout(cfg, model, mesh, eos_ids)
  return placement.SplitRollout(programs_lib.make_rollout(cfg, model, rollout_mesh, eos_ids), mesh)


def make_worker(sampler):
  """The overlapped modes' background rollout (one_step_off, async): a fork of `sampler` whose `generate` calls are
  timed."""
  return placement.Timed(sampler.fork())


def phase_metrics(trainer, clock) -> dict[str, Any]:
  """This step's wall times, overlap and pushes (the module docstring); {} for a sync run on shared devices."""
  out = trainer.sampler.stats.take() if isinstance(trainer.sampler, placement.SplitRollout) else {}
  worker = trainer.rollout_worker
  if worker is None and not out:
    return out
  update = (clock.laps["score"], clock.laps["update"])
  rollout = (clock.start, clock.laps["rollout"])  # run in the step itself
  if worker is not None:
    finished = [iv for iv in worker.intervals if iv[1] <= clock.laps["rollout"]]
    worker.intervals[:] = [iv for iv in worker.intervals if iv[1] > clock.laps["rollout"]]
    if finished:  # started during the previous step, taken by this one
      rollout = finished[-1]
  previous = worker.updates[-1] if worker is not None and worker.updates else None
  shared = placement.overlap(rollout, previous) if previous else 0.0
  shorter = min(rollout[1] - rollout[0], previous[1] - previous[0]) if previous else 1.0
  if worker is not None:
    worker.updates[:] = [update]
  out.update({"timing/rollout_wall_s": rollout[1] - rollout[0], "timing/update_wall_s": update[1] - update[0],
              "timing/overlap_s": shared, "timing/overlap_fraction": shared / max(shorter, 1e-9)})
  return out
