"""`rollout.mode` "one_step_off" and "async": the rollouts of the next steps run on a background thread, by a worker
(`interface.Rollout`, e.g. `LocalRollout.fork`: the trainer's engine with weights of its own) while this step scores
and updates (devices shared).

With `rollout.max_staleness` s >= 1, before step k's update the rollouts of steps k+1 .. k+s are in flight (those not
yet started are started then, with the weights step k sampled with, policy version k-1): step j's responses are at
most s versions old when it trains on them (s exactly, once the pipeline is full; the rollout correction,
`rollout.tis_imp_ratio_cap`, reweights them). "one_step_off" is s <= 1; "async" any s. With s = 0 step k+1's rollout
starts after step k's update, with its weights: sync's responses through the overlapped machinery (bitwise).
Each rollout's seed is the one the synchronous step would draw (`train_state.rollout_seed_ahead`), and its prompts are
the pipeline's next elements, looked at ahead (`Lookahead`, which the trainer's iterator is in these modes): a
checkpoint records the data position before the first of them, and the rollouts in flight (`in_flight`: each one's
policy version and seed, and the weights of each version), so a resume draws the same elements again and starts the
same rollouts on them (`restart`): the steps after it sample what the uninterrupted run's did, bitwise. (A stop that
saves nothing drops the rollouts in flight, never trained on.)

A response made by a policy more than s versions older than the one the step's update starts from is dropped and
counted (`rollout/dropped`), and its prompt's responses are drawn again by the current policy (same seed, so no prompt
is lost or repeated). The worker here never makes one (each rollout starts within the bound); a worker that
lags (another device group, a server) can. Weights are taken whole at a rollout's start: no partial rollouts
(docs/design.md, "The rollout interface", says why).
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pacs_jax.rollout import interface
from pacs_jax.trainer import train_state as state_lib


class Lookahead:
  """The prompt pipeline's iterator, able to look ahead (`peek(i)`: the i-th element not yet taken); `get_state` is
  the position before the first element looked at and not yet taken."""

  def __init__(self, iterator):
    self._iterator = iterator
    self._ahead: collections.deque = collections.deque()  # (state before, element)

  def peek(self, i: int = 0):
    while len(self._ahead) <= i:
      state = self._iterator.get_state()
      self._ahead.append((state, next(self._iterator)))
    return self._ahead[i][1]

  def __iter__(self):
    return self

  def __next__(self):
    if not self._ahead:
      return next(self._iterator)
    return self._ahead.popleft()[1]

  def get_state(self):
    return self._ahead[0][0] if self._ahead else self._iterator.get_state()


class NextRollout:
  """Rollouts in flight on one background thread, run in the order started, each for one pipeline element.
  `inline`: each runs to its end when started, on the caller's thread (the same schedule, no overlap)."""

  def __init__(self, inline: bool = False):
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-rollout")
    self._pending: collections.deque[tuple[Any, concurrent.futures.Future, Any]] = collections.deque()
    self.started = 0  # rollouts started ahead (in the background unless inline)
    self.inline = inline

  def __len__(self) -> int:
    return len(self._pending)

  def start(self, element, rollout: Callable[[], Any], saved: Any = None) -> None:
    """Starts `rollout` for `element`; `saved`: what a checkpoint keeps of it while it is in flight (`in_flight`)."""
    if self.inline:
      future = concurrent.futures.Future()
      future.set_result(rollout())
    else:
      future = self._pool.submit(rollout)
    self._pending.append((element, future, saved))
    self.started += 1

  def in_flight(self) -> list:
    """The `saved` of each rollout in flight (started, not taken), in the order started."""
    return [saved for _, _, saved in self._pending]

  def take(self, element):
    """The completions of the rollout started for `element` (waits for it), or None if the first in flight is not
    its (then every one in flight is dropped)."""
    if not self._pending or self._pending[0][0] is not element:
      self.drop()
      return None
    return self._pending.popleft()[1].result()

  def drop(self) -> None:
    """Lets the rollouts in flight finish and forgets them (their prompts are drawn again on a resume)."""
    pending, self._pending = list(self._pending), collections.deque()
    concurrent.futures.wait([future for _, future, _ in pending])

  def close(self) -> None:
    self.drop()
    self._pool.shutdown(wait=True)


