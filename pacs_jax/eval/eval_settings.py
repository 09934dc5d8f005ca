"""Evaluation's settings: `eval_config()` (the training config's field names, defaults as the released
inference.py, checked by `config.validate_eval`) and the `EvalSettings` the runner takes."""

from __future__ import annotations

import dataclasses

import ml_collections

from pacs_jax import config as config_lib
from pacs_jax.data import synthetic_tasks
from pacs_jax.rewards import named as reward_named


def eval_config() -> ml_collections.ConfigDict:
  """Evaluation's defaults, the released inference.py's sampling, under the training config's field names."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict()
  c.model.dtype = "bfloat16"  # weights and compute
  c.data = ml_collections.ConfigDict()
  c.data.max_prompt_length = 1024  # longer prompts are dropped (and counted), never truncated
  c.rollout = ml_collections.ConfigDict()
  c.rollout.n = 32  # samples per problem
  c.rollout.temperature = 0.6  # 0: greedy
  c.rollout.top_p = 0.95
  c.rollout.top_k = 0
  c.rollout.max_new_tokens = 4096
  c.rollout.slots = 256  # concurrent decodes, each with a KV cache of max_prompt_length + max_new_tokens rows
  c.rollout.stop_tokens = "released"
  c.mesh = ml_collections.ConfigDict()
  c.mesh.tensor = 1  # devices per model replica
  c.reward_workers = 4
  c.reward_timeout_s = 10.0
  c.reward = ml_collections.ConfigDict()
  c.reward.fn = reward_named.BUILTIN  # "package.module:function", as training's
  # The environment each sample is a conversation with (training's `env` block and defaults): "single_turn", or
  # "python_tool" (docs/tools.md: pass@k with the tool, each sample a conversation scored by its episode).
  c.env = ml_collections.ConfigDict(config_lib.default_config().env.to_dict())
  return c


# With only synthetic data sets (`--data synthetic/mod3`, the demo's task), the flags left unset take the demo's sizes
# (configs/tiny_cpu.py: 16-token prompts, 4 new tokens, float32) and its validation set's 64 problems, instead of
# the released math settings (4,096 new tokens; all 4,096 generated problems).
SYNTHETIC_DEFAULTS = {"rollout.max_new_tokens": 4, "data.max_prompt_length": 16, "model.dtype": "float32",
                      "rollout.slots": 64}
SYNTHETIC_LIMIT = 64
# The tool task (`synthetic/mul53`) at the tool demo's sizes (configs/tiny_tools_cpu.py): with the tool, three turns,
# short observations and room for a call, its output and the answer.
TOOL_TASK_DEFAULTS = {**SYNTHETIC_DEFAULTS, "rollout.max_new_tokens": 64, "env.name": "python_tool",
                      "env.max_turns": 3, "env.output_bytes": 160, "env.workers": 2}


def synthetic_defaults(specs) -> dict:
  """The defaults of flags left unset when every data set is a synthetic task: the demo's, or the tool demo's."""
  tool = any(isinstance(synthetic_tasks.get_task(spec), synthetic_tasks.ProductTask) for spec in specs)
  return TOOL_TASK_DEFAULTS if tool else SYNTHETIC_DEFAULTS


# EvalSettings field -> the `eval_config()` field it is.
CONFIG_FIELDS = {
    "n": "rollout.n", "temperature": "rollout.temperature", "top_k": "rollout.top_k", "top_p": "rollout.top_p",
    "max_new_tokens": "rollout.max_new_tokens", "max_prompt_length": "data.max_prompt_length", "seed": "seed",
    "dtype": "model.dtype", "stop_tokens": "rollout.stop_tokens", "batch_slots": "rollout.slots",
    "env": "env.name", "max_turns": "env.max_turns", "tool_cpu_seconds": "env.cpu_seconds",
    "tool_wall_seconds": "env.wall_seconds", "tool_memory_mb": "env.memory_mb", "tool_output_bytes": "env.output_bytes",
    "tool_workers": "env.workers",
}
_DEFAULTS = eval_config()


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """What decides the responses and how they are batched; defaults and checks are `eval_config()`'s."""
  n: int = _DEFAULTS.rollout.n
  temperature: float = _DEFAULTS.rollout.temperature
  top_k: int = _DEFAULTS.rollout.top_k
  top_p: float = _DEFAULTS.rollout.top_p
  max_new_tokens: int = _DEFAULTS.rollout.max_new_tokens
  max_prompt_length: int = _DEFAULTS.data.max_prompt_length  # longer prompts are dropped (and counted)
  seed: int = _DEFAULTS.seed
  dtype: str = _DEFAULTS.model.dtype  # weights and compute
  stop_tokens: str = _DEFAULTS.rollout.stop_tokens  # inference.py stops as the released rollout
  batch_slots: int = _DEFAULTS.rollout.slots  # concurrent decodes, each with a KV cache
  env: str = _DEFAULTS.env.name  # "python_tool": each sample a conversation with the tool (docs/tools.md)
  max_turns: int = _DEFAULTS.env.max_turns  # the model's turns per conversation
  tool_cpu_seconds: float = _DEFAULTS.env.cpu_seconds  # the sandbox's limits on one program
  tool_wall_seconds: float = _DEFAULTS.env.wall_seconds
  tool_memory_mb: int = _DEFAULTS.env.memory_mb
  tool_output_bytes: int = _DEFAULTS.env.output_bytes
  tool_workers: int = _DEFAULTS.env.workers  # programs run at once
  chunk_problems: int = 0  # problems per generate call and file append; 0: enough for 4x batch_slots responses
  limit: int | None = None  # first `limit` problems of each data file

  @classmethod
  def from_config(cls, cfg, **rest) -> "EvalSettings":
    """From a validated `eval_config()`; `rest`: chunk_problems, limit."""
    return cls(**{name: config_lib.get_field(cfg, field) for name, field in CONFIG_FIELDS.items()}, **rest)

  def to_config(self):
    cfg = eval_config()
    for name, field in CONFIG_FIELDS.items():
      config_lib.set_field(cfg, field, getattr(self, name))
    return cfg

  def __post_init__(self):
    config_lib.validate_eval(self.to_config())  # a ConfigError (a ValueError) naming the field
    if self.chunk_problems < 0:
      raise ValueError(f"chunk_problems must be >= 0, got {self.chunk_problems}")
    if self.limit is not None and self.limit < 1:
      raise ValueError(f"limit must be positive, got {self.limit}")

  def problems_per_chunk(self) -> int:
    return self.chunk_problems or max(1, -(-4 * self.batch_slots // self.n))
