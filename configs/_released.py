"""The released recipe (docs/algorithm.md; ritzz-ai/PACS scripts/pacs/pacs_beta_1.0.sh, scripts/baseline/grpo.sh, ppo.sh and
configs/ppo_trainer.yaml) shared by the full-size configs; each config picks model, mesh and batch split."""

from pacs_jax.config import default_config

DEEPSCALER = "hf://agentica-org/DeepScaleR-Preview-Dataset"
MATH500 = "hf://HuggingFaceH4/MATH-500"


def released_recipe(preset: str, hf_path: str, algorithm: str = "pacs"):
  """`algorithm`: "pacs" (scripts/pacs/pacs_beta_1.0.sh), "grpo" or "ppo" (scripts/baseline/*.sh)."""
  c = default_config()
  c.algorithm = algorithm or "pacs"
  c.steps = 300
  c.model.preset = preset  # shapes for --dry_run; weights come from hf_path
  c.model.hf_path = hf_path  # a local directory or a hub id (downloaded once with huggingface_hub)
  c.model.param_dtype = "float32"  # AdamW on fp32 master weights
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.attention_chunk = 512  # 4,608-token rows: fp32 scores for 512 queries at a time, not all 4,608
  c.data.train = DEEPSCALER
  # Greedy validation every 5 steps, accuracy per data source. The released runs validate on GSM8K, MATH-500,
  # AIME 2024/2025 and AMC23: pass --config.data.val_dir=DIR (a folder of <name>/test.jsonl, as tests/fixtures/data)
  # to validate on all five; without it, MATH-500 from the hub. After training, `python -m pacs_jax.evaluate`
  # reports pass@k on them.
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
  # The released PACS actor never clips (pacs_actor.py _optimizer_step); verl's GRPO/PPO actor and critic clip at 1.
  c.train.grad_clip = {"pacs": 0.0}.get(c.algorithm, 1.0)
  c.train.verl_micro_batch_rows = 8  # ppo_micro_batch_size_per_gpu (actor and critic)
  # use_remove_padding=True: the update and the log-prob passes compute real tokens only (docs/training.md). At every
  # response's max length it costs 1.4% more than the padded rows (qwen3b_v5p's train step, 35.33 G cycles against
  # 34.84 G: the LM head also reads the prompts' positions); real runs' responses are far shorter.
  c.train.packing = True
  c.rollout.stop_tokens = "released"  # tokenizer EOS + generation_config EOS; mask to the first EOS
  c.pacs.beta = 1.0
  c.pacs.adv_estimator = "rloo"
  c.pacs.use_weight = True
  c.pacs.weight_mode = "question"
  # The released code's reference is the policy that sampled each step (old_log_prob, computed once before any
  # update; r̂ = 0 on every step's first mini-batch). "frozen" (the initial model) is this project's option.
  c.pacs.reference_policy = "rollout"
  c.pacs.exact_padding_replication = False  # True adds verl's first-padding-position term to r̂ (docs/differences.md)
  c.grpo.loss_agg_mode = "seq-mean-token-sum-norm"
  c.grpo.use_kl_loss = False
  c.grpo.entropy_coeff = 0.0
  c.ppo.loss_agg_mode = "seq-mean-token-sum-norm"
  c.ppo.entropy_coeff = 0.0
  c.ppo.critic_lr = 1e-5
  c.ppo.cliprange_value = 0.5
  c.ppo.gamma, c.ppo.lam = 1.0, 1.0
  c.eval_every = {"ppo": 0}.get(c.algorithm, 5)  # ppo.sh sets trainer.test_freq=-1
  c.checkpoint.every = 20
  c.checkpoint.keep = 0  # trainer.max_actor_ckpt_to_keep: null keeps every checkpoint
  c.reward_workers = 8
  return c
