"""How a run lets go of what it holds (checkpointer, metrics writer, SIGTERM handler, workdir lock), in one place:
after a storage outage, nothing that would only retry against the unreachable store."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from pacs_jax import paths
from pacs_jax.services import metrics as metrics_lib
from pacs_jax.services import preemption as preemption_lib
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.storage import lock as lock_lib


@dataclasses.dataclass
class Held:
  """What a run holds; `run()` fills in the writer and the SIGTERM handler as it creates them."""
  workdir: str
  checkpointer: checkpoint_lib.Checkpointer
  lock: lock_lib.WorkdirLock
  writer: metrics_lib.MetricsWriter | None = None
  preemption: preemption_lib.Preemption | None = None
  # The step in progress once the loop has begun: a failure from then on may be a storage outage. Before, it is
  # the start's own (a refused resume, an unreadable checkpoint) and everything closes as usual.
  step_in_progress: int | None = None


@contextlib.contextmanager
def closing(held: Held) -> Iterator[Held]:
  """Closes everything `held` holds on the way out. A failure of the loop while the workdir's store does not
  answer is raised as paths.StorageUnreachable (from the failure), whatever the client's error said."""
  failure = None
  try:
    yield held
  except BaseException as e:
    outage = None
    if held.step_in_progress is not None and isinstance(e, Exception):
      outage = checkpoint_lib.storage_outage(held.workdir, held.step_in_progress, held.checkpointer)
    if outage is None:
      failure = e if held.step_in_progress is not None else None
      raise
    failure = outage
    raise outage from e
  finally:
    release(held, failure)


def release(held: Held, failure: BaseException | None) -> None:
  """With the store down, what is left to write (a save in flight, the last TensorBoard events, the lock's
  release) would only retry against it: left as a kill leaves them, which a restart handles."""
  unreachable = isinstance(failure, paths.StorageUnreachable)
  try:
    if isinstance(failure, OSError):  # a full disk, an unreachable store: a save in flight cannot finish
      held.checkpointer.abandon()  # (waiting would retry for minutes; a restart resumes from the last one)
    else:
      held.checkpointer.close()
  finally:
    if held.writer is not None and not unreachable:
      held.writer.close()
    if held.preemption is not None:
      held.preemption.restore()
    if unreachable:
      held.lock.abandon()
    else:
      held.lock.release()
