"""The tool demo: a tiny Qwen2 on `a * b mod 53` (synthetic/mul53) with a Python tool, on 2 CPU cores.

A response is a conversation (env.name "python_tool"): a turn whose last ```python block holds code runs it in the
sandbox and its output returns as the tool's turn; a turn without one is the answer. The product table is more than
the tiny model can hold; one call, `print( a * b % 53 )` (the tokenizer "synthetic_tools" writes the call's opening
and closing as single words), computes it. The base model (`model.warmup`, trainer/warm_base.py: half a minute, once
per workdir) was taught the call on a sister prompt form (`a * b % 53`) and calls on the task's own form 3% of the
time, guessing otherwise: its reward starts near chance (0.02-0.05), and RL has to learn to call on every problem.
PACS and GRPO share every setting: `--config configs/tiny_tools_cpu.py` runs PACS, `:grpo` GRPO.
"""

from pacs_jax.config import default_config
from pacs_jax.data import synthetic_tasks


def get_config(algorithm: str = "pacs"):
  c = default_config()
  c.algorithm = algorithm or "pacs"
  c.steps = 300
  c.model.preset = "tiny"
  c.model.warmup = "mul53_tools"
  c.model.vocab_size = len(synthetic_tasks.TOOL_VOCAB)  # the tool tokenizer's vocabulary
  c.tokenizer = "synthetic_tools"
  c.data.train = "synthetic/mul53"
  c.data.val = "synthetic/mul53"
  c.data.instruction = ""
  c.data.max_prompt_length = 16
  c.data.synthetic_val_size = 64
  c.env.name = "python_tool"
  c.env.max_turns = 3
  # Short observations: a failed program's message (a syntax error's is about 100 bytes) is cut to fit the
  # conversation (its words are mostly <unk>, one token each).
  c.env.output_bytes = 160
  c.env.workers = 2
  c.rollout.n = 8
  # A call (8 tokens), its observation (10 tokens for a number, about 35 for an error) and the answer (2).
  c.rollout.max_new_tokens = 64
  c.train.batch_prompts = 16
  c.train.mini_batch_prompts = 8
  c.train.lr = 3e-4  # the warmed-up base's call breaks at 1e-3 (syntax errors) before it is learnt
  c.train.weight_decay = 0.0
  c.eval_every = 10
  c.checkpoint.every = 50
  c.mesh.fsdp = 1
  return c