class Overlapped:
  """The rollouts of the next `max_staleness` steps (the next one, at 0) in flight by `worker`. It is given what it
  needs, never the trainer: `prompts(i)` the i-th pipeline element not yet taken (a `Lookahead`'s `peek`),
  `weights()` the current policy's rollout weights, `generate(worker, prompt_ids, seed)` one step's rollout by a
  worker holding weights, `mesh` the devices they live on and `last_step` the run's (none is started beyond it); the
  policy's RNG and version come with each `before_update` / `after_update`.

  On more than one process (`inline`) each runs on the trainer's thread when it is started, on shared or split
  devices: every process must launch programs that span processes in the same order, which a background thread
  beside the update's does not keep (XLA:CPU runs one multi-device program at a time per process, so two processes
  launching in different orders deadlock; docs/design.md, "The rollout interface"). The responses (versions, seeds,
  prompts) are the same as on one process; the time is not overlapped."""

  def __init__(self, worker: interface.Rollout, max_staleness: int, inline: bool = False, *, mesh=None,
               last_step: int = 0, prompts: Callable[[int], Any] | None = None,
               weights: Callable[[], Any] | None = None,
               generate: Callable[[interface.Rollout, list[list[int]], int], list] | None = None):
    self.worker, self.max_staleness = worker, int(max_staleness)
    self.mesh, self.last_step = mesh, last_step
    self.prompts, self.weights, self.generate = prompts, weights, generate
    self.queue = NextRollout(inline)
    self.dropped = 0  # the last step's responses dropped as too stale

  @property
  def started(self) -> int:
    return self.queue.started

  def take(self, prompts, version: int, resample: Callable[[], list[interface.Completion]]):
    """The completions of the rollout in flight for `prompts` (the step's element; None if none is), those made by
    a policy more than `max_staleness` versions older than `version` replaced by `resample()`'s (the current
    policy's rollout of the same prompts and seed) and counted in `dropped`."""
    self.dropped = 0
    completions = self.queue.take(prompts)
    if completions is None:
      return None
    stale = {i for i, c in enumerate(completions) if version - c.policy_version > self.max_staleness}
    if stale:
      fresh = resample()
      completions = [fresh[i] if i in stale else c for i, c in enumerate(completions)]
      self.dropped = len(stale)
    return completions

  def before_update(self, rng, version: int) -> None:
    """max_staleness >= 1: the rollouts of the next steps up to max_staleness ahead not yet in flight, started
    with the weights this step sampled with (version `version`, the state's step; copied: the update donates the
    state). `rng`: the state's RNG, which the running step's update starts from."""
    if self.max_staleness >= 1:
      self._fill(rng, version, self.max_staleness, before_update=True)

  def after_update(self, rng, version: int) -> None:
    """max_staleness 0: the next step's rollout, started with this update's weights (the state's RNG and step)."""
    if self.max_staleness == 0:
      self._fill(rng, version, 1, before_update=False)

  def _fill(self, rng, version: int, ahead: int, before_update: bool) -> None:
    """Starts the rollouts of the steps after the one whose element was taken last, up to `ahead` of them in flight
    and no further than `last_step`, all with the current weights (version `version`; copied `before_update`, which
    donates the state)."""
    next_step = version + 1  # the step that starts from `rng` (the one running, before its update ends)
    taken = version + 1 if before_update else version  # steps whose element is taken: before the update, this one too
    first = taken + 1 + len(self.queue)
    todo = [j for j in range(first, taken + ahead + 1) if j <= self.last_step]
    if not todo:
      return
    with jax.set_mesh(self.mesh):
      weights = self.weights()
      if before_update:  # the rollouts keep weights of their own
        weights = jax.tree.map(jnp.copy, weights)
    for j in todo:
      self._start(self.prompts(j - taken - 1), weights, version, state_lib.rollout_seed_ahead(rng, j - next_step))

  def _start(self, element, weights, version: int, seed: int) -> None:
    self.queue.start(element, self._rollout(element, weights, version, seed), saved=(version, seed, weights))

  def in_flight(self) -> tuple[list[dict], dict]:
    """What a checkpoint keeps of the rollouts in flight: each one's policy version and seed (in the order started)
    and the rollout weights of each version, by str(version) (one copy however many rollouts share it)."""
    saved = self.queue.in_flight()
    return ([{"version": version, "seed": seed} for version, seed, _ in saved],
            {str(version): weights for version, _, weights in saved})

  def restart(self, rollouts: list[dict], weights: dict) -> None:
    """A resume: starts again the rollouts a checkpoint saw in flight (`in_flight`), the i-th on the i-th pipeline
    element not yet taken, as the uninterrupted run had started them."""
    for i, r in enumerate(rollouts):
      self._start(self.prompts(i), weights[str(r["version"])], int(r["version"]), int(r["seed"]))

  def _rollout(self, element, weights, version: int, seed: int) -> Callable[[], list]:
    prompt_ids = [ids.tolist() for ids in element["prompt_ids"]]
    worker, mesh, generate = self.worker, self.mesh, self.generate

    def rollout():
      with jax.set_mesh(mesh):
        worker.set_weights(weights, version)
        try:
          return generate(worker, prompt_ids, seed)
        finally:
          worker.release()
    return rollout

  def close(self) -> None:
    self.queue.close()
