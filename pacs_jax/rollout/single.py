"""One prompt, one slot, one step at a time over an `Engine`'s slots: the request-at-a-time surface that
JetStream's orchestrator drives (through the adapter in `rollout/jetstream.py`). The batched rollout
(`scheduler.generate`) does not use it.

Shapes: B slots, T prompt bucket length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.rollout import decode as decode_lib
from pacs_jax.rollout.engine import Engine
from pacs_jax.rollout.decode_state import DecodeState, Prefix, SlotTokens

_INT32_MAX = np.iinfo(np.int32).max


class SingleRequest:
  """Prefill one prompt, insert it into one slot, step every slot once: with the engine's `sampling` and
  `eos_ids` (read at each call; EOS ids are a traced argument, so changing them recompiles nothing)."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._prefix_jit = jax.jit(self._prefix_impl, static_argnames=("sampling",))
    self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(0,))
    self._step_jit = jax.jit(self._step_impl, static_argnames=("sampling",), donate_argnums=(1,))

  def _prefix_impl(self, cache, logits, true_lengths, key_data, sampling):
    rows = jnp.arange(true_lengths.shape[0])
    return decode_lib.prefix_of_requests(cache, logits, true_lengths, rows, key_data, sampling)

  def _insert_impl(self, state, prefix, slots, budgets, eos_ids):
    return self.engine.constrain(decode_lib.insert_rows(state, prefix, slots, budgets, eos_ids))

  def _step_impl(self, params, state, eos_ids, sampling):
    state, out = decode_lib.decode_step(self.engine.model(params), state, sampling, eos_ids)
    return self.engine.constrain(state), self.engine.replicate(SlotTokens(tokens=out.tokens, valid=out.emitted,
                                                                          lengths=state.steps))

  def prefill(self, params, padded_tokens, true_length: int, key_data: jax.Array) -> Prefix:
    """KV cache of one prompt (`padded_tokens[:true_length]`) and its first token, sampled with the
    request's key data [1, *key] (see `decode.request_keys`)."""
    tokens = self.engine.pad_prompt(padded_tokens, true_length)
    lengths = np.array([true_length], np.int32)
    cache, logits = self.engine.prefill_batch(params, tokens, lengths)
    with self.engine.mesh_context():
      return self._prefix_jit(cache, logits, lengths, key_data, sampling=self.engine.sampling)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, budget: int | None = None) -> DecodeState:
    """Moves a single-prompt prefix into `slot` (the slot generates at most `budget` tokens)."""
    budget = _INT32_MAX if budget is None else budget
    with self.engine.mesh_context():
      return self._insert_jit(decode_state, prefix, np.array([slot], np.int32), np.array([budget], np.int32),
                              decode_lib.eos_array(self.engine.eos_ids))

  def step(self, params, decode_state: DecodeState) -> tuple[DecodeState, SlotTokens]:
    """One decode step for every slot: feeds the pending tokens, returns the new ones [B]."""
    with self.engine.mesh_context():
      return self._step_jit(params, decode_state, decode_lib.eos_array(self.engine.eos_ids),
                            sampling=self.engine.sampling)
