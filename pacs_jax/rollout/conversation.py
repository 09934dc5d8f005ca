"""Conversations of tool-integrated RL (issue 43): `converse`, the continuous-batching rollout of an environment's
episodes (envs/env.py). A slot decodes a model turn up to a turn-end (pause) id; the environment answers that turn in
a worker thread while the other slots decode on; its observation's tokens go into the same slot after its KV prefix
(`Engine.continue_slots`, the prefix never run again) and the slot samples on, until the episode is over and the
slot takes the next queued request.

Shapes: B slots, Z batch shards.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pacs_jax.envs.env import Environment, Episode, StepResult
from pacs_jax.rollout import budget as budget_lib
from pacs_jax.rollout import continuation
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout import scheduler
from pacs_jax.rollout.engine import Engine
from pacs_jax.rollout.interface import Completion


@dataclasses.dataclass
class Conversation:
  """One request's rollout: its response (`completion`: the model's turns and the inserted observations in order,
  loss mask 1 on the model's tokens, 0 on inserted ones, whose log-probs are 0.0) and its finished `episode`."""
  completion: Completion
  episode: Episode


def pages_to_continue(rows: int, inserted: int, page_size: int) -> int:
  """Pages a paused slot with `rows` filled rows takes to be continued with `inserted` tokens (its pending token
  and those go into rows rows.., as `continuation.grow_pages` takes them)."""
  return -(-(rows + 1 + inserted) // page_size) - -(-rows // page_size)


@dataclasses.dataclass
class _Talk:
  """One conversation on the host: its response so far and where its current model turn began."""
  prompt: int
  sample: int
  episode: Episode
  budget: int  # most tokens its response may hold, the model's and inserted ones
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  mask: list[int] = dataclasses.field(default_factory=list)
  turn_start: int = 0
  reported: int = 0  # of its budget, told to the progress bar

  def add(self, tokens: Sequence[int], logprobs: Sequence[float], model: bool) -> None:
    self.tokens += [int(t) for t in tokens]
    self.logprobs += [float(x) for x in logprobs]
    self.mask += [int(model)] * len(tokens)

  def start_turn(self) -> None:
    self.turn_start = len(self.tokens)

  @property
  def model_tokens(self) -> int:
    return sum(self.mask)


def checked_budgets(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] | None
                    ) -> list[int]:
  """The response budget of each prompt (one for all, one per prompt, or None: the engine's `max_decode_length`);
  ValueError for a budget outside [1, max_decode_length] or a prompt no prefill bucket holds."""
  top = engine.max_decode_length
  max_new_tokens = top if max_new_tokens is None else max_new_tokens
  if np.ndim(max_new_tokens) == 0:
    budgets = [int(max_new_tokens)] * len(prompts)
  else:
    budgets = [int(b) for b in max_new_tokens]
  if len(budgets) != len(prompts) or not all(0 < b <= top for b in budgets):
    raise ValueError(f"max_new_tokens {max_new_tokens}: one for all or one per prompt ({len(prompts)}), each in "
                     f"[1, max_decode_length={top}]")
  for prompt in prompts:
    engine.bucket_length(len(prompt))
  return budgets


