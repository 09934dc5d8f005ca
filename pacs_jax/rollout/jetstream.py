"""Adapter from the rollout `Engine` to google-jetstream's `engine_api.Engine` (the optional `jetstream`
extra, 0.2.2), so JetStream's orchestrator (`Driver` + `LLMOrchestrator`) can serve the policy, one request at a time
(`single.SingleRequest`).

Shapes: B slots (or prompts in a prefill), T prompt bucket length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from pacs_jax.models import kv_cache
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout.decode import request_keys
from pacs_jax.rollout.single import SingleRequest
from pacs_jax.rollout.decode_state import DecodeState, Prefix, SlotTokens, field_shardings

# JetStream prepends `bos_id` to every request without a session cache; Qwen has no BOS, so the
# tokenizer reports this impossible id and `prefill` drops it again.
NO_BOS = -1
# JetStream's prefill buckets; its padding helper needs max_prefill_length to be one of them.
JETSTREAM_BUCKETS = tuple(1 << p for p in range(4, 16))


class TokenizerAdapter(tokenizer_api.Tokenizer):
  """JetStream tokenizer: token ids in and out (client-side tokenization), or text through an
  optional transformers tokenizer. Streaming stops at any of `eos_ids`."""

  def __init__(self, eos_ids: Sequence[int], pad_id: int = 0, hf_tokenizer: Any = None):
    if not eos_ids:
      raise ValueError("JetStream needs at least one stop token id")
    self._eos_ids = tuple(int(e) for e in eos_ids)
    self._pad_id = pad_id
    self.hf_tokenizer = hf_tokenizer

  def encode(self, s: str, **kwargs):
    if self.hf_tokenizer is None:
      raise ValueError("text requests need a transformers tokenizer; send token_content instead")
    tokens = np.asarray(self.hf_tokenizer.encode(s, add_special_tokens=False), np.int32)
    return token_utils.pad_tokens(tokens, self.bos_id, self.pad_id, is_bos=kwargs.pop("is_bos", True),
                                  prefill_lengths=kwargs.pop("prefill_lengths", None),
                                  max_prefill_length=kwargs.pop("max_prefill_length", None),
                                  jax_padding=kwargs.pop("jax_padding", True))

  def decode(self, token_ids: list[int], **kwargs) -> str:
    if self.hf_tokenizer is None:
      return ""  # ids only: the client detokenizes
    return self.hf_tokenizer.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def eos_id(self) -> int:
    return self._eos_ids[0]

  @property
  def bos_id(self) -> int:
    return NO_BOS

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._eos_ids)


def _delete_pytree(tree) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()


def _fix_orchestrator() -> None:
  """jetstream 0.2.2's orchestrator frees each inserted prefix with `jax.tree_map`, which jax removed
  (its only use of it): that one function gets `jax.tree.map`'s equivalent; `jax` itself is not patched.
  Importing the orchestrator sets the root logger to DEBUG with a stdout handler; that is undone."""
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from jetstream.core import orchestrator  # pylint: disable=import-outside-toplevel
  root.setLevel(level)
  root.handlers[:] = handlers
  orchestrator.delete_pytree = _delete_pytree


@jax.jit
def _result_data(out: SlotTokens) -> jax.Array:
  return jnp.stack([out.tokens, out.valid.astype(jnp.int32), out.lengths], axis=-1)  # [B, 3]


def result_tokens(out: SlotTokens) -> engine_api.ResultTokens:
  """JetStream's one-array layout of slot tokens: columns [token, valid, length], one row per slot."""
  return engine_api.ResultTokens(data=_result_data(out), tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                 samples_per_slot=1)


@jax.jit
def _deferred_prefix(cache, tokens, true_lengths, key_data) -> Prefix:
  """A prefix whose last prompt token stays pending (its cache row is rewritten, identically, when it is
  fed), so the first generate step emits the first response token. tokens [B, T], true_lengths [B]."""
  B = tokens.shape[0]
  last = jnp.take_along_axis(tokens, (true_lengths - 1)[:, None], axis=1)[:, 0]  # [B]
  return Prefix(cache=cache, lengths=true_lengths - 1, tokens=last, logprobs=jnp.zeros((B,), jnp.float32),
                keys=key_data, steps=jnp.zeros((B,), jnp.int32))


