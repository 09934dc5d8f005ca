"""Checkpoint -> Hugging Face export: restores only the policy parameters and writes them with `hf.save_pretrained`."""

from __future__ import annotations

import os

import jax
from flax import nnx

from pacs_jax.models import hf, qwen2
from pacs_jax.train import checkpoint as checkpoint_lib
from pacs_jax.train.memory import DTYPES

MODEL_DIR = "model"  # workdir/model: the policy's HF config.json and tokenizer, written when training starts


def write_model_card(workdir: str, config: qwen2.Qwen2Config, tokenizer) -> None:
  """Saves what export needs besides weights (process 0 only)."""
  if jax.process_index() != 0:
    return
  import json
  path = os.path.join(workdir, MODEL_DIR)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config.to_hf_dict(), f, indent=2)
  tokenizer.save_pretrained(path)


def load_policy(workdir: str, step: int | None = None) -> tuple[qwen2.Qwen2ForCausalLM, int]:
  """The policy of a training checkpoint (default: the latest) on one device; the optimizer state is never read."""
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"{workdir}/checkpoints: no checkpoint found")
    param_dtype = DTYPES[ckpt.restore_config(step)["model"]["param_dtype"]]
    config = hf.load_config(os.path.join(workdir, MODEL_DIR), param_dtype=param_dtype, dtype=param_dtype)
    abstract = nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)
    params = ckpt.restore_params(step, target)
  finally:
    ckpt.close()
  return nnx.merge(graphdef, params), step


def export(workdir: str, out_dir: str, step: int | None = None, dtype: str | None = None,
           max_shard_size: str | int | None = "5GB") -> str:
  """Writes the checkpoint's policy as a Hugging Face directory (weights, config.json, tokenizer)."""
  model, _ = load_policy(workdir, step)
  hf.save_pretrained(model, out_dir, tokenizer=hf.load_tokenizer(os.path.join(workdir, MODEL_DIR)),
                     max_shard_size=max_shard_size, dtype=DTYPES[dtype] if dtype else None)
  return out_dir