class _Loop:
  """The host side of `converse`: which conversation each slot holds and in what phase (decoding, waiting for its
  environment, ready to be continued), the pages each shard has free, and the environment steps in flight."""

  def __init__(self, engine: Engine, params, env: Environment, prompts, episodes, budgets, *, encode, decode,
               pause_ids, eos_ids, sampling, seed, prompt_ids, refill_fraction, pool, on_finish=None):
    self.engine, self.params, self.env, self.pool = engine, params, env, pool
    self.on_finish, self.progress = on_finish, getattr(on_finish, "tokens", None)
    self.encode, self.decode_text, self.sampling, self.seed = encode, decode, sampling, seed
    self.prompts, self.budgets, self.prompt_ids = prompts, budgets, prompt_ids
    self.eos, self.pause = tuple(sorted({int(e) for e in eos_ids})), tuple(sorted({int(p) for p in pause_ids}))
    B = engine.max_concurrent_decodes
    self.refill_at = max(1, int(B * refill_fraction))
    self.rows_per_slot = engine.pages_per_slot * engine.page_size  # the device's L (whole pages)
    self.per_shard = B // engine.page_shards
    self.queue = collections.deque(episodes)  # ((prompt, sample), episode), in order
    self.talks: list[_Talk | None] = [None] * B
    self.decoding = np.zeros(B, bool)  # [B]: the slot may be active on the device
    self.rows = np.zeros(B, np.int64)  # [B]: filled cache rows of each slot (its pending token's position)
    self.free_pages = np.full(engine.page_shards, engine.pages_per_shard - 1, np.int64)  # [Z]
    self.stepping: dict[concurrent.futures.Future, tuple[_Talk, int | None]] = {}  # env step -> (talk, held slot)
    self.ready: list[tuple[int, list[int]]] = []  # (paused slot, its observation's tokens) to continue
    self.releasing: list[int] = []  # paused slots whose conversation is over: their pages go back
    self.stalled = False  # the last decode call made no progress: every active slot waits for a page
    self.done: dict[tuple[int, int], Conversation] = {}
    self.state = engine.init_decode_state()

  # -- environment answers ---------------------------------------------------------------------------------------

  def submit(self, talk: _Talk, slot: int | None) -> None:
    """Steps `talk`'s episode with its turn (tokens from its start, the turn-end token included) in the pool."""
    text = self.decode_text(talk.tokens[talk.turn_start:])
    self.stepping[self.pool.submit(self.env.step, talk.episode, text)] = (talk, slot)

  def take_answers(self, block: bool) -> None:
    """Applies the environment steps that are done (with `block`, waits for at least one), in request order."""
    if not self.stepping:
      return
    done, _ = concurrent.futures.wait(list(self.stepping), timeout=None if block else 0,
                                      return_when=concurrent.futures.FIRST_COMPLETED)
    for future in sorted(done, key=lambda f: (self.stepping[f][0].prompt, self.stepping[f][0].sample)):
      talk, slot = self.stepping.pop(future)
      self.answer(talk, slot, future.result())

  def answer(self, talk: _Talk, slot: int | None, result: StepResult) -> None:
    """A turn's answer: the episode is over, or its observation continues the slot (where it has room)."""
    if result.done:
      return self.close(talk, slot, for_room=False)
    if slot is None:  # the response stopped for good (an EOS id, its budget, its slot's rows): nothing goes on
      reason = "answer" if talk.tokens[-1] in self.eos else "tokens"
      self.env.end(talk.episode, result, reason)
      return self.close(talk, None, for_room=reason == "tokens")
    if result.observation is None:
      raise ValueError(f"{type(self.env).__name__}.step: an episode that goes on needs an observation")
    inserted = [int(t) for t in self.encode(result.observation)]
    if (len(talk.tokens) + len(inserted) >= talk.budget
        or not self.engine.continuation_fits(int(self.rows[slot]), len(inserted))):
      self.env.end(talk.episode, result, "tokens")  # no row left for the model's next token
      return self.close(talk, slot, for_room=True)
    self.ready.append((slot, inserted))

  def close(self, talk: _Talk, slot: int | None, for_room: bool) -> None:
    """Records the finished conversation; a slot it still holds (paused) gives its pages back next."""
    last = talk.tokens[-1]
    stopped_itself = last in self.eos or last in self.pause
    length = for_room or talk.episode.reason == "tokens" or not stopped_itself
    self.done[(talk.prompt, talk.sample)] = Conversation(
        Completion(prompt_index=talk.prompt, sample_index=talk.sample, tokens=talk.tokens,
                   logprobs=np.asarray(talk.logprobs, np.float32), finish_reason="length" if length else "eos",
                   loss_mask=np.asarray(talk.mask, np.float32)), talk.episode)
    if slot is not None:
      self.releasing.append(slot)
      self.talks[slot] = None
    self.report(talk, talk.budget)  # what a conversation that ended early leaves of its budget
    if self.on_finish is not None:
      self.on_finish()

  def report(self, talk: _Talk, upto: int) -> None:
    """Tells the progress bar (an `interface.Progress`) the budget `talk` has used up to `upto` tokens."""
    if self.progress is not None and upto > talk.reported:
      self.progress(upto - talk.reported)
      talk.reported = upto

  # -- device calls ----------------------------------------------------------------------------------------------

  def release(self) -> None:
    if not self.releasing:
      return
    self.state = self.engine.release_slots(self.state, self.releasing)
    for slot in self.releasing:
      self.free_pages[slot // self.per_shard] += budget_lib.prompt_pages(int(self.rows[slot]), self.engine.page_size)
    self.releasing = []

  def continue_ready(self):
    """One continue call for the ready slots whose shard has the pages (the others wait for a later call): (their
    slots, the call's `ContinuedTokens` on device), or None."""
    going, inserted, budgets, waiting = [], [], [], []
    for slot, tokens in self.ready:
      need, shard = pages_to_continue(int(self.rows[slot]), len(tokens), self.engine.page_size), slot // self.per_shard
      if need > self.free_pages[shard]:
        waiting.append((slot, tokens))
        continue
      self.free_pages[shard] -= need
      talk = self.talks[slot]
      # The device counts a budget in sampled tokens: those so far and the rows the response has left after these.
      budgets.append(talk.model_tokens + talk.budget - len(talk.tokens) - len(tokens))
      talk.add(tokens, [0.0] * len(tokens), model=False)
      talk.start_turn()
      self.rows[slot] += 1 + len(tokens)  # the pending token and these: the next decode call's page budget holds them
      going.append(slot)
      inserted.append(tokens)
    self.ready = waiting
    if not going:
      return None
    self.state, first = self.engine.continue_slots(
        self.params, self.state, *continuation.pad_continuations(self.engine, going, inserted, budgets),
        self.sampling, self.eos, pause_ids=self.pause)
    self.decoding[going] = True
    return going, first

  def admit(self):
    """Queued requests into free slots (one prefill per prompt-length bucket): their `FirstTokens`, on device."""
    heads = (budget_lib.prompt_pages(len(self.prompts[p]), self.engine.page_size) for (p, _), _ in self.queue)
    slots = scheduler.admit_slots(heads, np.array([t is not None for t in self.talks]), self.free_pages)
    if not slots:
      return []
    entering = [self.queue.popleft() for _ in slots]
    distinct = sorted({p for (p, _), _ in entering})
    for slot, ((p, s), episode) in zip(slots, entering):
      self.talks[slot] = _Talk(p, s, episode, self.budgets[p])
      self.rows[slot] = len(self.prompts[p])
      self.free_pages[slot // self.per_shard] -= budget_lib.prompt_pages(len(self.prompts[p]), self.engine.page_size)
    talks = [self.talks[slot] for slot in slots]
    self.state, firsts = scheduler.prefill_insert(
        self.engine, self.params, self.state, [self.prompts[p] for p in distinct],
        [distinct.index(t.prompt) for t in talks], slots, [self.prompt_ids[t.prompt] for t in talks],
        [t.sample for t in talks], [t.budget for t in talks], self.seed, self.sampling, self.eos, pause_ids=self.pause)
    self.decoding[slots] = True
    return [(first, [slots[r] for r in first.requests]) for first in firsts]

  def decode(self, firsts, continued) -> None:
    """One decode call; then the first tokens of this round's inserts and continuations and the call's tokens go
    to their conversations (read after the call is queued, as `scheduler.generate` reads them), and each slot that
    stopped has its turn stepped by the environment."""
    queued = len(self.queue)
    stop_after = min(self.refill_at, queued) if queued else (self.refill_at if self.pause else len(self.talks) + 1)
    page_budget = self.engine.policy.page_budget(self.rows, self.decoding)
    self.state, out = self.engine.decode(self.params, self.state, stop_after, self.sampling, self.eos, page_budget,
                                         pause_ids=self.pause)
    if continued is not None:
      going, first = continued
      first = jax.device_get(first)
      if not first.continued[:len(going)].all():  # the host checked rows and pages: a refusal is a bug
        raise RuntimeError(f"continue_slots refused slots {[s for s, ok in zip(going, first.continued) if not ok]}")
      for q, slot in enumerate(going):
        self.talks[slot].add([first.tokens[q]], [first.logprobs[q]], model=True)
    for first, slots in firsts:
      for slot, token, logprob in zip(slots, np.asarray(first.tokens).tolist(), np.asarray(first.logprobs).tolist()):
        self.talks[slot].add([token], [logprob], model=True)
    out = jax.device_get(out)
    self.rows = np.array(out.lengths, np.int64)
    self.free_pages = np.array(out.free_pages, np.int64)
    self.stalled = bool(out.active.any() and not out.emitted.any())
    for slot, talk in enumerate(self.talks):
      if talk is None or not self.decoding[slot]:
        continue
      emitted = out.emitted[slot]
      talk.add(out.tokens[slot, emitted].tolist(), out.logprobs[slot, emitted].tolist(), model=True)
      self.report(talk, len(talk.tokens))
      if out.active[slot]:
        continue
      self.decoding[slot] = False
      # Paused at a turn end (holding its pages, as `decode.stops` keeps them) or stopped for good (pages given back).
      paused = talk.tokens[-1] in self.pause and self.rows[slot] < self.rows_per_slot
      if not paused:
        self.talks[slot] = None
      self.submit(talk, slot if paused else None)

  def run(self) -> None:
    while True:
      self.take_answers(block=self.stalled and bool(self.stepping))
      self.release()
      continued = self.continue_ready()
      firsts = self.admit()
      if self.decoding.any():
        self.decode(firsts, continued)
        if self.stalled and not self.stepping:
          raise RuntimeError(
              f"every busy decode slot is waiting for a KV page and no conversation is waiting for its environment: "
              f"raise rollout.kv_pages={self.engine.kv_pages} (0 = enough for every slot) or lower rollout.slots")
      elif self.stepping:
        self.take_answers(block=True)
      elif self.queue or self.ready:
        raise RuntimeError(f"no decode slot's batch shard has the KV pages for the next prompt or continuation; "
                           f"raise rollout.kv_pages={self.engine.kv_pages} (0 = enough for every slot)")
      else:
        return


def converse(engine: Engine, params, env: Environment, prompts: Sequence[Sequence[int]],
             rows: Sequence[Mapping[str, Any]], *, encode: Callable[[str], Sequence[int]],
             decode: Callable[[Sequence[int]], str], pause_ids: Sequence[int], eos_ids: Sequence[int] = (),
             n: int = 1, max_new_tokens: int | Sequence[int] | None = None,
             sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
             prompt_ids: Sequence[int] | None = None, refill_fraction: float = 0.125,
             env_workers: int = 4, on_finish: Callable[[], None] | None = None) -> list[Conversation]:
  """`n` conversations for every prompt (its data row `rows[i]` starts each one's episode: `env.reset`), ordered by
  (prompt, sample) like `scheduler.generate`'s completions, with the same randomness (seed, prompt id, sample index,
  the model's token count) and continuous batching.

  A model turn ends at any of `pause_ids` (the environment's turn-end tokens, e.g. Qwen's `<|im_end|>`; kept, with
  its log-prob, as the turn's last token). The slot pauses holding its pages; `env.step(episode, decode(turn))` (the
  turn's tokens, its turn-end token included: a decode that skips special tokens drops it) runs in one of
  `env_workers` threads (an environment's steps must be thread-safe), while the other slots decode on. If
  the episode goes on, `encode(observation)` is fed into the slot after its KV prefix and sampling resumes; if it is
  over (an answer, its turn or token limit) the slot is freed for the next queued request. A response stops for good
  at any of `eos_ids` (an end of its own: the episode ends with reason "answer"), or when it holds
  `max_new_tokens` tokens (one for all or one per prompt; default the engine's `max_decode_length`), the model's and
  the inserted ones together: what its row in the training batch must hold. Its last turn is still stepped (recorded
  and scored); where the environment would go on but the response cannot (or an observation has no room left for
  the model's next token), the rollout ends the episode (`env.end`, reason "tokens").

  finish_reason: "length" when the conversation ran out of room (its budget or rows, an observation that did not
  fit, the environment's own token limit), else "eos". Without pause ids no turn pauses and the calls (and results)
  are those of `scheduler.generate`, each episode stepped once with the whole response.

  `on_finish()`, if given, is called as each conversation finishes; an `interface.Progress` also hears the token
  budget (conversations x max_new_tokens) before the first call and each conversation's share of it as its tokens
  (the model's and the inserted ones) arrive, the rest of it when it ends: a bar over the budget ends full.
  """
  if len(rows) != len(prompts):
    raise ValueError(f"{len(rows)} rows for {len(prompts)} prompts")
  prompts = [[int(t) for t in p] for p in prompts]
  budgets = checked_budgets(engine, prompts, max_new_tokens)
  prompt_ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
  if len(prompt_ids) != len(prompts):
    raise ValueError(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")
  episodes = [((p, s), env.reset(rows[p])) for p in range(len(prompts)) for s in range(n)]
  pool = concurrent.futures.ThreadPoolExecutor(env_workers, thread_name_prefix="env")
  loop = _Loop(engine, params, env, prompts, episodes, budgets, encode=encode, decode=decode, pause_ids=pause_ids,
               eos_ids=eos_ids, sampling=sampling, seed=seed, prompt_ids=prompt_ids, refill_fraction=refill_fraction,
               pool=pool, on_finish=on_finish)
  if getattr(on_finish, "begin", None) is not None:
    on_finish.begin(n * sum(budgets))
  try:
    loop.run()
  finally:
    pool.shutdown(wait=False, cancel_futures=True)
  return [loop.done[key] for key, _ in episodes]