class JetStreamEngine(engine_api.Engine):
  """Serves an `engine_lib.Engine` through JetStream 0.2.2's Engine ABC.

  JetStream 0.2.2 streams only the tokens `generate` returns, so `prefill` keeps the prompt's last
  token pending and each generate step (`SingleRequest.step`) emits one response token. Stop tokens end a
  stream without being streamed (JetStream's convention; `scheduler.generate` keeps the EOS token).
  Request r (counted from 1) samples with key data `request_keys(engine.seed, r, 0)`.
  """

  def __init__(self, engine: engine_lib.Engine, params: Any = None, tokenizer: TokenizerAdapter | None = None):
    if engine.max_prefill_length not in JETSTREAM_BUCKETS:
      raise ValueError(f"max_prefill_length {engine.max_prefill_length} must be one of JetStream's prefill "
                       f"buckets {JETSTREAM_BUCKETS}")
    if engine.kv_pages:
      raise ValueError(f"JetStream inserts without checking free KV pages: rollout.kv_pages must be 0 (enough "
                       f"pages for every slot), got {engine.kv_pages}")
    _fix_orchestrator()
    self.engine = engine
    self.single = SingleRequest(engine)
    self._params = params
    self._tokenizer = tokenizer or TokenizerAdapter(engine.eos_ids)
    self._requests = 0

  def load_params(self, params: Any = None, *args, **kwargs) -> Any:
    return self.engine.load_params(self._params if params is None else params)

  def prefill(self, *, params: Any, existing_prefix: Any = None, padded_tokens: jax.Array,
              true_length: int) -> Prefix:
    if existing_prefix is not None:
      raise NotImplementedError("prefix caching (existing_prefix) is not supported")
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
    # JetStream keeps the last max_prefill_length tokens of a longer prompt but reports its full length.
    true_length = min(true_length, len(tokens))
    if true_length > 0 and tokens[0] == NO_BOS:
      tokens, true_length = tokens[1:], true_length - 1
    row = self.engine.pad_prompt(tokens, true_length)
    lengths = np.array([true_length], np.int32)
    self._requests += 1
    key_data = request_keys(jnp.uint32(self.engine.seed), jnp.array([self._requests]), jnp.zeros((1,), jnp.int32))
    cache, _ = self.engine.prefill_batch(params, row, lengths)
    with self.engine.mesh_context():
      return _deferred_prefix(cache, row, lengths, key_data)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    return self.single.insert(prefix, decode_state, slot)

  def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, engine_api.ResultTokens]:
    decode_state, out = self.single.step(params, decode_state)
    with self.engine.mesh_context():
      return decode_state, result_tokens(out)

  def get_prefix_destination_sharding(self) -> Any:
    """A `Prefix` of shardings for one prompt, each field's declared one (any bucket length fits)."""
    if self.engine.mesh is None:
      return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    c = self.engine.config
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    rows = shape(c.num_hidden_layers, 1, c.num_key_value_heads, self.engine.max_prefill_length, c.head_size)
    key = jax.random.key_data(jax.random.key(0)).shape
    probe = Prefix(cache=kv_cache.KVCache(k=rows, v=rows), lengths=shape(1), tokens=shape(1), logprobs=shape(1),
                   keys=shape(1, *key), steps=shape(1))
    return field_shardings(probe, self.engine.mesh)

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="pacs-jax")

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenizerAdapter:
    del metadata
    return self._tokenizer

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    return self.engine.init_decode_state()

  @property
  def max_concurrent_decodes(self) -> int:
    return self.engine.max_concurrent_decodes

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.engine.max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return self.engine.mesh

  @property
  def colocated_cpus(self) -> None:
    return None
