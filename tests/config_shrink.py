"""One place that shrinks a shipped config to the tiny model so CI can run it end to end through the CLI.

Every field of a config is either KEPT (the run's recipe: algorithm, remat, compute dtype, reference policy,
loss and optimizer settings, validation and checkpoint cadence...) or SHRUNK by a rule below (model size,
batch sizes, lengths, mesh, data, worker counts). A field with neither raises: a new config field cannot
silently escape the end-to-end test.
"""

from __future__ import annotations


import ml_collections

from pacs_jax import sharding
from pacs_jax.algos import algorithms as registry
from pacs_jax.data import synthetic_tasks

# Kept exactly as the config sets them. A trailing ".*" keeps a whole group: `hardware` and `distributed`
# describe the target machine, not what a step computes. Every registered algorithm's settings block (pacs,
# grpo, ppo, dapo, ...) is the algorithm, kept whole (`_kept`).
KEEP = (
    "seed", "algorithm", "model.param_dtype", "model.dtype", "model.remat", "model.remat_policy",
    "data.skip_bad_rows", "data.val_max_examples",
    "rollout.n", "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.val_max_new_tokens",
    "rollout.stop_tokens", "rollout.slot_rungs",
    "rollout.tis_imp_ratio_cap", "rollout.tis_level", "rollout.mode", "rollout.max_staleness", "rollout.devices",
    "rollout_data_dir",
    "validation_data_dir",
    "train.lr", "train.schedule", "train.warmup_steps", "train.min_lr_ratio", "train.weight_decay", "train.b1",
    "train.b2", "train.eps", "train.grad_clip", "train.verl_micro_batch_rows", "train.keep_logits",
    "train.packing", "train.packing_rungs",
    "lora.alpha", "lora.targets", "lora.use_rslora", "lora.lr_multiplier", "lora.modules_to_save",
    "checkpoint.every", "checkpoint.keep", "checkpoint.async_save", "checkpoint.restore",
    "checkpoint.lock_stale_after_s", "checkpoint.allow_changes",
    "eval_every", "log_every", "reward_timeout_s", "reward.fn", "rollout.engine",
    "env.name", "env.cpu_seconds", "env.wall_seconds", "env.memory_mb",
    "hardware.*", "compile.*", "distributed.*", "health.*", "wandb.*",
)

CPU_DEVICES = 8  # tests/conftest.py's simulated devices
STEPS = 2
PROMPT_LENGTH, NEW_TOKENS = 16, 8
CHUNK = 8  # attention_chunk at tiny lengths: 24-token rows still attend in 3 blocks
# A tool config (env.name "python_tool") shrinks to the tool demo's task, whose words only its tokenizer has, at
# lengths that hold a call, its observation and the answer.
TOOL_TASK, TOOL_NEW_TOKENS = "synthetic/mul53", 64


