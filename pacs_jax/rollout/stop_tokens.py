"""Which token ids end a response (`rollout.stop_tokens`): the released rule (verl's vLLM rollout), the chat
rule, or ids given by hand, read against the tokenizer and the model directory's generation config."""

from __future__ import annotations

import json
import os

from pacs_jax.data.tokenizers import GENERATION_CONFIG_FILE

# Qwen2.5 ends a chat turn with <|im_end|> and a document with <|endoftext|>; both stop a response.
QWEN_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def eos_token_ids(tokenizer, model_dir: str | None = None) -> tuple[int, ...]:
  """Ids that end a response: the tokenizer's EOS, Qwen's stop tokens, and generation_config.json's."""
  ids = {tokenizer.eos_token_id} - {None}
  vocab = tokenizer.get_vocab()
  ids.update(vocab[token] for token in QWEN_STOP_TOKENS if token in vocab)
  ids.update(generation_eos_ids(model_dir) or ())
  if not ids:
    raise ValueError("the tokenizer has no EOS token, so responses could not stop")
  return tuple(sorted(ids))


def _as_ids(value) -> tuple[int, ...] | None:
  if isinstance(value, bool) or value is None:
    return None
  if isinstance(value, int):
    return (value,)
  if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
    return tuple(value)
  return None


def generation_eos_ids(model_dir: str | None) -> tuple[int, ...] | None:
  """`eos_token_id` of the model's generation config: generation_config.json, else config.json (None when
  neither names one). verl's get_generation_config (verl/utils/model.py) and vLLM's try_get_generation_config
  both read GenerationConfig.from_pretrained and fall back to GenerationConfig.from_model_config(config)."""
  if not model_dir:
    return None
  for name in (GENERATION_CONFIG_FILE, "config.json"):
    path = os.path.join(model_dir, name)
    if os.path.isfile(path):
      with open(path) as f:
        return _as_ids(json.load(f).get("eos_token_id"))
  return None


def parse_stop_tokens(value) -> str | tuple[int, ...] | None:
  """rollout.stop_tokens -> "released" | "chat" | a tuple of ids; None when it is none of these."""
  if value in ("released", "chat"):
    return value
  if isinstance(value, int) and not isinstance(value, bool):
    return (value,)
  try:
    ids = tuple(int(v) for v in str(value).split(",") if v.strip())
  except ValueError:
    return None
  return ids if ids and min(ids) >= 0 else None


def stop_and_mask_ids(tokenizer, model_dir: str | None, stop_tokens: str = "released"
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(ids that stop a response, ids whose first occurrence ends the response mask) for `rollout.stop_tokens`.

  "released" replicates verl's vLLM rollout (vllm_rollout_spmd.py) and fsdp_workers.generate_sequences: vLLM
  stops on the tokenizer's EOS plus the generation config's EOS ids (SamplingParams.update_from_generation_config)
  and keeps the stop token; the mask is get_response_mask(response, generation_config.eos_token_id), or the
  tokenizer's EOS when the model has no generation config. "chat": `eos_token_ids`; explicit ids: those. For
  both, the mask ends at the stop token.
  """
  mode = parse_stop_tokens(stop_tokens)
  if mode is None:
    raise ValueError(f'stop_tokens must be "released", "chat" or comma-separated ids, got {stop_tokens!r}')
  if mode == "chat":
    ids = eos_token_ids(tokenizer, model_dir)
    return ids, ids
  if mode != "released":
    return tuple(sorted(set(mode))), tuple(sorted(set(mode)))
  tokenizer_eos = {tokenizer.eos_token_id} - {None}
  generation = generation_eos_ids(model_dir)
  stop = tuple(sorted(tokenizer_eos | set(generation or ())))
  mask = tuple(sorted(set(generation))) if generation else tuple(sorted(tokenizer_eos))
  if not stop or not mask:
    raise ValueError("neither the tokenizer nor the model's generation config names an EOS token, so responses "
                     "could not stop")
  return stop, mask
