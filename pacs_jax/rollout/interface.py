"""The one rollout interface: what the trainer, the evaluator, the public API, the study and `--compile_only` ask
of whatever samples responses. `local.LocalRollout` (the in-process engine) is its first implementation; what an
overlapped worker or an external server would need is in docs/design.md ("The rollout interface").

Modules outside `pacs_jax/rollout/` import this module, `local`, `sampling`, `stop_tokens` and `budget` only
(tests/test_layering.py): the engine, its scheduler and its state are the implementation's own.

Shapes: B slots.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pacs_jax import plugins
from pacs_jax.rollout import budget as budget_lib
from pacs_jax.rollout import sampling as sampling_lib


@dataclasses.dataclass
class Completion:
  """One sampled response: its tokens (EOS included when it stopped there), their behaviour log-probs (the
  sampling policy's), the version of the policy that made it (`Rollout.set_weights`'s), and its loss mask.

  `loss_mask` [len(tokens)]: 1 on a token the model sampled, 0 on one inserted into the response (a tool's output,
  a template token between turns): inserted tokens are attended to but get no loss and no place in any objective's
  sums. None (the default) means every token is the model's (an all-ones mask is filled in).
  """
  prompt_index: int
  sample_index: int
  tokens: list[int]
  logprobs: np.ndarray  # [len(tokens)] fp32, log_softmax(logits / temperature) at each token
  finish_reason: str  # "eos" | "length"
  policy_version: int = 0
  loss_mask: np.ndarray | None = None  # [len(tokens)] float32, 1 = the model's token, 0 = inserted

  def __post_init__(self):
    if self.loss_mask is None:
      self.loss_mask = np.ones(len(self.tokens), np.float32)


class Progress:
  """A progress bar's view of `Rollout.generate`, passed as its `on_finish`: called as each response finishes;
  `begin(budget)` as a generate call starts (its token budget: responses x max_new_tokens) and `tokens(count)`
  after each decode call (the budget it used up: the tokens it generated, and the rest of the budget of each
  response that stopped early), so a bar over the budget moves with the tokens and ends full."""

  def __call__(self) -> None:
    pass

  def begin(self, budget: int) -> None:
    pass

  def tokens(self, count: int) -> None:
    pass


def token_bar(description: str, total: int | None = None, initial: int = 0, leave: bool = False,
              disable: bool = False):
  """A tqdm bar over the token budget of a rollout (responses x max_new_tokens; `interface.Progress` fills it)."""
  from tqdm.auto import tqdm
  return tqdm(total=total, initial=initial, desc=description, unit="token", unit_scale=True, leave=leave,
              dynamic_ncols=True, smoothing=0.1, disable=disable)


def phase_line(line: str) -> None:
  """One line on stdout, above any progress bar drawn (tqdm clears and redraws it), in a terminal or not."""
  from tqdm.auto import tqdm
  tqdm.write(line, file=sys.stdout)


class BarProgress(Progress):
  """Moves `bar` with the tokens a rollout generates (a bar made without a total grows by each generate call's
  budget), counts the finished responses beside it, and redraws it every `tick_s` so its clock runs through long
  device calls (a step's update, a first call's compile).

  `compiling`: the bar's description says "(compiling)" until the first tokens come back, and then one line on
  stdout (above the bar, in a terminal or not) says how long that took: `eval: compiled and first decode call in
  41.2 s` (evaluate's first call compiles the sampler's programs; the bar would otherwise sit at 0% without a word)."""

  def __init__(self, bar, tick_s: float = 1.0, compiling: bool = False):
    self.bar, self.responses = bar, 0
    self._grow = bar.total is None
    self._compiling = None
    if compiling and not bar.disable:
      self._compiling = (bar.desc, time.monotonic())
      bar.set_description(f"{bar.desc} (compiling)")
    self._stop = threading.Event()
    self._ticker = threading.Thread(target=self._tick, args=(tick_s,), daemon=True)
    self._ticker.start()

  def _tick(self, tick_s: float) -> None:
    while not self._stop.wait(tick_s):
      self.bar.refresh()

  def __call__(self) -> None:
    self.responses += 1
    self.bar.set_postfix_str(f"{self.responses} responses", refresh=False)

  def begin(self, budget: int) -> None:
    if self._grow:
      self.bar.total = (self.bar.total or 0) + budget
      self.bar.refresh()

  def tokens(self, count: int) -> None:
    if self._compiling is not None:
      desc, start = self._compiling
      self._compiling = None
      self.bar.set_description(desc, refresh=False)
      phase_line(f"{desc}: compiled and first decode call in {time.monotonic() - start:.1f} s")
    self.bar.update(count)

  def close(self) -> None:
    self._stop.set()
    self._ticker.join()
    self.bar.close()


@runtime_checkable
class Rollout(Protocol):
  """Samples responses with the weights it was last given.

  `set_weights(params, version)` takes the policy's weights (an `nnx.State`, or a module) as policy `version`
  (the trainer's: optimizer steps done); `generate` then samples `n` responses per prompt, each stamped with
  the version that made it. `release()` lets go of the weights until the next `set_weights` (a colocated
  engine's sleep: the synchronous trainer frees them for the update, as verl's hybrid engine offloads its
  rollout weights). `weight_shardings`: the layout `set_weights` takes weights in without moving them (None:
  any); `eos_ids`: the ids a response stops at (kept, with their log-prob).

  `fork()`: another rollout with weights and a version of its own (sharing what it can: an in-process engine's
  compiled programs): the overlapped modes' background worker samples one policy while the trainer's validation
  samples another. `ahead_of_time()`: the in-process engine's sizes and lowering hooks (`AheadOfTime`), or None for
  an engine that has none (an external server): `--compile_only` and split devices need one.

  `converse` (optional, `Conversing`): multi-turn conversations with an environment (`runs_conversations`).

  `rollout.engine` names the run's implementation: "local" (`local.LocalRollout`) or "package.module:factory",
  a factory taking `programs.make_rollout`'s keyword arguments (`engine_factory`).
  """
  version: int
  eos_ids: tuple[int, ...]

  @property
  def weight_shardings(self) -> Any: ...

  def set_weights(self, params: Any, version: int) -> None: ...

  def release(self) -> None: ...

  def fork(self) -> Rollout: ...

  def ahead_of_time(self) -> AheadOfTime | None: ...

  def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1,
               max_new_tokens: int | Sequence[int] | None = None,
               sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
               prompt_ids: Sequence[int] | None = None,
               on_finish: Callable[[], None] | None = None) -> list[Completion]:
    """`n` responses per prompt ordered by (prompt, sample); each depends on (seed, prompt id, sample index)
    alone (`prompt_ids`, default the prompts' indices); at most `max_new_tokens` tokens (one for all or one per
    prompt); `on_finish()` is called as each response finishes."""
    ...


@runtime_checkable
class Conversing(Protocol):
  """What a rollout that runs conversations adds to `Rollout` (optional: `local.LocalRollout` has it; a rollout
  without it cannot run `env.name` "python_tool"). `converse` samples `n` conversations per prompt with the weights
  it holds, each episode started from its data row (`rows[i]`, `{problem, answer, data_source}`) by `env`; a model
  turn ends at any of `pause_ids` and the environment's observation continues the same slot (`conversation.converse`
  of the in-process engine). Returns objects with `completion` (a `Completion`: the model's turns and the inserted
  observations, `loss_mask` 0 on the inserted tokens, stamped with the version) and `episode` (`envs.env.Episode`:
  its turns, reward and stats), ordered by (prompt, sample). `on_finish` is `Rollout.generate`'s, per conversation."""

  def converse(self, prompts: Sequence[Sequence[int]], rows: Sequence[Any], env: Any, *,
               encode: Callable[[str], Sequence[int]], decode: Callable[[Sequence[int]], str],
               pause_ids: Sequence[int], eos_ids: Sequence[int] = (), n: int = 1,
               max_new_tokens: int | Sequence[int] | None = None,
               sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
               prompt_ids: Sequence[int] | None = None, env_workers: int = 4,
               on_finish: Callable[[], None] | None = None) -> list[Any]: ...


