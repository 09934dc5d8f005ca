"""`rollout.mode = "one_step_off"`: the rollout of step k+1 runs on a background thread while step k scores and
updates (devices shared), by a worker over the trainer's engine with weights of its own (`LocalRollout.fork`).

With `rollout.max_staleness` 1 the next rollout starts before step k's update, with the weights step k sampled with
(its responses are one policy version old: the rollout correction, `rollout.tis_imp_ratio_cap`, reweights them);
with 0 it starts after the update, with the new weights: sync's responses through the overlapped machinery. Either
way its seed is the one the synchronous step k+1 would draw (`state.next_rollout_seed`), and its prompts are the
pipeline's next element, looked at ahead (`Lookahead`): a checkpoint records the data position before that element,
so after a resume it is drawn again and the rollout that was in flight is dropped, never trained on.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pacs_jax.trainer import stages
from pacs_jax.trainer import state as state_lib


class Lookahead:
  """The prompt pipeline's iterator, able to look one element ahead (`peek`); `get_state` is the position before
  an element looked at and not yet taken."""

  def __init__(self, iterator):
    self._iterator = iterator
    self._ahead: Any = None
    self._state_before: Any = None

  def peek(self):
    if self._ahead is None:
      self._state_before = self._iterator.get_state()
      self._ahead = next(self._iterator)
    return self._ahead

  def __iter__(self):
    return self

  def __next__(self):
    if self._ahead is None:
      return next(self._iterator)
    element, self._ahead, self._state_before = self._ahead, None, None
    return element

  def get_state(self):
    return self._iterator.get_state() if self._ahead is None else self._state_before


class NextRollout:
  """At most one rollout in flight on a background thread, for one pipeline element."""

  def __init__(self):
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-rollout")
    self._pending: tuple[Any, concurrent.futures.Future] | None = None
    self.started = 0  # rollouts started in the background (and so overlapped with something)

  def start(self, element, rollout: Callable[[], Any]) -> None:
    self.drop()
    self._pending = (element, self._pool.submit(rollout))
    self.started += 1

  def take(self, element):
    """The completions of the rollout started for `element` (waits for it), or None if none was."""
    if self._pending is None or self._pending[0] is not element:
      self.drop()
      return None
    _, future = self._pending
    self._pending = None
    return future.result()

  def drop(self) -> None:
    """Lets the rollout in flight finish and forgets it (its prompts are drawn again on a resume)."""
    if self._pending is not None:
      _, future = self._pending
      self._pending = None
      concurrent.futures.wait([future])

  def close(self) -> None:
    self.drop()
    self._pool.shutdown(wait=True)


def start_next(trainer, updated: bool) -> None:
  """one_step_off: starts `trainer`'s next step's rollout on the background thread if there is a next
  step, with the current weights: those this step sampled with (before its update, `updated` False) or its
  update's (after it). Its prompts are the pipeline's next element, its seed the synchronous step's."""
  if int(trainer.state.step) + (1 if updated else 2) > trainer.cfg.steps:
    return
  if not isinstance(trainer.data_iter, Lookahead):
    trainer.data_iter = Lookahead(trainer.data_iter)
  element = trainer.data_iter.peek()
  prompt_ids = [ids.tolist() for ids in element["prompt_ids"]]
  rng = trainer.state.rng
  seed = state_lib.rollout_seed(rng) if updated else state_lib.next_rollout_seed(rng)
  version, worker = int(trainer.state.step), trainer.rollout_worker
  with jax.set_mesh(trainer.mesh):
    weights = trainer.sample_params()
    if not updated:  # the update about to run donates the state: the worker keeps weights of its own
      weights = jax.tree.map(jnp.copy, weights)

  def rollout():
    with jax.set_mesh(trainer.mesh):
      worker.set_weights(weights, version)
      try:
        return stages.rollout(worker, prompt_ids, P=trainer.P, n=trainer.cfg.rollout.n, max_new_tokens=trainer.R,
                              sampling=trainer.sampling, seed=seed)
      finally:
        worker.release()
  trainer.next_rollout.start(element, rollout)
