"""The released PACS recipe (PACS.md) shared by the full-size configs; each config picks model, mesh and batch split."""

from pacs_jax.config import default_config

DEEPSCALER = "hf://agentica-org/DeepScaleR-Preview-Dataset"
MATH500 = "hf://HuggingFaceH4/MATH-500"


def released_recipe(preset: str, hf_path: str):
  c = default_config()
  c.algorithm = "pacs"
  c.steps = 300
  c.model.preset = preset  # shapes for --dry_run; weights come from hf_path
  c.model.hf_path = hf_path  # a local directory or a hub id (downloaded once with huggingface_hub)
  c.model.param_dtype = "float32"  # AdamW on fp32 master weights
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.attention_chunk = 512  # 4,608-token rows: fp32 scores for 512 queries at a time, not all 4,608
  c.data.train = DEEPSCALER
  # Greedy validation every 5 steps, accuracy per data source. Add the other evaluation sets from local
  # files with --config.data.val=math500/test.jsonl,aime2024/test.jsonl,aime2025/test.jsonl,amc23/test.jsonl
  # (see README "Data"); after training, `python -m pacs_jax.evaluate` reports pass@k on all of them.
  c.data.val = MATH500
  c.data.max_prompt_length = 512
  c.data.skip_bad_rows = True  # a long run logs and counts malformed rows instead of stopping
  c.rollout.n = 8
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.max_new_tokens = 4096
  c.train.batch_prompts = 1024
  c.train.mini_batch_prompts = 256  # 4 optimizer updates per step
  c.train.lr = 1e-6
  c.train.schedule = "constant"
  c.train.weight_decay = 0.01
  c.train.grad_clip = 1.0
  c.pacs.beta = 1.0
  c.pacs.adv_estimator = "rloo"
  c.pacs.use_weight = True
  c.pacs.weight_mode = "question"
  # This project's default reference is the frozen initial model. The released code uses the policy that
  # sampled each step (r̂ = 0 on every step's first mini-batch): set --config.pacs.reference_policy=rollout
  # to replicate the paper's numbers exactly (PACS.md, "Reference policy").
  c.pacs.reference_policy = "frozen"
  c.eval_every = 5
  c.checkpoint.every = 20
  c.checkpoint.keep = 3
  c.reward_workers = 8
  return c