def runs_conversations(rollout: Any) -> bool:
  """Whether `rollout` has the optional `Conversing.converse`."""
  return callable(getattr(rollout, "converse", None))


@runtime_checkable
class AheadOfTime(Protocol):
  """What `--compile_only` asks of an in-process rollout (`LocalRollout.ahead_of_time()`): its sizes and its
  programs lowered from abstract weights and state, nothing allocated. An external server has none."""
  max_concurrent_decodes: int  # B
  steps_per_call: int
  prefill_buckets: tuple[int, ...]
  continue_buckets: tuple[int, ...]  # a continuation's inserted tokens, padded (a conversation's observation)
  policy: budget_lib.PagePolicy  # which page budget a decode call runs at
  slot_rungs: tuple[int, ...]  # the slot counts decode programs run over (`slot_rungs.ladder`; the last is B)
  page_shards: int  # Z: batch shards of the slots and their page pools

  @property
  def page_budgets(self) -> tuple[int, ...]: ...

  @property
  def param_shardings(self) -> Any: ...

  def abstract_params(self, dtype=None) -> Any: ...

  def abstract_decode_state(self) -> Any: ...

  def lower_init(self) -> Any: ...

  def lower_prefill(self, params, batch: int, bucket: int) -> Any: ...

  def lower_insert_requests(self, state, cache, logits, requests: int, sampling=None, pauses: int = 0) -> Any: ...

  def lower_decode(self, params, state, page_budget: int | None = None, sampling=None,
                   num_steps: int | None = None, pauses: int = 0, rung: int | None = None) -> Any: ...

  def lower_continue(self, params, state, requests: int, bucket: int, sampling=None, pauses: int = 0) -> Any: ...

  def continue_bucket_length(self, inserted: int) -> int: ...


LOCAL_ENGINE = "local"  # rollout.engine's default: the in-process engine (`local.LocalRollout`)


def _lookup_engine(name: str) -> tuple[Callable | None, str | None]:
  """(the factory `name` ("package.module:factory") names, None), or (None, why it names none)."""
  return plugins.lookup(name, f'"{LOCAL_ENGINE}" or "package.module:factory"')


def engine_problem(name: str) -> str | None:
  """Why `name` names no rollout engine, or None when it does ("local", or an importable callable)."""
  return None if name == LOCAL_ENGINE else _lookup_engine(name)[1]


def engine_factory(name: str) -> Callable[..., Rollout]:
  """The factory "package.module:factory" names; ValueError saying why when there is none."""
  factory, why = _lookup_engine(name)
  if factory is None:
    raise ValueError(f"rollout.engine {name!r}: {why}")
  return factory
