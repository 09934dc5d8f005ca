"""The read-budget policy of paged decode: which page budgets (live (slot, page) pairs a batch shard's decode
step reads, the J of `models.paged.live_pairs`) decode programs are compiled for, which one a call runs at,
and what it reads. Pure host-side arithmetic; the `Engine` holds one `PagePolicy`.

Shapes: B slots, Z batch shards (B / Z slots each), M pages per slot, ps page size, L cache rows per slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def pow2_ladder(start: int, cap: int, half_steps: bool = False) -> list[int]:
  """Powers of two from `start` (rounded up), capped by and ending at `cap`; with `half_steps` also 1.5x
  each power of two (a budget is then at most 1.5x, not 2x, what it must hold)."""
  steps = [next_pow2(start) << i for i in range(max(1, cap).bit_length() + 1)]
  if half_steps:
    steps += [3 * b // 2 for b in steps if b > 1]
  return sorted({min(b, cap) for b in steps if b >= start or b >= cap})


def prompt_pages(length: int, page_size: int) -> int:
  """Pages a request with a prompt of `length` tokens takes when it is inserted."""
  return -(-length // page_size)


@dataclasses.dataclass(frozen=True)
class PagePolicy:
  """The page budgets of an engine's decode programs and the choice of one per decode call.

  A page budget is per batch shard: every shard's step reads that many (slot, page) pairs (padding pairs
  included), so a call's budget must hold the busiest shard. Live pages track the tokens in flight closely
  (not the longest row), so the ladder steps finely: powers of two and 1.5x them, from one page a slot up to
  every page of a shard's slots. The TPU kernel walks each slot's live pages itself: one program, the top
  budget.
  """
  page_size: int  # ps
  shards: int  # Z
  cache_length: int  # L
  steps_per_call: int
  page_budgets: tuple[int, ...]  # the ladder, ascending; its top holds every page of a shard's slots

  @classmethod
  def of(cls, slots: int, shards: int, cache_length: int, page_size: int, steps_per_call: int,
         kernel: bool) -> PagePolicy:
    """The policy of `slots` slots over `shards` pools; `kernel`: decode attends in the TPU kernel."""
    per_shard = slots // shards
    ladder = pow2_ladder(per_shard, per_shard * prompt_pages(cache_length, page_size), half_steps=True)
    return cls(page_size=page_size, shards=shards, cache_length=cache_length, steps_per_call=steps_per_call,
               page_budgets=tuple(ladder[-1:] if kernel else ladder))

  def clamp(self, page_budget: int | None) -> int:
    """`page_budget` capped at the top of the ladder (None: the top)."""
    top = self.page_budgets[-1]
    return top if page_budget is None else min(int(page_budget), top)

  def page_budget(self, rows: np.ndarray, busy: np.ndarray) -> int:
    """The smallest page budget that holds the next `steps_per_call` steps of slots with `rows` [B] filled
    rows (busy [B] bool; an idle slot reads one null row)."""
    ahead = np.minimum(np.asarray(rows) + self.steps_per_call, self.cache_length)
    pages = np.where(busy, -(-ahead // self.page_size), 1).reshape(self.shards, -1).sum(axis=1)  # [Z]
    need = int(pages.max())
    return next((b for b in self.page_budgets if b >= need), self.page_budgets[-1])

  def rows_read(self, page_budget: int) -> int:
    """KV rows one decode step reads, every shard's slots together, at `page_budget`."""
    return page_budget * self.shards * self.page_size
