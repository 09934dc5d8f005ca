"""The reward worker pool: `RewardScorer` scores responses with a reward function (the config's `reward.fn`) in
worker processes, each item under a timeout (errors and timeouts score 0.0; a hung or dead worker is replaced)."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import time
from typing import Callable, Sequence

import numpy as np

from pacs_jax.rewards import named

logger = logging.getLogger(__name__)


def _nowhere(data_source: str) -> bool:
  """No item is scored in the calling process: a reward without an `in_process` attribute runs in the workers."""
  return False


def checked_call(score_fn: Callable, args: tuple[str, str, str]) -> tuple[float, str | None]:
  """`score_fn(*args)` as (score, error or None): a reward returns a score, or a (score, error or None) pair; an
  exception, or a score that is no number, scores 0.0 with its message as the error."""
  try:
    result = score_fn(*args)
    value, error = result if isinstance(result, tuple) else (result, None)
    return float(value), error
  except Exception as e:  # noqa: BLE001 -- a reward's failure is a 0.0, counted
    return 0.0, f"{type(e).__name__}: {e}"[:500]


def _worker_main(conn, score_fn):
  # Ctrl-C goes to the whole process group; the parent decides when workers stop.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # the built-in's parser warnings (no-op for others)
  for args in getattr(score_fn, "warm_up", ()):
    checked_call(score_fn, args)
  conn.send("ready")
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message is None:
      return
    item, args = message
    conn.send((item, *checked_call(score_fn, args)))


class _Worker:
  def __init__(self, context, score_fn):
    self.conn, child_conn = context.Pipe(duplex=True)
    self.process = context.Process(target=_worker_main, args=(child_conn, score_fn), daemon=True)
    self.process.start()
    child_conn.close()
    self.ready = False
    self.item: int | None = None
    self.deadline = 0.0

  def kill(self):
    if self.process.is_alive():
      self.process.kill()
    self.process.join(timeout=5)
    self.conn.close()


class RewardScorer:
  """Scores batches in `num_workers` processes with a per-item timeout.

    with RewardScorer(num_workers=2, timeout_s=10) as scorer:
      scores, stats = scorer.score_batch(responses, answers, data_sources)

  scores: float32 [B] (one per response); stats: {"errors", "timeouts"} counts for that batch (`totals` keeps the
  run's sums). `score_fn(data_source, response, answer)` (or its name, "package.module:function": rewards/named.py)
  returns a score or a (score, error | None) pair (`checked_call`); it must be picklable (a module-level function
  is, by reference). Its `in_process(data_source)` attribute, where it has one, picks the items scored in this
  process (the built-in's synthetic tasks: cheap and trusted); its `preload`, modules its workers' server imports
  besides its own (the built-in's: math-verify and sympy, which it imports on first use); its `warm_up` attribute,
  the argument tuples each new worker scores first. The pool starts on the first item that needs it. An item that
  runs past `timeout_s` scores 0.0 and its worker is killed and replaced; a worker that dies scores its item 0.0 (an
  error) likewise.
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, *, mp_context: str = "forkserver",
               score_fn: Callable[[str, str, str], float | tuple[float, str | None]] | str = named.BUILTIN):
    if num_workers <= 0 or timeout_s <= 0:
      raise ValueError(f"num_workers ({num_workers}) and timeout_s ({timeout_s}) must be positive")
    self.num_workers, self.timeout_s = num_workers, timeout_s
    self._score_fn = named.resolve(score_fn) if isinstance(score_fn, str) else score_fn
    self._in_process = getattr(self._score_fn, "in_process", None) or _nowhere
    self._context = multiprocessing.get_context(mp_context)
    module = getattr(self._score_fn, "__module__", None)
    if mp_context == "forkserver" and module:
      # Workers fork from a server that has the reward's module (the built-in's: math-verify, sympy) imported: a
      # replacement starts in milliseconds. Only applies when this process has not started its forkserver yet.
      self._context.set_forkserver_preload([module, *getattr(self._score_fn, "preload", ())])
    self._workers: list[_Worker] = []
    self._failed_starts = 0
    self.totals = {"errors": 0, "timeouts": 0, "replaced_workers": 0, "scored": 0}

  def __enter__(self) -> "RewardScorer":
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # noqa: BLE001 -- interpreter shutdown
      pass

  def start(self, wait_s: float = 120.0):
    """Starts the workers now (otherwise on the first item that needs them) and waits until all are
    ready; raises RuntimeError if that takes longer than `wait_s`."""
    self._spawn_missing()
    self._failed_starts = 0
    deadline = time.monotonic() + wait_s
    while not all(w.ready for w in self._workers):
      starting = [w for w in self._workers if not w.ready]
      timeout = deadline - time.monotonic()
      if timeout <= 0:
        raise RuntimeError(f"{len(starting)} reward workers were not ready after {wait_s:.0f} s")
      readable = multiprocessing.connection.wait([w.conn for w in starting], timeout=timeout)
      for worker in starting:
        if worker.conn in readable:
          self._receive_ready(worker)

  def _spawn_missing(self):
    while len(self._workers) < self.num_workers:
      self._workers.append(_Worker(self._context, self._score_fn))

  def _receive_ready(self, worker: _Worker):
    try:
      message = worker.conn.recv()
    except (EOFError, OSError):  # died during start-up
      self._replace(worker)
      return
    if message != "ready":
      raise RuntimeError(f"reward worker sent {message!r} before it was ready")
    worker.ready = True

  def close(self):
    for worker in self._workers:
      try:
        worker.conn.send(None)
      except (OSError, ValueError):
        pass
    for worker in self._workers:
      worker.process.join(timeout=1)
      worker.kill()
    self._workers = []

  def worker_pids(self) -> list[int]:
    return [w.process.pid for w in self._workers]

  def _replace(self, worker: _Worker):
    if not worker.ready:
      self._failed_starts += 1
      if self._failed_starts > 3 * self.num_workers:
        raise RuntimeError(f"reward workers keep dying at start-up ({self._failed_starts} so far); "
                           "call the reward function in this process to see the error")
    worker.kill()
    self._workers[self._workers.index(worker)] = _Worker(self._context, self._score_fn)
    self.totals["replaced_workers"] += 1

  def score_batch(self, responses: Sequence[str], answers: Sequence[str],
                  data_sources: Sequence[str]) -> tuple[np.ndarray, dict[str, int]]:
    if not len(responses) == len(answers) == len(data_sources):
      raise ValueError(f"lengths differ: {len(responses)} responses, {len(answers)} answers, "
                       f"{len(data_sources)} data sources")
    scores = np.zeros(len(responses), dtype=np.float32)
    stats = {"errors": 0, "timeouts": 0}
    pending = []
    for i, args in enumerate(zip(data_sources, responses, answers)):
      if self._in_process(args[0]):
        scores[i], error = checked_call(self._score_fn, args)
        stats["errors"] += error is not None
      else:
        pending.append(i)
    if pending:
      self._run_pool(pending, responses, answers, data_sources, scores, stats)
    for key, value in stats.items():
      self.totals[key] += value
    self.totals["scored"] += len(responses)
    return scores, stats

  def _run_pool(self, pending, responses, answers, data_sources, scores, stats):
    self._spawn_missing()
    self._failed_starts = 0
    pending = list(reversed(pending))  # pop() from the end keeps the batch order
    busy = 0
    while pending or busy:
      for worker in list(self._workers):
        if worker.ready and worker.item is None and pending:
          if not worker.process.is_alive():  # died while idle: replace, nothing lost
            self._replace(worker)
            continue
          item = pending.pop()
          try:
            worker.conn.send((item, (data_sources[item], responses[item], answers[item])))
          except (OSError, ValueError):
            pending.append(item)
            self._replace(worker)
            continue
          worker.item, worker.deadline = item, time.monotonic() + self.timeout_s
          busy += 1
      waiting = [w for w in self._workers if w.item is not None or not w.ready]
      deadlines = [w.deadline for w in waiting if w.item is not None]
      timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else self.timeout_s
      ready = multiprocessing.connection.wait([w.conn for w in waiting], timeout=timeout)
      for worker in [w for w in waiting if w.conn in ready]:
        try:
          message = worker.conn.recv()
        except (EOFError, OSError):  # the worker died
          if worker.item is not None:
            logger.warning("reward worker %d died while scoring item %d; it scores 0.0",
                           worker.process.pid, worker.item)
            stats["errors"] += 1
            busy -= 1
          self._replace(worker)
          continue
        if message == "ready":
          worker.ready = True
          continue
        item, value, error = message
        scores[item] = value
        if error is not None:
          stats["errors"] += 1
          logger.debug("reward item %d scored 0.0 after an error: %s", item, error)
        worker.item = None
        busy -= 1
      now = time.monotonic()
      for worker in list(self._workers):
        if worker.item is not None and now >= worker.deadline:
          logger.warning("reward item %d timed out after %.1f s; it scores 0.0 and its worker is replaced",
                         worker.item, self.timeout_s)
          stats["timeouts"] += 1
          busy -= 1
          self._replace(worker)
        elif not worker.ready and not worker.process.is_alive():
          self._replace(worker)  # died during start-up
