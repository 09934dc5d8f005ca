"""Orbax checkpoints of the whole training state: params, optimizer, step, RNG, data-iterator state, config.

Saves are asynchronous and keep the last K (or all, as the released runs); Orbax commits a step atomically (written under a temporary
name, renamed when complete), so a process killed mid-write resumes from the last complete step.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    """`keep`: the newest `keep` checkpoints stay; 0 keeps every one (Orbax max_to_keep=None, as verl's
    trainer.max_actor_ckpt_to_keep: null in the released runs)."""
    self.directory = os.path.abspath(directory) if "://" not in directory else directory
    options = ocp.CheckpointManagerOptions(max_to_keep=keep or None, enable_async_checkpointing=async_save,
                                           create=True, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict, config: ml_collections.ConfigDict,
           force: bool = True) -> None:
    """Starts an (async) save of `state` (a pytree of arrays) with the data iterator's JSON state."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(json.loads(config.to_json_best_effort()))), force=force)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores into the shardings/dtypes of `abstract_state` (a tree of jax.ShapeDtypeStruct with shardings)."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=_restore_args(abstract_state), data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the policy parameters (e.g. for export): the optimizer state is never read."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=_restore_args({"params": abstract_params}, partial=True)))
    return restored["state"]["params"]

  def restore_config(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _restore_args(abstract: Any, partial: bool = False) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                                partial_restore=partial)


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a concrete pytree, for restoring into the same layout."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
