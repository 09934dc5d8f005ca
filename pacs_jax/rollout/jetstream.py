"""Adapter from the rollout `Engine` to google-jetstream's `engine_api.Engine` (the optional `jetstream`
extra, 0.2.2), so JetStream's orchestrator (`Driver` + `LLMOrchestrator`) can serve the policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

# jetstream 0.2.2 still calls `jax.tree_map`, which current jax removed.
if not hasattr(jax, "tree_map"):
  jax.tree_map = jax.tree.map

from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2  # noqa: E402

from pacs_jax.rollout import engine as engine_lib  # noqa: E402

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


class JetStreamEngine(engine_api.Engine):
  """Serves an `engine_lib.Engine` through JetStream 0.2.2's Engine ABC.

  JetStream 0.2.2 streams only the tokens `generate` returns, so `prefill` keeps the prompt's last
  token pending (`Engine.prefill_deferred`) and each generate step emits one response token. Stop
  tokens end a stream without being streamed (JetStream's convention; the in-process `generate`
  keeps the EOS token).
  """

  def __init__(self, engine: engine_lib.Engine, params: Any = None, tokenizer: TokenizerAdapter | None = None):
    if engine.max_prefill_length not in JETSTREAM_BUCKETS:
      raise ValueError(f"max_prefill_length {engine.max_prefill_length} must be one of JetStream's prefill "
                       f"buckets {JETSTREAM_BUCKETS}")
    self.engine = engine
    self._params = params
    self._tokenizer = tokenizer or TokenizerAdapter(engine.eos_ids)

  def load_params(self, params: Any = None, *args, **kwargs) -> Any:
    return self.engine.load_params(self._params if params is None else params)

  def prefill(self, *, params: Any, existing_prefix: Any = None, padded_tokens: jax.Array,
              true_length: int) -> engine_lib.Prefix:
    if existing_prefix is not None:
      raise NotImplementedError("prefix caching (existing_prefix) is not supported")
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
    # JetStream keeps the last max_prefill_length tokens of a longer prompt but reports its full length.
    true_length = min(true_length, len(tokens))
    if true_length > 0 and tokens[0] == NO_BOS:
      tokens, true_length = tokens[1:], true_length - 1
    return self.engine.prefill_deferred(params, tokens, true_length)

  def insert(self, prefix: engine_lib.Prefix, decode_state: engine_lib.DecodeState,
             slot: int) -> engine_lib.DecodeState:
    return self.engine.insert(prefix, decode_state, slot)

  def generate(self, params: Any, decode_state: engine_lib.DecodeState):
    decode_state, result = self.engine.generate(params, decode_state)
    return decode_state, engine_api.ResultTokens(
        data=result.data, tokens_idx=result.tokens_idx, valid_idx=result.valid_idx,
        length_idx=result.length_idx, samples_per_slot=result.samples_per_slot)

  def get_prefix_destination_sharding(self) -> Any:
    shardings = self.engine.prefix_shardings()
    return shardings if shardings is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="pacs-jax")

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenizerAdapter:
    del metadata
    return self._tokenizer

  def init_decode_state(self, *args, **kwargs) -> engine_lib.DecodeState:
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
