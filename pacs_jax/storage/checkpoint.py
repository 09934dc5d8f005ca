"""Orbax checkpoints of the whole training state: params, optimizer, step, RNG, data-iterator state, config.

Saves are asynchronous and keep the last K (or all, as the released runs). A step counts only once Orbax has committed it (locally: written
under a temporary name and renamed; on Cloud Storage: a `commit_success.txt` written last), so a process
killed mid-write leaves no step. A committed step can still be damaged (a truncated file, a lost item, an
empty step folder): `restore_newest` then falls back to the next older step and moves the damaged ones to
`checkpoints_set_aside/` (kept for inspection, out of Orbax's way).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from typing import Any, Callable, TypeVar

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.serialization import tensorstore_utils

from pacs_jax import paths
from pacs_jax.storage import orbax_errors
from pacs_jax.storage.workdir import SET_ASIDE_DIR

T = TypeVar("T")


class NoRestorableCheckpoint(RuntimeError):
  """Checkpoints exist but none could be restored; the message lists each step and why."""


class CheckpointMismatch(RuntimeError):
  """The checkpoint belongs to another run (algorithm, model shape, tokenizer, objective): not restored."""


RECORD_ITEM = "record"  # what gives the state its meaning (storage/resume.py); absent in older checkpoints
# An overlapped run's rollouts in flight at the save (trainer/overlap.py): each one's policy version and seed, in the
# order started (JSON), and the rollout weights of each version (a tree keyed by version); absent where none was.
IN_FLIGHT_ITEM, IN_FLIGHT_WEIGHTS_ITEM = "in_flight", "in_flight_weights"


def _with_storage_retries(get_ts_context: Callable[..., ts.Context]) -> Callable[..., ts.Context]:
  """Orbax's tensorstore context with paths.STORAGE_RETRIES for Cloud Storage requests (tensorstore's default,
  32 attempts up to 32 s apart, would keep a save retrying for a quarter of an hour into an outage)."""
  retries = paths.STORAGE_RETRIES
  spec = ts.Context.Spec({"gcs_request_retries": {"max_retries": retries.attempts,
                                                  "initial_delay": f"{retries.first_delay_s}s",
                                                  "max_delay": f"{retries.max_delay_s}s"}})

  @functools.wraps(get_ts_context)
  def with_retries(*args, **kwargs) -> ts.Context:
    return ts.Context(spec, parent=get_ts_context(*args, **kwargs))

  with_retries.storage_retries = retries
  return with_retries


# Orbax builds every tensorstore context it reads or writes with through this one function, and takes no context
# from its caller (orbax-checkpoint 0.12): wrapped once, for all of them.
if not hasattr(tensorstore_utils.get_ts_context, "storage_retries"):
  tensorstore_utils.get_ts_context = _with_storage_retries(tensorstore_utils.get_ts_context)


# How long a failed Orbax operation's other reads and writes may take to finish before their tasks are cancelled
# (each is one tensorstore request, retried at most paths.STORAGE_RETRIES: about 15 s).
DRAIN_TIMEOUT_S = 60.0


def _run_sync_draining(coro):
  """Orbax's `asyncio_utils._run_sync_via_new_loop` (every synchronous read and write of a checkpoint runs its
  coroutine through it), which also waits for the coroutine's other tasks before it closes its event loop.

  When one array of a restore or save fails, `asyncio.gather` raises at once while the other arrays' tensorstore
  reads are still in flight; Orbax closed the loop under them, and each of their completions then called into
  the closed loop from tensorstore's threads: hundreds of lines of `RuntimeError: Event loop is closed`, and at
  exit "Exception ignored in <coroutine ...>" for the tasks left pending."""
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)
  finally:
    try:
      _finish_tasks(loop)
    finally:
      asyncio.set_event_loop(None)
      loop.close()


def _finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
  """Runs `loop` until its tasks are done (their outcome dropped: the first failure is already raised); those
  still running after DRAIN_TIMEOUT_S are cancelled and awaited."""
  pending = asyncio.all_tasks(loop)
  if not pending:
    return
  _, late = loop.run_until_complete(asyncio.wait(pending, timeout=DRAIN_TIMEOUT_S))
  for task in late:
    task.cancel()
  if late:
    loop.run_until_complete(asyncio.wait(late))
  for task in pending:  # retrieved, so that no "exception was never retrieved" is logged for them
    if not task.cancelled():
      task.exception()


# An older orbax-checkpoint (0.12.4, the one beside jax 0.11.2 on the GPU machine) has no such function: its
# run_sync goes through asyncio.run, whose teardown cancels and awaits the tasks left over.
if getattr(asyncio_utils, "_run_sync_via_new_loop", _run_sync_draining) is not _run_sync_draining:  # pylint: disable=protected-access
  asyncio_utils._run_sync_via_new_loop = _run_sync_draining  # pylint: disable=protected-access


@dataclasses.dataclass(frozen=True)
class Failure:
  step: int
  cause: str


class Checkpointer:
  def __init__(self, directory: str, keep: int = 3, async_save: bool = True, read_only: bool = False):
    """`keep`: the newest `keep` checkpoints stay; 0 keeps every one (Orbax max_to_keep=None, as verl's
    trainer.max_actor_ckpt_to_keep: null in the released runs). `read_only`: for export/evaluate; creates nothing
    and never deletes a trainer's unfinished saves."""
    self.directory = paths.normalize(directory)
    self.read_only = read_only
    self.async_save = async_save and not read_only
    if read_only:  # (Orbax's own read_only option does the same, plus a warning on every open)
      options = ocp.CheckpointManagerOptions(create=False, cleanup_tmp_directories=False, max_to_keep=None,
                                             enable_async_checkpointing=False)
    else:
      options = ocp.CheckpointManagerOptions(max_to_keep=keep or None, enable_async_checkpointing=async_save,
                                             create=True, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "config", RECORD_ITEM, IN_FLIGHT_ITEM,
                                                     IN_FLIGHT_WEIGHTS_ITEM))
    self.failed_save: str | None = None  # the first failed async save, as one line
    self._pending_step: int | None = None  # the last save started
    self._complete_step: int | None = None  # the newest step known committed (restored, or saved in this run)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    """Committed steps, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def save(self, step: int, state: Any, data_state: dict, config: ml_collections.ConfigDict,
           force: bool = True, record: dict | None = None, in_flight: tuple[list[dict], dict] | None = None) -> None:
    """Starts an (async) save of `state` (a pytree of arrays) with the data iterator's JSON state; raises
    paths.StorageError if this save, or an earlier one still finishing, fails. `in_flight`: the rollouts in flight
    ([{"version", "seed"}, ...], {str(version): rollout weights}), saved where there are any."""
    if self.read_only:
      raise ValueError(f"{self.directory} was opened read-only")
    items = dict(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                 config=ocp.args.JsonSave(json.loads(config.to_json_best_effort())))
    if record is not None:
      items[RECORD_ITEM] = ocp.args.JsonSave(record)
    if in_flight and in_flight[0]:
      items[IN_FLIGHT_ITEM] = ocp.args.JsonSave(in_flight[0])
      items[IN_FLIGHT_WEIGHTS_ITEM] = ocp.args.PyTreeSave(in_flight[1])
    self._finish_pending()  # (Orbax's save waits for the previous one too): its failure named as its own
    self._pending_step = step
    with self._storage_errors(step):
      self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    if not self.async_save:  # committed once save() returns
      self._complete_step = step

  def _finish_pending(self) -> None:
    """Waits for the save in flight; raises paths.StorageError if it failed."""
    with self._storage_errors(self._pending_step):
      self.manager.wait_until_finished()
    self._complete_step = self._pending_step if self._pending_step is not None else self._complete_step

  def poll_failure(self) -> str | None:
    """The failure of an async save as one line naming the step, path and cause, or None (it does not wait for
    a save in flight)."""
    if not self.failed_save and not self.manager.is_saving_in_progress():
      # Orbax's finalize thread takes the error of a failed write (check_for_errors raises it once): waiting for
      # the finished thread is what reports it.
      with contextlib.suppress(paths.StorageError):
        self._finish_pending()
    return self.failed_save

  def last_complete_step(self) -> int | None:
    """The newest step known committed: restored, or saved by this run; it does not wait for a save in flight."""
    self.poll_failure()
    return self._complete_step

  @contextlib.contextmanager
  def _storage_errors(self, step: int | None):
    if self.failed_save:
      raise paths.StorageError(self.failed_save)
    try:
      yield
    except Exception as e:  # noqa: BLE001 (tensorstore, OS, HTTP client errors: any means the save is lost)
      self.failed_save = (f"saving checkpoint step {step} to {paths.join(self.directory, str(step))} failed: "
                          f"{orbax_errors.describe(e)}")
      if step is not None and not paths.is_remote(self.directory) and jax.process_count() == 1:
        for name in paths.listdir(self.directory):  # its unfinished folder (on a full disk, the space it holds)
          if name.startswith(f"{step}.orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      raise paths.StorageError(self.failed_save) from e

  def read_record(self, step: int) -> dict | None:
    """The step's resume record, or None for a checkpoint saved before records existed."""
    if not paths.exists(paths.join(self.directory, str(step), RECORD_ITEM)):
      return None
    return self.manager.restore(step, args=ocp.args.Composite(**{RECORD_ITEM: ocp.args.JsonRestore()}))[RECORD_ITEM]

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores into the shardings/dtypes of `abstract_state` (a tree of jax.ShapeDtypeStruct with shardings)."""
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=_restore_args(abstract_state), data=ocp.args.JsonRestore()))
    except ValueError as e:
      differs = orbax_errors.structure_difference(str(e))
      if differs is None:
        raise
      raise CheckpointMismatch(
          f"{paths.join(self.directory, str(step))}: holds another training state than this run's ({differs}), "
          "e.g. of an algorithm with other parts (a critic): use another --workdir, or "
          "--config.checkpoint.restore=never to start from scratch here") from e
    return restored["state"], restored["data"]

  def restore_in_flight(self, step: int, abstract_weights: Any) -> tuple[list[dict], dict] | None:
    """The rollouts in flight at `step`'s save (`save`'s `in_flight`), their weights restored into the layout of
    `abstract_weights` (one version's); None where none were saved."""
    if not paths.exists(paths.join(self.directory, str(step), IN_FLIGHT_ITEM)):
      return None
    rollouts = self.manager.restore(step, args=ocp.args.Composite(
        **{IN_FLIGHT_ITEM: ocp.args.JsonRestore()}))[IN_FLIGHT_ITEM]
    abstract = {str(version): abstract_weights for version in sorted({r["version"] for r in rollouts})}
    weights = self.manager.restore(step, args=ocp.args.Composite(
        **{IN_FLIGHT_WEIGHTS_ITEM: _restore_args(abstract)}))[IN_FLIGHT_WEIGHTS_ITEM]
    return rollouts, weights

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the policy parameters (e.g. for export): the optimizer state is never read."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=_restore_args({"params": abstract_params}, partial=True)))
    return restored["state"]["params"]

  def restore_config(self, step: int) -> dict:
    config = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    if not isinstance(config, dict):
      raise ValueError(f"the saved config is a {type(config).__name__}, not a JSON object")
    return config

  def restore_newest(self, restore_fn: Callable[[int], T]) -> tuple[int, T] | None:
    """`restore_fn(step)` on the newest committed step, falling back to older ones while it raises.

    Returns (step, result), or None when there is no checkpoint at all. A damaged step is named in one warning
    line with its cause once an older one restored, and moved to `checkpoints_set_aside/` (a later save of the
    same step number would collide with it; a read-only Checkpointer moves nothing). Raises NoRestorableCheckpoint
    when every step fails: training from scratch beside checkpoints would silently discard them.
    """
    failures = []
    for step in self.all_steps():
      try:
        result = restore_fn(step)
        ok = True
      except CheckpointMismatch:
        raise  # another run's checkpoint, not a damaged one: an older step would not be this run's either
      except Exception as e:  # noqa: BLE001 (damage shows as tensorstore, JSON, KeyError, OS errors ...)
        failures.append(Failure(step, orbax_errors.describe(e)))
        ok = False
      if not _all_processes(ok):
        if ok:
          failures.append(Failure(step, "another process could not restore it"))
        continue
      for failure in failures:
        logging.warning("checkpoint step %d cannot be restored (%s); restored step %d instead", failure.step,
                        failure.cause, step)
      if failures and not self.read_only:
        self._set_aside([f.step for f in failures], "damaged")
      self._complete_step = step
      return step, result
    if not failures:
      return None
    newest = failures[0]  # one line however many: how many, the newest's cause (each one's in the traceback's notes)
    tried = (f"{len(failures)} steps; the newest, step {newest.step}: {newest.cause}" if len(failures) > 1 else
             f"step {newest.step}: {newest.cause}")
    hint = ("repair or move the damaged steps, or choose another workdir" if self.read_only else  # export, evaluate
            "repair or move them, or pass --config.checkpoint.restore=never to start from scratch (the existing "
            f"checkpoints are then moved to {SET_ASIDE_DIR}/)")
    error = NoRestorableCheckpoint(f"no checkpoint in {self.directory} can be restored ({tried}); {hint}")
    for failure in failures:
      error.add_note(f"step {failure.step}: {failure.cause}")
    raise error

  def set_aside_all(self) -> list[int]:
    """Moves every committed step to `checkpoints_set_aside/` (a fresh start in a used workdir)."""
    steps = self.all_steps()
    if steps:
      self._set_aside(steps, "discarded")
    return steps

  def _set_aside(self, steps: list[int], why: str) -> None:
    if jax.process_index() == 0:
      aside = paths.join(paths.parent(self.directory), SET_ASIDE_DIR)
      stamp = time.strftime("%Y%m%d-%H%M%S")
      for step in steps:
        src = paths.join(self.directory, str(step))
        dst = paths.join(aside, f"{step}.{why}-{stamp}")
        paths.rename(src, dst)
        logging.warning("moved checkpoint step %d to %s", step, dst)
    _barrier("pacs_jax_checkpoint_set_aside")
    self.manager.reload()

  def abandon(self) -> None:
    """Lets go without waiting for a save in flight (after a storage failure): like a kill, it leaves at most an
    uncommitted step, which the next run's Orbax deletes."""
    self.failed_save = self.failed_save or "abandoned"

  def close(self) -> None:
    """Waits for a save in flight; raises paths.StorageError if it failed (once: a failure already reported
    is not raised again)."""
    try:
      if not self.failed_save:
        self._finish_pending()
    finally:
      try:
        self.manager.close()
      except Exception:  # noqa: BLE001 (closing after a failed save re-raises its error)
        if not self.failed_save:
          raise


def storage_outage(workdir: str, step: int, checkpointer: Checkpointer) -> paths.StorageUnreachable | None:
  """The outage a failure at `step` is when the workdir's object store does not answer (whatever the failure itself
  says: the clients' errors in an outage are often side effects, a missing directory or a closed handle), else
  None."""
  cause = paths.unreachable(workdir)
  if cause is None:
    return None
  complete = checkpointer.last_complete_step()
  then = ("no checkpoint is complete yet; rerun the same command to start again" if complete is None else
          f"the last complete checkpoint is step {complete}; rerun the same command to resume")
  return paths.StorageUnreachable(f"{workdir}: storage unreachable ({cause}) at step {step}; {then}")


def _all_processes(ok: bool) -> bool:
  """Whether `ok` holds on every process (restores are collective: all use the same step)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.asarray(multihost_utils.process_allgather(np.array([ok], np.int32))).all())


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _restore_args(abstract: Any, partial: bool = False) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                                partial_restore=partial)


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a concrete pytree, for restoring into the same layout."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