def _fields(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  out = []
  for key, value in cfg.items():
    name = f"{prefix}{key}"
    out += _fields(value, f"{name}.") if isinstance(value, ml_collections.ConfigDict) else [name]
  return out


def _kept(field: str) -> bool:
  if field.split(".")[0] in registry.names():
    return True
  return any(field == k or (k.endswith(".*") and field.startswith(k[:-1])) for k in KEEP)


def shrink(cfg: ml_collections.ConfigDict) -> tuple[dict, int]:
  """(overrides {dotted field: value} that make `cfg` a tiny CPU run, the number of CPU devices it needs)."""
  c = cfg
  # Mesh: the same axes, each cut down, on at most 8 CPU devices (tensor and data at most 2).
  total = c.hardware.num_devices or 1
  sizes = sharding.mesh_sizes(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, total)
  tensor, data = min(sizes["tensor"], 2), min(sizes["data"], 2)
  fsdp = min(sizes["fsdp"], CPU_DEVICES // (tensor * data))
  devices = data * fsdp * tensor
  # Batches: up to 2 micro-batches per mini-batch (one prompt each when the config splits mini-batches: gradient
  # accumulation runs the same program for 2 as for the 7B recipes' 256, which took 4,096 rollouts a step and most
  # of CI's longest test) and up to 2 mini-batches (optimizer updates) per step.
  t = c.train
  micro_per_mini = min(t.mini_batch_prompts // (t.micro_batch_prompts or t.mini_batch_prompts), 2)
  minibatches = min(t.batch_prompts // t.mini_batch_prompts, 2)
  micro = 1 if t.micro_batch_prompts else 0
  mini = micro_per_mini if micro else min(t.mini_batch_prompts, 2)
  batch = mini * minibatches
  slots = 0
  if c.rollout.slots:  # as many slots per rollout row as the config has: requests still queue
    slots = max(8, 8 * round(c.rollout.slots * batch / t.batch_prompts / 8))
  tools = c.env.name != "single_turn"
  task = TOOL_TASK if tools else "synthetic/mod3"
  rules = {
      "steps": STEPS,
      "model.preset": "tiny", "model.hf_path": "",
      "model.warmup": "",  # the tool demo's warm-up (half a minute) has its own test (tests/train/test_tool_demo_learns.py)
      "model.vocab_size": len(synthetic_tasks.TOOL_VOCAB if tools else synthetic_tasks.VOCAB),
      "model.attention_chunk": CHUNK if c.model.attention_chunk else 0,
      "model.attention_impl": "auto",  # the kernel of the machine the test runs on (CPU: xla)
      "tokenizer": "synthetic_tools" if tools else "synthetic",
      "data.train": task, "data.val": task if c.data.val or c.data.val_dir else "",
      "data.val_dir": "",
      "data.synthetic_train_size": max(64, 2 * batch), "data.synthetic_val_size": 8,
      "data.max_prompt_length": PROMPT_LENGTH, "data.instruction": "",
      "rollout.max_new_tokens": TOOL_NEW_TOKENS if tools else NEW_TOKENS, "rollout.slots": slots,
      # Pages of 8 rows (3 a slot at these lengths); a pool sized for the full model's lengths means nothing here.
      "rollout.page_size": 8, "rollout.kv_pages": 0,
      "train.batch_prompts": batch, "train.mini_batch_prompts": mini, "train.micro_batch_prompts": micro,
      "train.logits_chunk": 4 if c.train.logits_chunk else 0,  # 8 new tokens: still two chunks
      # Packed rows of the tiny lengths (a config's own row length is sized for its own): P + R, or twice that.
      "train.packing_row_tokens": 0 if not c.train.packing_row_tokens else 2 * (PROMPT_LENGTH + NEW_TOKENS),
      "train.packing_rows": 0,  # a micro-batch's rows (a config's own budget is sized for its own batch)
      "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
      "reward_workers": min(c.reward_workers, 2),
      "lora.rank": min(c.lora.rank, 8),  # LoRA stays on (or off); the tiny model's k projection is [64, 32]
      "env.workers": min(c.env.workers, 2),
      # The tool demo's bounds: a call, its observation and the answer (a 1 KB observation at 64 new tokens
      # only compiles bigger continue programs, at several minutes of CPU a run).
      "env.max_turns": min(c.env.max_turns, 3), "env.output_bytes": min(c.env.output_bytes, 160),
  }
  fields = _fields(c)
  unknown = [f for f in fields if not _kept(f) and f not in rules]
  if unknown:
    raise KeyError(f"config fields {unknown} have no rule in tests/config_shrink.py: add each to KEEP or to "
                   "the shrink rules, so the end-to-end config test runs what the config means")
  stale = sorted(set(rules) - set(fields))
  if stale:
    raise KeyError(f"tests/config_shrink.py has rules for fields the config lacks: {stale}")
  return rules, devices


def kept_fields(cfg: ml_collections.ConfigDict) -> list[str]:
  return [f for f in _fields(cfg) if _kept(f)]
