"""Your own problems and model, small enough to try on a laptop CPU: give the two fields it leaves empty.

  python -m pacs_jax.train --config configs/own_model.py --config.model.hf_path=DIR --config.data.train=my.jsonl

`model.hf_path`: a local transformers Qwen2.5, Qwen3 or Llama 3 directory (config.json, *.safetensors, tokenizer
files; docs/models.md) or a hub id (Qwen/Qwen2.5-0.5B); the tokenizer is the model's own (`config.tokenizer`
empty). `data.train`: .jsonl / .json / .parquet files of {"problem": ..., "answer": ...} rows (comma-separated), or
hf://owner/name; the released math instruction is appended to each problem and math-verify scores the \\boxed{}
answer. Set `data.val` to validate.
For a real run, raise the batch and lengths below (or start from configs/qwen1p5b_1gpu.py).
"""

from pacs_jax.config import default_config


def get_config(algorithm: str = "pacs"):
  c = default_config()
  c.algorithm = algorithm or "pacs"
  c.steps = 100
  c.model.preset = ""  # no random model: model.hf_path is required
  c.model.hf_path = ""  # required
  c.tokenizer = ""  # the model's own
  c.data.train = ""  # required
  c.data.val = ""  # e.g. my_val.jsonl; validated every eval_every steps
  c.data.max_prompt_length = 256
  c.rollout.n = 4
  c.rollout.max_new_tokens = 256
  c.train.batch_prompts = 4
  c.train.mini_batch_prompts = 4
  c.train.lr = 1e-6  # the released rate for Qwen2.5 3B / 7B
  # Responses of mixed length: the update and log-prob passes compute real tokens only (use_remove_padding=True).
  c.train.packing = True
  c.eval_every = 10
  c.checkpoint.every = 20
  c.rollout_data_dir = ""  # e.g. runs/own_model-pacs/rollouts: one JSONL of prompts, responses and scores per step
  return c
