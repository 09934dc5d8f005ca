"""SIGTERM (TPU preemption) and Ctrl-C (SIGINT) handling: the loop finishes its step, saves a checkpoint and exits
cleanly; a second Ctrl-C exits at once (as a kill would: the next start resumes from the last checkpoint)."""

from __future__ import annotations

import os
import signal
import sys

from absl import logging

from pacs_jax.services import multihost

EXIT_SECOND_INTERRUPT = 128 + signal.SIGINT  # a shell's status for a program ended by Ctrl-C


class Preemption:
  """Installs SIGTERM and SIGINT handlers that set a flag (until `restore`)."""

  def __init__(self):
    self.requested: signal.Signals | None = None
    self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

  def _handle(self, signum, frame):
    if signum == signal.SIGINT and self.requested is not None:
      sys.stderr.write("second Ctrl-C: exiting now, without saving this step (a rerun resumes from the last "
                       "checkpoint)\n")
      sys.stderr.flush()
      os._exit(EXIT_SECOND_INTERRUPT)  # at once: no cleanup waits (a kill's state, which a restart handles)
    self.requested = signal.Signals(signum)
    again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
    logging.warning("%s received: finishing this step, then saving a checkpoint and exiting%s", self.requested.name,
                    again)

  def describe(self) -> str:
    """How the stop is reported: `preempted` (SIGTERM, or a signal seen on another process) or `interrupted`."""
    return "interrupted" if self.requested == signal.SIGINT else "preempted"

  def agreed(self, lost_lock: bool = False) -> tuple[bool, bool]:
    """(stop, lost_lock), each true if it is on any process. Every process calls this once per step, at
    the same point: a signal that reaches the hosts in different steps must still stop them all after the
    same step, or one would wait in a collective (checkpoint save, allgather) the others never enter.
    `lost_lock`: process 0 found another trainer holding the workdir (all must stop, without saving)."""
    stop, lost = multihost.any_process([self.requested is not None, lost_lock])
    return stop, lost

  def restore(self):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
