"""Continuous batching: `generate`, the whole rollout the trainer and evaluator call, over an `Engine`'s
slots (requests queue, take slots as others finish, and share their prompt's prefill).

Shapes: B slots (or prompts in a prefill), T prompt bucket length, Q requests, Z batch shards.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from pacs_jax.rollout import budget as budget_lib
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout import slot_rungs
from pacs_jax.rollout.budget import next_pow2
from pacs_jax.rollout.engine import Engine
from pacs_jax.rollout.interface import Completion
from pacs_jax.rollout.decode_state import DecodeState, DecodeStats, FirstTokens


def prefill_insert(engine: Engine, params, decode_state: DecodeState, prompts: Sequence[Sequence[int]],
                   prompt_rows: Sequence[int], slots: Sequence[int], prompt_index: Sequence[int],
                   sample_index: Sequence[int], budgets: Sequence[int], seed: int,
                   sampling: sampling_lib.SamplingMethod, eos_ids: Sequence[int],
                   pause_ids: Sequence[int] = ()) -> tuple[DecodeState, list[FirstTokens]]:
  """Prefills distinct `prompts` and inserts requests r into `slots[r]` from `prompts[prompt_rows[r]]`.

  One prefill per prompt-length bucket; prompt rows and requests are padded to powers of two
  (padding requests target slot B and are dropped). The first tokens come back as device arrays, one
  `FirstTokens` per bucket, so the caller can read them after queueing more work. A first token in `pause_ids`
  pauses its slot (`Engine.decode`).
  """
  by_bucket: dict[int, list[int]] = collections.defaultdict(list)
  for i, p in enumerate(prompts):
    by_bucket[engine.bucket_length(len(p))].append(i)
  requests_of = collections.defaultdict(list)
  for r, row in enumerate(prompt_rows):
    requests_of[row].append(r)
  firsts = []
  for T, rows in sorted(by_bucket.items()):
    B = next_pow2(len(rows))
    tokens = np.zeros((B, T), np.int32)
    lengths = np.ones((B,), np.int32)
    for b, i in enumerate(rows):
      tokens[b, :len(prompts[i])] = prompts[i]
      lengths[b] = len(prompts[i])
    req = [(b, r) for b, i in enumerate(rows) for r in requests_of[i]]
    pad = next_pow2(len(req)) - len(req)
    column = lambda values, fill, pad=pad: np.array(list(values) + [fill] * pad, np.int32)
    cache, logits = engine.prefill_batch(params, tokens, lengths)
    decode_state, first = engine.insert_requests(
        decode_state, cache, logits, lengths, column((b for b, _ in req), 0),
        column((slots[r] for _, r in req), engine.max_concurrent_decodes), seed,
        column((prompt_index[r] for _, r in req), 0), column((sample_index[r] for _, r in req), 0),
        column((budgets[r] for _, r in req), 0), sampling, eos_ids, requests=[r for _, r in req],
        pause_ids=pause_ids)
    firsts.append(first)
  return decode_state, firsts


def admit_slots(pages_needed: Iterable[int], occupied: np.ndarray, free_pages: np.ndarray) -> list[int]:
  """Slots for queued requests, in queue order, while one fits: request i (needing pages_needed[i] pages for its
  prompt) goes into the free slot whose batch shard has the most free pages (the lowest such slot), if that shard
  keeps a page for each of its occupied slots and one more after it (none if it has none occupied): headroom, so
  rows that grow rarely all wait at once. occupied [B] bool (a paused conversation's slot is occupied: it holds
  its pages), free_pages [Z]; neither is changed."""
  per_shard = len(occupied) // len(free_pages)
  pages = np.array(free_pages, np.int64)
  busy = np.bincount(np.flatnonzero(occupied) // per_shard, minlength=len(pages))
  free = [int(s) for s in np.flatnonzero(~np.asarray(occupied, bool))]
  slots = []
  for need in pages_needed:
    if not free:
      break
    slot = max(free, key=lambda s: (pages[s // per_shard], -s))  # the free slot on the shard with the most pages
    shard = slot // per_shard
    if pages[shard] - need < (busy[shard] + 1 if busy[shard] else 0):
      break
    pages[shard] -= need
    busy[shard] += 1
    free.remove(slot)
    slots.append(slot)
  return slots


def tail_rung(engine: Engine, busy: np.ndarray, queued: bool) -> tuple[np.ndarray | None, int | None]:
  """(the slots of the smallest rung of `engine.slot_rungs` that holds every busy slot [B] bool, None for all of
  them; how many slots must finish before the next rung down would hold the rest, None if none would). Only in
  the tail (nothing `queued`): while requests wait, freed slots are refilled at once."""
  rungs = engine.slot_rungs
  if queued or len(rungs) == 1:
    return None, None
  Z = engine.page_shards
  rung = slot_rungs.choose(busy, Z, rungs)
  index = None if rung == engine.max_concurrent_decodes else slot_rungs.slot_index(busy, Z, rung)
  lower = [b for b in rungs if b < rung]
  return index, (int(busy.sum()) - lower[-1] if lower and busy.sum() > lower[-1] else None)


def generate(engine: Engine, params, prompts: Sequence[Sequence[int]], n: int = 1,
             max_new_tokens: int | Sequence[int] | None = None,
             sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
             eos_ids: Sequence[int] = (), prompt_ids: Sequence[int] | None = None,
             refill_fraction: float = 0.125, stats: DecodeStats | None = None,
             on_finish: Callable[[], None] | None = None) -> list[Completion]:
  """Samples `n` responses for every prompt; returns completions ordered by (prompt, sample).

  Requests beyond the slot count wait in a queue and take slots as others finish; samples of one
  prompt that enter together share its prefill. Each request's randomness comes from (seed, prompt
  id, sample index, token step) alone, so results do not depend on the slot count or on which
  requests share a batch; `prompt_ids` (default: the prompts' indices; e.g. dataset row ids) make
  them independent of the prompts' order too. A response stops at any of `eos_ids` (kept, with its
  log-prob, as transformers / verl do) or after `max_new_tokens` (one for all or one per prompt; default:
  the engine's `max_decode_length`). A decode call returns to the host early once `refill_fraction` of the slots
  have finished while requests wait.

  A request enters a slot only when the slot's batch shard has free pages for its prompt and a page of
  headroom per busy slot (the free counts come back with each decode call); a slot that finds no page for its
  next token waits for others to return theirs. Each decode call runs at the smallest page budget that holds
  the busy slots' next steps (`budget.PagePolicy.page_budget`). RuntimeError if every busy slot waits (the pool is too small
  for the tokens in flight). `stats`, if given, accumulates the KV rows decode read and held. `on_finish()`, if
  given, is called as each response finishes; if it also has `begin(budget)` and `tokens(count)` (an
  `interface.Progress`), it hears the token budget of the call (responses x max_new_tokens) before the first
  decode, and after each decode call the budget that call used up (its tokens, and the rest of the budget of
  each response that stopped early), so a bar over them moves with the tokens and ends full.
  """
  max_new_tokens = engine.max_decode_length if max_new_tokens is None else max_new_tokens
  budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
  if len(budgets) != len(prompts):
    raise ValueError(f"{len(budgets)} max_new_tokens for {len(prompts)} prompts")
  for b in budgets:
    if not 0 < b <= engine.max_decode_length:
      raise ValueError(f"max_new_tokens {b} is not in [1, max_decode_length={engine.max_decode_length}]")
  prompts = [list(map(int, p)) for p in prompts]
  for p in prompts:
    engine.bucket_length(len(p))  # validates the length
  prompt_ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
  if len(prompt_ids) != len(prompts):
    raise ValueError(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")
  eos = tuple(sorted({int(e) for e in eos_ids}))
  eos_set = set(eos)
  B = engine.max_concurrent_decodes
  refill_at = max(1, int(B * refill_fraction))

  queue = collections.deque((p, s) for p in range(len(prompts)) for s in range(n))
  if not queue:
    return []
  progress = getattr(on_finish, "tokens", None)
  if progress is not None:
    on_finish.begin(n * sum(budgets))
  used = 0  # token budget used up since the last report
  slot_request: list[tuple[int, int] | None] = [None] * B
  slot_rows = np.zeros(B, np.int64)  # filled cache rows of each busy slot (the pending token's position)
  tokens: dict[tuple[int, int], list[int]] = {}
  logprobs: dict[tuple[int, int], list[float]] = {}
  done: dict[tuple[int, int], Completion] = {}
  state = engine.init_decode_state()
  free_pages = np.full(engine.page_shards, engine.pages_per_shard - 1, np.int64)

  def admit() -> tuple[list[tuple[int, int]], list[int]]:
    """Queued requests for free slots, in order (`admit_slots`)."""
    needs = (budget_lib.prompt_pages(len(prompts[p]), engine.page_size) for p, _ in queue)
    slots = admit_slots(needs, np.array([r is not None for r in slot_request]), free_pages)
    return [queue.popleft() for _ in slots], slots

  def finish(slot: int):
    nonlocal used
    req = slot_request[slot]
    toks = tokens.pop(req)
    used += budgets[req[0]] - len(toks)  # what a response that stopped early leaves
    reason = "eos" if toks and toks[-1] in eos_set else "length"
    done[req] = Completion(prompt_index=req[0], sample_index=req[1], tokens=toks,
                           logprobs=np.asarray(logprobs.pop(req), np.float32), finish_reason=reason)
    slot_request[slot] = None
    if on_finish is not None:
      on_finish()

  while queue or any(r is not None for r in slot_request):
    firsts = []
    take, taken_slots = admit()
    if not take and all(r is None for r in slot_request):  # cannot happen: kv_pages holds one slot's pages
      raise RuntimeError(f"no decode slot's batch shard has the KV pages for the next prompt "
                         f"({len(prompts[queue[0][0]])} tokens); raise rollout.kv_pages")
    if take:
      distinct = sorted({p for p, _ in take})
      row_of = {p: i for i, p in enumerate(distinct)}
      state, firsts = prefill_insert(
          engine, params, state, [prompts[p] for p in distinct], [row_of[p] for p, _ in take], taken_slots,
          [prompt_ids[p] for p, _ in take], [s for _, s in take], [budgets[p] for p, _ in take], seed, sampling, eos)
      for slot, req in zip(taken_slots, take):
        slot_request[slot] = req
        slot_rows[slot] = len(prompts[req[0]])
        tokens[req], logprobs[req] = [], []
    busy = np.array([r is not None for r in slot_request])
    index, tail_stop = tail_rung(engine, busy, bool(queue))
    stop_after = min(refill_at, len(queue)) if queue else (tail_stop or B + 1)
    rows_in, busy_in = (slot_rows, busy) if index is None else (slot_rows[index], busy[index])
    page_budget = engine.policy.page_budget(rows_in, busy_in)
    rung = {} if index is None else {"slots": index}  # (a call over every slot is the one made before the ladder)
    state, out = engine.decode(params, state, stop_after, sampling, eos, page_budget, **rung)
    # Host reads after the decode call is queued, so device work and transfers overlap.
    for first in firsts:
      for r, t, l in zip(first.requests, np.asarray(first.tokens).tolist(), np.asarray(first.logprobs).tolist()):
        tokens[take[r]].append(t)
        logprobs[take[r]].append(l)
    out = jax.device_get(out)
    call_rows, slot_rows = slot_rows, np.array(out.lengths, np.int64)  # (the rows the call started with)
    if stats is not None:
      # The fewest free pages after any step of the call.
      held = (engine.page_shards * (engine.pages_per_shard - 1) - int(np.sum(out.fewest_free_pages))) * engine.page_size
      stats.add_call(call_rows, busy, int(out.emitted.any(axis=0).sum()), engine.policy.rows_read(page_budget), held)
    free_pages = np.array(out.free_pages, np.int64)
    if out.active.any() and not out.emitted.any():
      in_flight = int(slot_rows[out.active].sum())
      raise RuntimeError(
          f"every busy decode slot is waiting for a KV page: {int(out.active.sum())} slots hold {in_flight} "
          f"tokens in flight, more than rollout.kv_pages={engine.kv_pages} pages of rollout.page_size="
          f"{engine.page_size} rows ({engine.page_shards} batch shards of {engine.pages_per_shard} pages, one "
          f"null each) can grow; raise rollout.kv_pages (0 = enough for every slot) or lower rollout.slots")
    for slot, req in enumerate(slot_request):
      if req is None:
        continue
      emitted = out.emitted[slot]
      tokens[req].extend(out.tokens[slot, emitted].tolist())
      logprobs[req].extend(out.logprobs[slot, emitted].tolist())
      used += int(emitted.sum())
      if not out.active[slot]:
        finish(slot)
    used += len(take)  # the first tokens, sampled by the prefill
    if progress is not None:
      progress(used)
      used = 0
  return [done[(p, s)] for p in range(len(prompts)) for s in range(n)]
