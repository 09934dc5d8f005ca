"""`LocalRollout`: the rollout interface (`interface.Rollout`) over the in-process engine, on this process's mesh:
`engine.Engine`'s jitted programs driven by `scheduler.generate` (continuous batching over a paged KV cache)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from pacs_jax.rollout import conversation
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout import scheduler
from pacs_jax.rollout.engine import Engine
from pacs_jax.rollout.interface import AheadOfTime, Completion


class LocalRollout:
  """The engine on `mesh` (None: the default device), sampling with the weights `set_weights` gave it.

  `model` may be abstract (`nnx.eval_shape`): the engine keeps its structure only. `slots` responses decode at
  once, prompts of up to `max_prompt_length` tokens, responses of up to `max_new_tokens`; `page_size` and
  `kv_pages` size the paged KV cache, `slot_rungs` the slot ladder (`engine.Engine`).
  """

  def __init__(self, model, *, slots: int, max_prompt_length: int, max_new_tokens: int,
               mesh: jax.sharding.Mesh | None = None, eos_ids: Sequence[int] = (), page_size: int = 64,
               kv_pages: int = 0, slot_rungs: int = 1):
    self._engine = Engine(model, max_concurrent_decodes=slots, max_prefill_length=max_prompt_length,
                          max_decode_length=max_new_tokens, mesh=mesh, eos_ids=eos_ids, page_size=page_size,
                          kv_pages=kv_pages, slot_rungs=slot_rungs)
    self.eos_ids = self._engine.eos_ids
    self.version = -1
    self._params = None

  @property
  def weight_shardings(self):
    """The engine's sample-mode shardings of the weights (None without a mesh)."""
    return self._engine.param_shardings

  def set_weights(self, params, version: int) -> None:
    """Weights (an `nnx.State` in any layout, or a module) moved into `weight_shardings` (no copy for arrays
    already there), as policy `version`."""
    self._params = self._engine.load_params(params)
    self.version = int(version)

  def release(self) -> None:
    self._params = None

  def fork(self) -> LocalRollout:
    """Another rollout over the same engine (its compiled programs) with weights and a version of its own: a
    background worker samples one policy while the trainer's validation samples another."""
    other = copy.copy(self)
    other.release()
    other.version = -1
    return other

  def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1,
               max_new_tokens: int | Sequence[int] | None = None,
               sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
               prompt_ids: Sequence[int] | None = None,
               on_finish: Callable[[], None] | None = None) -> list[Completion]:
    """`interface.Rollout.generate` by `scheduler.generate`, each completion stamped with `version`."""
    params, version = self._params, self.version
    if params is None:
      raise RuntimeError("LocalRollout.generate before set_weights (or after release): no weights to sample with")
    completions = scheduler.generate(self._engine, params, prompts, n=n, max_new_tokens=max_new_tokens,
                                     sampling=sampling, seed=seed, eos_ids=self.eos_ids, prompt_ids=prompt_ids,
                                     on_finish=on_finish)
    return [dataclasses.replace(c, policy_version=version) for c in completions]

  def converse(self, prompts: Sequence[Sequence[int]], rows: Sequence[Mapping[str, Any]], env, *,
               encode: Callable[[str], Sequence[int]], decode: Callable[[Sequence[int]], str],
               pause_ids: Sequence[int], eos_ids: Sequence[int] = (), n: int = 1,
               max_new_tokens: int | Sequence[int] | None = None,
               sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
               prompt_ids: Sequence[int] | None = None, env_workers: int = 4,
               on_finish: Callable[[], None] | None = None) -> list[conversation.Conversation]:
    """`interface.Conversing.converse` by `conversation.converse` on this engine with the weights it holds, each
    completion stamped with `version`."""
    params, version = self._params, self.version
    if params is None:
      raise RuntimeError("LocalRollout.converse before set_weights (or after release): no weights to sample with")
    out = conversation.converse(self._engine, params, env, prompts, rows, encode=encode, decode=decode,
                                pause_ids=pause_ids, eos_ids=eos_ids, n=n, max_new_tokens=max_new_tokens,
                                sampling=sampling, seed=seed, prompt_ids=prompt_ids, env_workers=env_workers,
                                on_finish=on_finish)
    for talk in out:
      talk.completion = dataclasses.replace(talk.completion, policy_version=version)
    return out

  def ahead_of_time(self) -> AheadOfTime:
    """The engine's sizes and `lower_*` hooks, for `--compile_only`."""
    return self._engine
