"""SIGTERM (TPU preemption) handling: the loop finishes its step, saves a checkpoint and exits cleanly."""

from __future__ import annotations

import signal

from absl import logging

from pacs_jax.trainer import multihost


class Preemption:
  """Installs a SIGTERM handler that sets a flag (until `restore`)."""

  def __init__(self):
    self.requested = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: finishing this step, then saving a checkpoint and exiting")
    self.requested = True

  def agreed(self, lost_lock: bool = False) -> tuple[bool, bool]:
    """(stop, lost_lock), each true if it is on any process. Every process calls this once per step, at
    the same point: a signal that reaches the hosts in different steps must still stop them all after the
    same step, or one would wait in a collective (checkpoint save, allgather) the others never enter.
    `lost_lock`: process 0 found another trainer holding the workdir (all must stop, without saving)."""
    stop, lost = multihost.any_process([self.requested, lost_lock])
    return stop, lost

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)
