"""The built-in default: a tiny random Qwen2 learns the synthetic task on 2 CPU cores in minutes.

`--config configs/tiny_cpu.py` runs PACS; `configs/tiny_cpu.py:grpo`, `:ppo`, `:dapo`, `:drgrpo` and `:gspo` run
the baselines on the same task with learning rates that suit them.
"""

from pacs_jax.config import default_config


BASELINE_SETTINGS = {
    "grpo": {"steps": 300, "train.lr": 1e-3},
    "ppo": {"steps": 300, "train.lr": 1e-3, "ppo.critic_lr": 3e-3},
    # The GRPO family of today's verl (benchmarks/objectives_demo.py): GRPO's rate. DAPO's overlong buffer is the
    # last of the 4 tokens (a response that has not stopped by then loses the reward of a correct answer).
    "dapo": {"steps": 300, "train.lr": 1e-3, "dapo.overlong_buffer_len": 1},
    "drgrpo": {"steps": 300, "train.lr": 1e-3},
    "gspo": {"steps": 300, "train.lr": 1e-3},
}


def get_config(algorithm: str = "pacs"):
  c = default_config()
  c.algorithm = algorithm or "pacs"
  c.steps = 500
  c.model.preset = "tiny"
  c.model.vocab_size = 64  # the synthetic tokenizer's vocabulary
  c.tokenizer = "synthetic"
  c.data.train = "synthetic/mod3"
  c.data.val = "synthetic/mod3"
  c.data.instruction = ""  # the synthetic prompts carry no instruction (its words are not in the vocabulary)
  c.data.max_prompt_length = 16
  c.data.synthetic_val_size = 64
  c.rollout.n = 8  # released structure: n responses per prompt, RLOO, class weights
  c.rollout.max_new_tokens = 4
  c.train.batch_prompts = 16
  c.train.mini_batch_prompts = 8
  c.train.lr = 3e-3  # a tiny random model needs a far larger step than the released 1e-6 for 3B/7B
  c.train.weight_decay = 0.0
  c.eval_every = 10
  c.checkpoint.every = 50
  c.mesh.fsdp = 1
  # LoRA on this random base (`--config.lora.rank=8`; a full run ignores it) also trains the embeddings (tied to the
  # LM head) and the norms, peft's modules_to_save: frozen as drawn, they cap the right answer's probability below
  # 0.4 whatever the adapters do (docs/lora.md, "The demo"). A pretrained base needs none (the 7B configs set none).
  c.lora.modules_to_save = "embed_tokens,norm"
  # The baselines' own settings (at lr 3e-3 GRPO collapses its entropy and forgets the task).
  c.update_from_flattened_dict(BASELINE_SETTINGS.get(c.algorithm, {}))
  return c
