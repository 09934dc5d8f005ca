"""The page-budget policy (`rollout/budget.py`): the ladder of compiled page budgets, the budget a decode call
runs at (the busiest shard's live pages for the next steps), and the rows a budget reads. Pure host arithmetic."""

import numpy as np
import pytest

from pacs_jax.rollout import budget

# 8 slots over 2 batch shards (4 each), 56 cache rows in pages of 8 (7 a slot), 8 steps a call.
POLICY = budget.PagePolicy.of(slots=8, shards=2, cache_length=56, page_size=8, steps_per_call=8, kernel=False)


def test_the_ladder_steps_by_powers_of_two_and_half_steps_up_to_every_page():
  assert budget.pow2_ladder(16, 64) == [16, 32, 64]
  assert budget.pow2_ladder(16, 40) == [16, 32, 40]  # capped by, and ending at, the cap
  assert budget.pow2_ladder(3, 40, half_steps=True) == [4, 6, 8, 12, 16, 24, 32, 40]
  assert POLICY.page_budgets == (4, 6, 8, 12, 16, 24, 28)  # a page a slot .. 4 slots x 7 pages
  # The TPU kernel walks live pages itself: one program, at every page.
  assert budget.PagePolicy.of(8, 2, 56, 8, 8, kernel=True).page_budgets == (28,)
  assert budget.next_pow2(1) == 1 and budget.next_pow2(5) == 8 and budget.next_pow2(8) == 8


@pytest.mark.parametrize("rows,busy,expected", [
    # Idle slots read one null row (a page) each: 4 a shard.
    ([0] * 8, [False] * 8, 4),
    # Shard 0: slot 0 at row 9 needs rows up to 17 for 8 more steps: 3 pages, plus 3 idle = 6.
    ([9, 0, 0, 0, 0, 0, 0, 0], [True] + [False] * 7, 6),
    # Shard 1 is the busiest: 4 slots at row 30 -> 38 rows = 5 pages each, 20 pages: the budget 24 holds it.
    ([9, 0, 0, 0, 30, 30, 30, 30], [True, False, False, False, True, True, True, True], 24),
    # Rows ahead are capped at the cache: 4 full slots need every page.
    ([0, 0, 0, 0, 55, 55, 55, 50], [False] * 4 + [True] * 4, 28),
])
def test_a_call_runs_at_the_smallest_budget_that_holds_the_busiest_shard(rows, busy, expected):
  assert POLICY.page_budget(np.array(rows), np.array(busy)) == expected


def test_rows_read_prompt_pages_and_clamp():
  assert POLICY.rows_read(6) == 6 * 2 * 8  # every shard reads the budget's pages of 8 rows
  assert [budget.prompt_pages(n, 8) for n in (1, 8, 9, 16)] == [1, 1, 2, 2]
  assert POLICY.clamp(None) == 28 and POLICY.clamp(12) == 12 and POLICY.clamp(100) == 28
