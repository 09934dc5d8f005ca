"""The public API's own functions (`pacs_jax` re-exports them beside the library functions it names as they are):
a config by name or path, a model with its tokenizer from a Hugging Face directory or a training workdir and back
to a Hugging Face directory, and text generation from prompts (docs/api.md)."""

from __future__ import annotations

import logging
import os
from typing import Sequence

import ml_collections

from pacs_jax import config as config_lib

CONFIGS_DIR = config_lib.CONFIGS_DIR  # the repository's configs/ folder beside the package


def load_config(name_or_path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
  """A run config: a config file's `get_config()` (`"configs/tiny_cpu.py"`), or a shipped config by name
  (`"tiny_cpu"`, `"qwen3b_v5p"`: `configs/<name>.py` of the repository the package was installed from), with
  dotted-key `overrides` (`{"steps": 20, "train.lr": 1e-6}`) applied as `--config.<field>=` does.

  `pacs_jax/config/defaults.py` documents every field; `train` validates the config before building anything.
  """
  path = name_or_path
  if not os.path.isfile(path) and os.sep not in path and not path.endswith(".py"):
    path = config_lib.shipped_config_path(name_or_path)
  return config_lib.load_config_file(path, overrides)


def load_pretrained(path: str, *, step: int | None = None, dtype=None):
  """`(model, tokenizer)` from a Hugging Face model directory (or hub id) or from a training workdir.

  A workdir gives its policy at checkpoint `step` (default: the newest that restores) in the dtype it was
  trained in, on one device; a Hugging Face directory gives its weights in `dtype` (float32 by default, or
  bfloat16: a name, a jnp or a NumPy type), and tokenizer None (with a warning) when it holds none. The model is a Flax NNX module (`model(input_ids, attention_mask)` -> logits [B, T, V]); the
  tokenizer a transformers tokenizer with the checkpoint's chat template. `save_pretrained` writes them back.
  """
  from pacs_jax import paths
  from pacs_jax.data import tokenizers
  from pacs_jax.models import hf
  from pacs_jax.storage import hf_export, workdir
  if hf_export.is_workdir(path):
    model, _ = hf_export.load_policy(path, step)
    with paths.local_dir(workdir.model_dir(path)) as model_dir:
      return model, tokenizers.load_tokenizer(model_dir)
  if step is not None:
    raise ValueError(f"{path}: step={step} names a checkpoint, but this is a Hugging Face directory, not a workdir")
  weights = config_lib.dtype(dtype or "float32")
  model, _ = hf.load_pretrained(path, dtype=weights, compute_dtype=weights)
  try:
    return model, tokenizers.load_tokenizer(hf.resolve_path(path))
  except tokenizers.NoTokenizer as e:
    logging.getLogger(__name__).warning("%s: the model is returned without a tokenizer", e)
    return model, None


def save_pretrained(model, out_dir: str, tokenizer=None, max_shard_size: int | str | None = "5GB", dtype=None,
                    generation_config: dict | None = None) -> None:
  """Writes a directory `transformers.AutoModelForCausalLM.from_pretrained` (and AutoTokenizer) loads unchanged:
  the weights and config.json (`pacs_jax.models.hf.save_pretrained`), and with a tokenizer, the tokenizer and
  `generation_config` (default: `tokenizers.generation_config(tokenizer)`) as generation_config.json.

  All processes take part (the weights are gathered); only process 0 writes. Files are split at `max_shard_size`
  with a `model.safetensors.index.json`, as transformers does. `dtype` (e.g. jnp.bfloat16) converts on the way
  out.
  """
  from pacs_jax.storage import hf_export
  hf_export.save_model_dir(model, out_dir, tokenizer, max_shard_size=max_shard_size, dtype=dtype,
                        generation_config=generation_config)


def generate(model, tokenizer, prompts: Sequence[str], *, n: int = 1, max_new_tokens: int = 256,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             instruction: str | None = None, stop_tokens: str = "released", slots: int = 64) -> list[list[str]]:
  """`n` responses to each prompt, as text: `[prompt][sample]`.

  Each prompt is a user message rendered with the tokenizer's chat template, `instruction` appended after one
  space (the trainer's `data.instruction`; None for none). `temperature` 0 decodes greedily; otherwise
  `top_k` (> 0) or `top_p` (< 1) may restrict the sampling, not both. A response ends at a stop token
  (`stop_tokens`: "released" | "chat" | comma-separated ids, as `rollout.stop_tokens`) or after
  `max_new_tokens`. The trainer's rollout engine does the work (paged KV cache, `slots` responses at once);
  the result depends on `seed` and the prompts alone.
  """
  from pacs_jax.data import prompts as prompts_lib
  from pacs_jax.rollout import local as local_rollout
  from pacs_jax.rollout import sampling as sampling_lib
  from pacs_jax.rollout import stop_tokens as stop_tokens_lib
  prompt_ids = [ids.tolist() for ids in prompts_lib.encode_prompts(tokenizer, list(prompts), instruction)]
  if not prompt_ids:
    return []
  eos_ids, _ = stop_tokens_lib.stop_and_mask_ids(tokenizer, None, stop_tokens)
  sampler = local_rollout.LocalRollout(model, slots=min(slots, len(prompt_ids) * n),
                                       max_prompt_length=max(map(len, prompt_ids)), max_new_tokens=max_new_tokens,
                                       eos_ids=eos_ids)
  sampler.set_weights(model, version=0)
  completions = sampler.generate(prompt_ids, n=n, max_new_tokens=max_new_tokens,
                                 sampling=sampling_lib.from_config(temperature, top_k, top_p), seed=seed)
  texts: list[list[str]] = [[""] * n for _ in prompt_ids]
  for c in completions:
    texts[c.prompt_index][c.sample_index] = tokenizer.decode(c.tokens, skip_special_tokens=True)
  return texts
