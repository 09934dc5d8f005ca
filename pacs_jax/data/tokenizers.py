"""A model directory's tokenizer and generation_config.json, read and written (its weights and config.json are
`pacs_jax.models.hf`'s): the checkpoint's own tokenizer through transformers, or the synthetic tasks' word-level
one, written in a form transformers reads and read back as itself."""

from __future__ import annotations

import json
import os

from pacs_jax.data import synthetic_tasks

GENERATION_CONFIG_FILE = "generation_config.json"
# Any of these makes a directory hold a tokenizer (fast, sentencepiece or BPE vocabulary, or its config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class NoTokenizer(FileNotFoundError):
  """A model directory with weights but no tokenizer files."""


def has_tokenizer(directory: str) -> bool:
  return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def load_tokenizer(directory: str):
  """The tokenizer of a local model directory (with its chat template), via transformers (a hub id: resolve it
  first with `pacs_jax.models.hf.resolve_path`); NoTokenizer, one line, for a directory without one (transformers
  would stop with a cut-off message).

  A tokenizer saved as a plain `tokenizers` model (PreTrainedTokenizerFast / TokenizersBackend) is
  loaded as exactly that: AutoTokenizer would pick the class from config.json's model_type (qwen2)
  and rebuild a byte-level BPE from the vocabulary, silently changing a word-level tokenizer.
  """
  from transformers import AutoTokenizer, PreTrainedTokenizerFast
  if os.path.isdir(directory) and not has_tokenizer(directory):
    raise NoTokenizer(f"{directory}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy the model's tokenizer "
                      "there or name one with config.tokenizer")
  tokenizer_config = os.path.join(directory, "tokenizer_config.json")
  if os.path.isfile(tokenizer_config):
    with open(tokenizer_config) as f:
      if json.load(f).get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
        # An export's portable form of the synthetic tokenizer decodes without spaces: use the word-level one.
        return synthetic_tasks.build_tokenizer() if synthetic_tasks.is_synthetic_vocab(tokenizer) else tokenizer
  return AutoTokenizer.from_pretrained(directory)


def generation_config(tokenizer, model_dir: str | None = None) -> dict:
  """generation_config.json for a model directory: the source model's own when it has one (the released stop
  rule reads its eos_token_id), the synthetic task's EOS pair, else the tokenizer's ids (what transformers derives
  from config.json)."""
  if model_dir and os.path.isfile(os.path.join(model_dir, GENERATION_CONFIG_FILE)):
    with open(os.path.join(model_dir, GENERATION_CONFIG_FILE)) as f:
      return json.load(f)
  if synthetic_tasks.is_synthetic_vocab(tokenizer):
    return synthetic_tasks.generation_config(tokenizer)
  return {k: v for k, v in (("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id),
                            ("pad_token_id", tokenizer.pad_token_id)) if v is not None}


TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_token_ids(tokenizer, model_dir: str | None = None) -> dict:
  """The special ids config.json records (`hf.save_pretrained(token_ids=...)`): the source model's own from
  `model_dir/config.json` where it has them (Qwen's tokenizer has no BOS token, its config.json a bos_token_id),
  else the tokenizer's."""
  source = {}
  if model_dir and os.path.isfile(os.path.join(model_dir, "config.json")):
    with open(os.path.join(model_dir, "config.json")) as f:
      source = json.load(f)
  return {k: source[k] if source.get(k) is not None else getattr(tokenizer, k) for k in TOKEN_ID_FIELDS}


def save_tokenizer(tokenizer, directory: str, generation: dict | None = None) -> None:
  """Writes the tokenizer as `transformers.AutoTokenizer` loads it, and `generation` (default:
  `generation_config(tokenizer)`) as generation_config.json."""
  # AutoTokenizer makes a Qwen2Tokenizer of any qwen2 directory: the synthetic vocabulary goes in the form it reads.
  portable = synthetic_tasks.portable_tokenizer() if synthetic_tasks.is_synthetic_vocab(tokenizer) else tokenizer
  portable.save_pretrained(directory)
  with open(os.path.join(directory, GENERATION_CONFIG_FILE), "w") as f:
    json.dump(generation if generation is not None else generation_config(tokenizer), f, indent=2)


def pad_token_id(tokenizer) -> int:
  """The tokenizer's pad id, or its EOS when it has none (verl's set_pad_token_id)."""
  if tokenizer.pad_token_id is not None:
    return tokenizer.pad_token_id
  if tokenizer.eos_token_id is None:
    raise ValueError("the tokenizer has neither a pad nor an EOS token")
  return tokenizer.eos_token_id
