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
    text = json.dumps(dataclasses.asdict(self), sort_keys=True)
    return f"base-{self.task}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def model_config(settings: WarmupSettings):
  from pacs_jax.models import families
  return families.preset(settings.preset, vocab_size=len(synthetic_tasks.VOCAB))


def supervised_rows(tokenizer, records: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Left-padded rows `prompt, answer, <|im_end|>`: (ids [B, T], attention mask [B, T], loss mask [B, T]); the loss
  mask marks the positions whose next token is a target (the answer and the end marker)."""
  prompt_ids = prompts_lib.encode_prompts(tokenizer, [r["problem"] for r in records], None)
  end = tokenizer.convert_tokens_to_ids(synthetic_tasks.IM_END)
  targets = [[tokenizer.convert_tokens_to_ids(r["answer"]), end] for r in records]
  T = max(len(p) for p in prompt_ids) + 2
  ids = np.full((len(records), T), tokenizer.pad_token_id, np.int32)
  attention = np.zeros((len(records), T), np.int32)
  loss_mask = np.zeros((len(records), T), np.float32)
  for i, (p, t) in enumerate(zip(prompt_ids, targets)):
    row = np.concatenate([p, t])
    ids[i, T - len(row):] = row
    attention[i, T - len(row):] = 1
    loss_mask[i, T - 3:T - 1] = 1.0  # the last prompt token predicts the answer, the answer predicts the end
  return ids, attention, loss_mask


def train_base_model(settings: WarmupSettings, tokenizer):
  """The warmed-up policy (a `decoder.CausalLM`) and its last loss; same settings, same weights."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from pacs_jax.models import families

  model = families.causal_lm(model_config(settings), rngs=nnx.Rngs(settings.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = optax.adamw(settings.lr, weight_decay=0.0)
  opt_state = optimizer.init(params)
  task = synthetic_tasks.get_task(settings.task)
  records = task.draw(settings.steps * settings.batch, settings.seed, held_out=False, terms=settings.terms)
  ids, attention, loss_mask = supervised_rows(tokenizer, records)

  def loss_fn(params, ids, attention, loss_mask):
    logits = nnx.merge(graphdef, params)(ids, attention).astype(jnp.float32)  # [B, T, V]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    mask = loss_mask[:, :-1]
    return jnp.sum(nll * mask) / jnp.sum(mask)

  @jax.jit
  def step(params, opt_state, ids, attention, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids, attention, loss_mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  loss = float("nan")
  for i in range(settings.steps):
    rows = slice(i * settings.batch, (i + 1) * settings.batch)
    params, opt_state, loss = step(params, opt_state, ids[rows], attention[rows], loss_mask[rows])
  nnx.update(model, params)
  return model, float(loss)


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
