"""Verifiable rewards: math-verify scoring with the released semantics, run in worker processes with
a per-item timeout (errors and timeouts score 0.0; a hung or dead worker is replaced).
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import signal
import time
from typing import Callable, Sequence

import numpy as np
import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from pacs_jax.rewards import synthetic

logger = logging.getLogger(__name__)

_GOLD_TARGETS = (LatexExtractionConfig(),)
_PRED_TARGETS = (ExprExtractionConfig(), LatexExtractionConfig())


class _TimeoutDisabledFilter(logging.Filter):
  """Drops math-verify's "Timeout is disabled" warning: timeouts are enforced here, by RewardScorer."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).addFilter(_TimeoutDisabledFilter())


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str) -> tuple:
  """The gold answer's extractions, parsed once per answer (a prompt's n responses share it)."""
  return tuple(parse("\\boxed{" + ground_truth + "}", _GOLD_TARGETS, parsing_timeout=None))


@functools.lru_cache(maxsize=4096)
def _value_at_a_point(expr: sympy.Expr) -> sympy.Expr | None:
  """`expr` with each free symbol replaced by a fixed rational (distinct, non-integer), or None if it is no number
  then (a pole, a function left unevaluated with a symbol)."""
  point = {s: sympy.Rational(1009 + 37 * i, 113 + 7 * i) for i, s in enumerate(sorted(expr.free_symbols, key=str))}
  value = expr.subs(point)
  return value if value.is_number and not value.free_symbols else None


def _cannot_be_equal(gold, pred) -> bool:
  """True when math-verify's comparison of this pair (`sympy_expr_eq`) can only say no, without running it: one is
  an exact number, the other an expression of free symbols (no relation, set, lone symbol or matrix: e.g. a word
  in the answer, parsed as a product of its letters) whose value at a rational point provably differs from it. Then
  gold - pred is not identically 0, so neither the structural, numeric nor symbolic (`simplify`: 0.1-3 s a pair)
  test can succeed. False means: ask math-verify."""
  for number, expr in ((gold, pred), (pred, gold)):
    if (isinstance(number, sympy.Number) and not isinstance(number, sympy.Float) and isinstance(expr, sympy.Expr)
        and not isinstance(expr, (sympy.Symbol, sympy.MatrixExpr)) and expr.free_symbols and not expr.has(sympy.Float)):
      value = _value_at_a_point(expr)
      return value is not None and (value - number).is_zero is False  # (None: sympy cannot tell)
  return False


def verify_pairs(gold, pred) -> bool:
  """math-verify's `verify(gold, pred)` at 6 decimals (true if any gold extraction equals any predicted one), each
  pair compared as `verify` does, but pairs that `_cannot_be_equal` skipped."""
  return any(not _cannot_be_equal(g, p) and verify(g, p, float_rounding=6, timeout_seconds=None)
             for g, p in itertools.product(gold, pred))


def checked_score(solution_str: str, ground_truth: str) -> tuple[float, str | None]:
  """(score, error message or None); `compute_score` with its errors reported instead of hidden."""
  try:
    if not isinstance(solution_str, str) or not isinstance(ground_truth, str):
      raise TypeError(f"expected str, got {type(solution_str).__name__} and {type(ground_truth).__name__}")
    # math-verify's own timeouts use signal.alarm (main thread only, whole seconds); they are off
    # here and RewardScorer enforces the timeout by killing the worker instead.
    gold = _parse_gold(ground_truth)
    if not gold:  # math_metric raises here, which the released compute_score turns into 0.0
      return 0.0, f"no gold answer could be parsed from {ground_truth!r:.100}"
    pred = parse(solution_str, _PRED_TARGETS, parsing_timeout=None)
    return (1.0 if verify_pairs(gold, pred) else 0.0), None
  except Exception as e:  # noqa: BLE001 -- any parser failure scores 0.0, as released
    return 0.0, f"{type(e).__name__}: {e}"[:500]


def compute_score(solution_str: str, ground_truth: str) -> float:
  """1.0 when the response verifies equal to `\\boxed{ground_truth}`, else 0.0 (errors too).

  The released semantics (verl `reward_score/math_verify.py`, math_metric): gold parsed with LaTeX
  extraction, the response with expression + LaTeX extraction, `verify` at 6 decimals. It has no
  timeout of its own: score untrusted text through `RewardScorer`.
  """
  return checked_score(solution_str, ground_truth)[0]


def checked_score_for(data_source: str, solution_str: str, ground_truth: str) -> tuple[float, str | None]:
  """Dispatch by data source: built-in synthetic tasks use their own verifier, all else math-verify."""
  if synthetic.is_synthetic(data_source):
    try:
      return synthetic.compute_score(data_source, solution_str, ground_truth), None
    except Exception as e:  # noqa: BLE001
      return 0.0, f"{type(e).__name__}: {e}"[:500]
  return checked_score(solution_str, ground_truth)


def score(data_source: str, solution_str: str, ground_truth: str) -> float:
  """`compute_score` dispatched by data source (verl's `default_compute_score` role)."""
  return checked_score_for(data_source, solution_str, ground_truth)[0]


# ----------------------------------------------------------------------------------------------
# Worker pool


# Parsed once in each new worker before it takes items, so that first-use set-up of the parsers
# (~0.1 s per kind of expression) does not count against an item's timeout.
_WARM_UP = [("\\boxed{\\frac{1}{2}}", "0.5"), ("$x \\in (1, 2]$", "(1,2]"), ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}"),
            ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
            ("The answer is 3\\sqrt{2}.", "\\sqrt{18}"), ("\\boxed{45^\\circ}", "45")]


def _worker_main(conn, score_fn):
  # Ctrl-C goes to the whole process group; the parent decides when workers stop.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  for response, answer in _WARM_UP:
    try:
      score_fn("math", response, answer)
    except Exception:  # noqa: BLE001 -- a custom score_fn may not take these
      pass
  conn.send("ready")
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message is None:
      return
    item, args = message
    try:
      value, error = score_fn(*args)
    except Exception as e:  # noqa: BLE001
      value, error = 0.0, f"{type(e).__name__}: {e}"[:500]
    conn.send((item, float(value), error))


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
  run's sums). Synthetic data sources are scored in this process (cheap and trusted); the pool
  starts on the first item that needs it. An item that runs past `timeout_s` scores 0.0 and its
  worker is killed and replaced; a worker that dies scores its item 0.0 (an error) likewise.
  `score_fn(data_source, response, answer) -> (score, error | None)` must be picklable.
  """

  def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, *, mp_context: str = "forkserver",
               score_fn: Callable[[str, str, str], tuple[float, str | None]] = checked_score_for):
    if num_workers <= 0 or timeout_s <= 0:
      raise ValueError(f"num_workers ({num_workers}) and timeout_s ({timeout_s}) must be positive")
    self.num_workers, self.timeout_s = num_workers, timeout_s
    self._score_fn = score_fn
    self._context = multiprocessing.get_context(mp_context)
    if mp_context == "forkserver":
      # Workers fork from a server that has math-verify (sympy) imported: a replacement starts in
      # milliseconds. Only applies when this process has not started its forkserver yet.
      self._context.set_forkserver_preload(["pacs_jax.rewards.math"])
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
                           "run compute_score in this process to see the error")
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
    for i, (response, answer, source) in enumerate(zip(responses, answers, data_sources)):
      if synthetic.is_synthetic(source):
        scores[i], error = checked_score_for(source, response, answer)
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
