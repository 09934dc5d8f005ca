"""JetStream: the Engine API in process, and google-jetstream's real orchestrator driving the adapter."""

import asyncio
import logging
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax.models import families as registry
from pacs_jax.rollout import decode, scheduler
from pacs_jax.rollout import engine as engine_lib

# Must import (not skip): google-jetstream is installed with the `jetstream` extra in CI.
from pacs_jax.rollout import jetstream as jetstream_adapter
from pacs_jax.rollout.single import SingleRequest
from pacs_jax.rollout.decode_state import SlotTokens

MAX_NEW = 12
# 6 requests on 4 slots. At most 15 tokens: JetStream prepends a BOS slot to each prompt (dropped by
# the adapter) and keeps only the last max_prefill_length = 16 tokens.
PROMPT_LENGTHS = (5, 11, 3, 15, 8, 2)


def _import_orchestrator():
  # jetstream's orchestrator module sets the root logger to DEBUG with a stdout handler on import;
  # keep the rest of the test session's logging as it was.
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from jetstream.core import orchestrator
  from jetstream.core.proto import jetstream_pb2
  root.setLevel(level)
  root.handlers[:] = handlers
  return orchestrator, jetstream_pb2


@pytest.fixture(scope="module")
def setup():
  config = registry.preset("tiny")
  model = registry.causal_lm(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, config.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]
  engine = engine_lib.Engine(model, max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=16)
  # Scaled-up random weights: greedy then does not just repeat one token.
  params = jax.tree.map(lambda x: 4 * x, engine.load_params(model))
  reference = scheduler.generate(engine, params, prompts, max_new_tokens=MAX_NEW)
  # An EOS id that greedy emits mid-way for one prompt, so some streams stop early. The JetStream
  # methods (`SingleRequest`) read `engine.eos_ids` (a traced argument: setting it recompiles nothing).
  eos = reference[1].tokens[6]
  engine.eos_ids = (eos,)
  expected = scheduler.generate(engine, params, prompts, max_new_tokens=MAX_NEW, eos_ids=[eos])
  assert any(c.finish_reason == "eos" for c in expected) and any(c.finish_reason == "length" for c in expected)
  return engine, params, prompts, expected


def _columns(slot_data):
  return slot_data.tokens, slot_data.valid, slot_data.lengths


def test_engine_api_prefill_insert_generate(setup):
  """One prompt, one slot, one step on the in-process engine, read through JetStream's ResultTokens:
  prefill samples the first token."""
  engine, params, prompts, expected = setup
  single = SingleRequest(engine)
  state = engine.init_decode_state()
  streams = {}
  for slot, i in [(2, 0), (0, 3), (3, 1)]:
    padded = np.zeros(16, np.int32)
    padded[:len(prompts[i])] = prompts[i]
    prefix = single.prefill(params, padded, len(prompts[i]), decode.request_keys(0, np.array([i]), np.array([0])))
    first = jetstream_adapter.result_tokens(SlotTokens(tokens=prefix.tokens, valid=prefix.steps > 0,
                                                       lengths=prefix.steps))
    tokens, valid, lengths = _columns(first.convert_to_numpy().get_result_at_slot(0))
    assert valid[0, 0] == 1 and lengths[0] == 1
    streams[slot] = (i, [int(tokens[0, 0])])
    state = single.insert(prefix, state, slot)
  for _ in range(MAX_NEW - 1):
    state, out = single.step(params, state)
    result = jetstream_adapter.result_tokens(out).convert_to_numpy()
    for slot, (_, stream) in streams.items():
      tokens, valid, lengths = _columns(result.get_result_at_slot(slot))
      if valid[0, 0]:
        stream.append(int(tokens[0, 0]))
        assert lengths[0] == len(stream)
  for i, stream in streams.values():
    assert stream == expected[i].tokens


def test_orchestrator_matches_in_process_generate(setup, monkeypatch):
  engine, params, prompts, expected = setup
  orchestrator, jetstream_pb2 = _import_orchestrator()
  # JetStream kills the process when a driver thread raises; record the error and fail the test instead.
  errors = []

  def run(thread):
    try:
      threading.Thread.run(thread)
    except Exception as e:
      errors.append(e)

  monkeypatch.setattr(orchestrator.JetThread, "run", run)
  adapter = jetstream_adapter.JetStreamEngine(engine)
  assert isinstance(adapter, jetstream_adapter.engine_api.Engine)
  driver = orchestrator.Driver(prefill_engines=[adapter], generate_engines=[adapter], prefill_params=[params],
                               generate_params=[params], interleaved_mode=True)
  client = orchestrator.LLMOrchestrator(driver=driver)

  async def decode(tokens):
    request = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=tokens), max_tokens=MAX_NEW)
    out = []
    async for response in client.Decode(request):
      for sample in response.stream_content.samples:
        out.extend(sample.token_ids)
    return out

  async def all_requests():
    try:
      work = asyncio.gather(*(decode(p) for p in prompts))
      while not work.done():
        if errors:  # a dead driver thread would leave the streams waiting forever
          work.cancel()
          raise errors[0]
        await asyncio.wait([work], timeout=0.2)
      return work.result()
    finally:
      # Stop (and join) the driver while the loop still runs: JetStream's detokenize thread closes a
      # stream with two call_soon_threadsafe calls, and the client may finish between them; once
      # asyncio.run has closed the loop, the second raises "Event loop is closed" in that thread.
      await asyncio.to_thread(driver.stop)

  try:
    streamed = asyncio.run(asyncio.wait_for(all_requests(), timeout=300))
  finally:
    driver.stop()  # idempotent; covers a failure before the loop started
  assert not errors, errors
  for got, want in zip(streamed, expected):
    # JetStream ends a stream at a stop token without streaming it.
    assert got == (want.tokens[:-1] if want.finish_reason == "eos" else want.tokens)


def test_adapter_rejects_non_jetstream_bucket():
  config = registry.preset("tiny")
  model = nnx.eval_shape(lambda: registry.causal_lm(config, rngs=nnx.Rngs(0)))
  engine = engine_lib.Engine(model, max_concurrent_decodes=2, max_prefill_length=24, max_decode_length=8,
                             eos_ids=[1])
  with pytest.raises(ValueError, match="buckets"):
    jetstream_adapter.JetStreamEngine(engine)


def test_adapter_leaves_jax_unpatched(setup):
  """jetstream 0.2.2's one jax.tree_map call is fixed in its orchestrator, not by patching jax."""
  jetstream_adapter.JetStreamEngine(setup[0])
  assert not hasattr(jax, "tree_map")
