"""Checkpoint -> Hugging Face export: restores only the policy parameters and writes them with `hf.save_pretrained`.

Workdirs and outputs may be local or `gs://`; reading a workdir never creates or deletes anything in it.
"""

from __future__ import annotations

import json

import jax
from flax import nnx

from pacs_jax import paths
from pacs_jax.models import hf, qwen2
from pacs_jax.train import checkpoint as checkpoint_lib
from pacs_jax.train.memory import DTYPES

MODEL_DIR = "model"  # workdir/model: the policy's HF config.json and tokenizer, written when training starts
CHECKPOINT_DIR = "checkpoints"


def write_model_card(workdir: str, config: qwen2.Qwen2Config, tokenizer) -> None:
  """Saves what export needs besides weights (process 0 only)."""
  if jax.process_index() != 0:
    return
  with paths.staged_dir(paths.join(workdir, MODEL_DIR), last=(hf.CONFIG_FILE,)) as local:
    tokenizer.save_pretrained(local)
    with open(f"{local}/{hf.CONFIG_FILE}", "w") as f:
      json.dump(config.to_hf_dict(), f, indent=2)


def open_checkpoints(workdir: str) -> checkpoint_lib.Checkpointer:
  """The workdir's checkpoints, read-only; FileNotFoundError (creating nothing) when there are none."""
  directory = paths.join(workdir, CHECKPOINT_DIR)
  if not paths.isdir(workdir):
    raise FileNotFoundError(f"{paths.normalize(workdir)}: no such workdir")
  if not paths.isdir(directory):
    raise FileNotFoundError(f"{paths.normalize(workdir)}: not a training workdir (it has no {CHECKPOINT_DIR}/)")
  ckpt = checkpoint_lib.Checkpointer(directory, read_only=True)
  if not ckpt.all_steps():
    ckpt.close()
    raise FileNotFoundError(f"{directory}: no complete checkpoint (has the run saved one yet?)")
  return ckpt


def latest_step(workdir: str) -> int:
  ckpt = open_checkpoints(workdir)
  try:
    return ckpt.latest_step()
  finally:
    ckpt.close()


def load_policy(workdir: str, step: int | None = None) -> tuple[qwen2.Qwen2ForCausalLM, int]:
  """The policy of a training checkpoint on one device; the optimizer state is never read. Default: the
  newest checkpoint that restores (a damaged newer one is skipped with a warning)."""
  ckpt = open_checkpoints(workdir)
  try:
    with paths.local_dir(paths.join(workdir, MODEL_DIR)) as model_dir:
      if not paths.isfile(f"{model_dir}/{hf.CONFIG_FILE}"):
        raise FileNotFoundError(f"{paths.join(workdir, MODEL_DIR)}: missing {hf.CONFIG_FILE} (written when "
                                "training starts)")

      def restore(s: int) -> qwen2.Qwen2ForCausalLM:
        param_dtype = DTYPES[ckpt.restore_config(s)["model"]["param_dtype"]]
        config = hf.load_config(model_dir, param_dtype=param_dtype, dtype=param_dtype)
        abstract = nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(config, rngs=nnx.Rngs(0)))
        graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)
        return nnx.merge(graphdef, ckpt.restore_params(s, target))

      if step is not None:
        if step not in ckpt.all_steps():
          raise FileNotFoundError(f"{ckpt.directory}: no checkpoint of step {step} (there are {ckpt.all_steps()})")
        return restore(step), step
      step, model = ckpt.restore_newest(restore)
      return model, step
  finally:
    ckpt.close()


def export(workdir: str, out_dir: str, step: int | None = None, dtype: str | None = None,
           max_shard_size: str | int | None = "5GB") -> str:
  """Writes the checkpoint's policy as a Hugging Face directory (weights, config.json, tokenizer)."""
  model, _ = load_policy(workdir, step)
  with paths.local_dir(paths.join(workdir, MODEL_DIR)) as model_dir:
    tokenizer = hf.load_tokenizer(model_dir)  # read whole: no file of it is needed afterwards
  # config.json goes last: a directory that has it is complete (evaluate relies on this).
  with paths.staged_dir(out_dir, last=(hf.CONFIG_FILE,)) as local:
    hf.save_pretrained(model, local, tokenizer=tokenizer, max_shard_size=max_shard_size,
                       dtype=DTYPES[dtype] if dtype else None)
  return paths.normalize(out_dir)
