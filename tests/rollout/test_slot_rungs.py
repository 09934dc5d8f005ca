"""The slot ladder's host-side choices (rollout/slot_rungs.py, scheduler.tail_rung) and its cost (compile/
rollout_cost.py): which rung a call runs in, which slots it gathers, when the tail returns to drop a rung, and the
rollout's time outside the kernel step by step at each step's rung."""

import types

import numpy as np
import pytest

from pacs_jax.compile import rollout_cost
from pacs_jax.rollout import scheduler, slot_rungs


def test_the_ladder_halves_down_to_a_slot_a_shard():
  assert slot_rungs.ladder(2048, 32, 4) == (256, 512, 1024, 2048)
  assert slot_rungs.ladder(64, 32, 4) == (32, 64)  # never below a slot a shard
  assert slot_rungs.ladder(8, 1, 1) == (8,)  # one rung: no ladder
  assert slot_rungs.ladder(12, 4, 3) == (12,)  # 6 slots do not split over 4 shards


def test_a_rung_holds_the_busiest_shard_and_gathers_within_each_shard():
  busy = np.array([1, 0, 0, 0, 0, 0, 1, 1], bool)  # 2 shards of 4: one busy slot, then two
  assert slot_rungs.per_shard_busy(busy, 2) == 2
  assert slot_rungs.choose(busy, 2, (2, 4, 8)) == 4
  index = slot_rungs.slot_index(busy, 2, 4)
  # Shard 0's rows are its own slots (the busy one first), shard 1's its own: no row crosses a shard.
  assert index.tolist() == [0, 1, 6, 7]
  assert slot_rungs.choose(np.zeros(8, bool), 2, (2, 4, 8)) == 2
  with pytest.raises(ValueError, match="shard 1 has 2 busy slots"):
    slot_rungs.slot_index(busy, 2, 2)


def test_the_tail_returns_when_a_rung_down_would_hold_the_rest():
  engine = types.SimpleNamespace(slot_rungs=(2, 4, 8), page_shards=2, max_concurrent_decodes=8)
  busy = np.array([1, 1, 1, 0, 1, 1, 0, 0], bool)  # 5 busy: every slot's rung; 1 must finish for the 4-slot rung
  assert scheduler.tail_rung(engine, busy, queued=True) == (None, None)  # requests wait: every slot, refilled
  index, stop_after = scheduler.tail_rung(engine, busy, queued=False)
  assert index is None and stop_after == 1
  index, stop_after = scheduler.tail_rung(engine, np.array([1, 0, 0, 0, 1, 1, 0, 0], bool), queued=False)
  assert index.tolist() == [0, 1, 4, 5] and stop_after == 1
  one_rung = types.SimpleNamespace(slot_rungs=(8,), page_shards=2, max_concurrent_decodes=8)
  assert scheduler.tail_rung(one_rung, busy, queued=False) == (None, None)


def test_the_tail_is_costed_at_each_steps_rung():
  """Responses of mixed lengths on 8 slots: the steps with few busy slots cost the smaller rungs' time; without a
  ladder every step costs the full one. The kernel's reads and the roofline do not depend on the ladder."""
  rng = np.random.default_rng(0)
  responses = rng.integers(1, 200, size=32)
  prompts = np.full(32, 16)
  _, busy = rollout_cost.schedule(prompts, responses, 8)
  assert rollout_cost.rungs_of(busy, [2, 4, 8], 2).tolist() == [
      2 if -(-b // 2) <= 1 else 4 if -(-b // 2) <= 2 else 8 for b in busy]
  args = (1e3, 1e9, 4, 1e12)
  flat = rollout_cost.cost("x", prompts, responses, 8, 1e-3, *args)
  ladder = rollout_cost.cost("x", prompts, responses, 8, {8: 1e-3, 4: 0.6e-3, 2: 0.4e-3}, *args, shards=2)
  assert flat.outside_s == pytest.approx(flat.steps * 1e-3) and flat.rung_steps == {8: flat.steps}
  assert sum(ladder.rung_steps.values()) == ladder.steps == flat.steps and ladder.rung_steps[2] > 0
  assert ladder.outside_s == pytest.approx(sum({8: 1e-3, 4: 0.6e-3, 2: 0.4e-3}[b] * k
                                               for b, k in ladder.rung_steps.items()))
  assert ladder.outside_s < flat.outside_s
  assert (ladder.kernel_s, ladder.roofline_s) == (flat.kernel_s, flat.roofline_s)
