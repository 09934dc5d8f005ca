"""The laptop study's "base model": a tiny Qwen2 taught the graded task's easy part by a short supervised warm-up
(plain next-token cross-entropy on the answer, AdamW), saved as a Hugging Face directory and cached by its settings."""

# Why: the paper post-trains a base model that already solves some problems with low probability (pass@1 low,
# pass@256 far above it). A random tiny model has no such prior; a warm-up on the one- and two-term sums only
# gives one: it answers with residues, right on easy sums, guessing on longer ones.

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from pacs_jax.data import prompts as prompts_lib
from pacs_jax.data import synthetic_tasks

DONE_FILE = "warmup.json"  # written last: a directory without it is an interrupted build


@dataclasses.dataclass(frozen=True)
class WarmupSettings:
  task: str = "sum11"
  terms: tuple[int, ...] = (1, 2)  # the part of the distribution the base model is taught
  steps: int = 200  # about half learnt: right on half the trained sums, on a sixth of held-out 2-term sums
  batch: int = 64
  lr: float = 3e-3
  seed: int = 0
  preset: str = "tiny"

  def key(self) -> str:
    """A name for the cache: a hash of every setting (another setting, another model)."""
    return settings_key(self.task, self)


def settings_key(name: str, settings) -> str:
  """`base-<name>-<hash of every field of the dataclass settings>`: a cached base model's folder name."""
  text = json.dumps(dataclasses.asdict(settings), sort_keys=True)
  return f"base-{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def model_config(settings: WarmupSettings):
  from pacs_jax.models import families
  return families.preset(settings.preset, vocab_size=len(synthetic_tasks.VOCAB))


def supervised_rows(tokenizer, records: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Left-padded rows `prompt, answer, <|im_end|>`: (ids [B, T], attention mask [B, T], loss mask [B, T]); the loss
  mask marks the positions whose next token is a target (the answer and the end marker)."""
  from pacs_jax.trainer import warm_base

  prompt_ids = prompts_lib.encode_prompts(tokenizer, [r["problem"] for r in records], None)
  end = tokenizer.convert_tokens_to_ids(synthetic_tasks.IM_END)
  rows = [([int(t) for t in p] + [tokenizer.convert_tokens_to_ids(r["answer"]), end], [0] * len(p) + [1, 1])
          for p, r in zip(prompt_ids, records)]
  return warm_base.left_padded(rows, tokenizer.pad_token_id)


def train_base_model(settings: WarmupSettings, tokenizer):
  """The warmed-up policy (a `decoder.CausalLM`) and its last loss; same settings, same weights."""
  from flax import nnx

  from pacs_jax.models import families
  from pacs_jax.trainer import warm_base

  model = families.causal_lm(model_config(settings), rngs=nnx.Rngs(settings.seed))
  task = synthetic_tasks.get_task(settings.task)
  records = task.draw(settings.steps * settings.batch, settings.seed, held_out=False, terms=settings.terms)
  ids, attention, loss_mask = supervised_rows(tokenizer, records)
  loss = warm_base.fit(model, ids, attention, loss_mask, steps=settings.steps, batch=settings.batch, lr=settings.lr)
  return model, loss


def base_model_dir(settings: WarmupSettings, cache_dir: str) -> str:
  """The warmed-up model's Hugging Face directory under `cache_dir`, built once (a few seconds) and reused."""
  from pacs_jax.storage import hf_export

  out = os.path.join(cache_dir, settings.key())
  if os.path.isfile(os.path.join(out, DONE_FILE)):
    return out
  tokenizer = synthetic_tasks.build_tokenizer()
  model, loss = train_base_model(settings, tokenizer)
  os.makedirs(cache_dir, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".warmup-", dir=cache_dir)
  hf_export.save_model_dir(model, staging, tokenizer)
  with open(os.path.join(staging, DONE_FILE), "w") as f:
    json.dump({"settings": dataclasses.asdict(settings), "final_loss": loss}, f, indent=2)
  shutil.rmtree(out, ignore_errors=True)  # an interrupted build's leftovers
  try:
    os.replace(staging, out)
  except OSError:  # another process built it meanwhile: theirs is the same model
    shutil.rmtree(staging, ignore_errors=True)
  return out
