"""The laptop study's settings: one training config for every registered objective (the released recipe's structure
at tiny sizes, the same lr, n, batch and steps for all), the warm-up, the seeds and the pass@k evaluation. Two
tasks: the graded sums (`sum11`, single turn) and the tool demo's products (`mul53_tools`: conversations with the
Python tool, configs/tiny_tools_cpu.py)."""

from __future__ import annotations

import dataclasses

import ml_collections

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms
from pacs_jax.study.warmup import WarmupSettings
from pacs_jax.trainer.warm_base import ToolWarmup

REFERENCE = "pacs"  # every other algorithm's pass@k is reported as its difference from this one's
ALGORITHMS = ("pacs", "grpo", "ppo")  # the paper's comparison


def all_algorithms() -> tuple[str, ...]:
  """Every registered objective (`--algorithms all`): the paper's three first, then the others by name."""
  return ALGORITHMS + tuple(sorted(set(algorithms.names()) - set(ALGORITHMS)))


def algorithms_from_flag(values: list[str]) -> tuple[str, ...]:
  """`--algorithms` (names of registered objectives, or `all`) in `all_algorithms`' order. Raises ValueError naming
  the unknown ones."""
  if "all" in values:
    return all_algorithms()
  unknown = sorted(set(values) - set(algorithms.names()))
  if unknown:
    raise ValueError(f"--algorithms: {unknown} not among the registered objectives {list(algorithms.names())} or all")
  return tuple(name for name in all_algorithms() if name in values)


@dataclasses.dataclass(frozen=True)
class StudySettings:
  algorithms: tuple[str, ...] = ALGORITHMS
  # Six seeds and 120 problems: the paired intervals narrow with both; about 20 CPU minutes in all (docs/study.md).
  seeds: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
  steps: int = 300
  lr: float = 5e-4  # one learning rate for every algorithm (the released recipe's 1e-6 is for 3B/7B models)
  batch_prompts: int = 16
  n: int = 8
  # Held-out problems, each number of terms in eval_terms drawn alike; distinct, so the ~30 held-out two-term sums run
  # out and the rest are three- and four-term sums. The first 60 are the 60 of the study's first version.
  eval_problems: int = 120
  eval_terms: tuple[int, ...] = (2, 3, 4)
  eval_n: int = 256  # samples per held-out problem: pass@k for k = 1, 2, 4, ... 256
  warmup: WarmupSettings | ToolWarmup = WarmupSettings()
  task: str = "sum11"  # or TOOL_TASK

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


# The shrunk study of the tests: every part runs, on a handful of steps and problems.
SHRUNK = StudySettings(algorithms=ALGORITHMS, seeds=(0, 1), steps=2, batch_prompts=4, n=4, eval_problems=6,
                       eval_n=16, warmup=WarmupSettings(steps=10, batch=16))


TOOL_TASK = "mul53_tools"
# The tool task: PACS against GRPO from the tool demo's warmed-up base (configs/tiny_tools_cpu.py: it calls the tool on
# 3% of the task's problems), trained 30 steps (the demo's 10-step mean reward passes 0.5 near step 20 and 0.9 near
# step 32: the study looks mid-way, where the objectives' speeds differ), pass@k with the tool on 64 held-out problems
# at n = 16. Every response runs a sandboxed program once the policy calls: about 3 minutes a run on 2 cores.
TOOLS = StudySettings(algorithms=("pacs", "grpo"), seeds=(0, 1, 2), steps=30, lr=3e-4, batch_prompts=16, n=8,
                      eval_problems=64, eval_terms=(), eval_n=16, warmup=ToolWarmup(), task=TOOL_TASK)
SHRUNK_TOOLS = dataclasses.replace(TOOLS, seeds=(0,), steps=2, batch_prompts=4, n=4, eval_problems=4, eval_n=4,
                                   warmup=ToolWarmup(steps=10, batch=16))
TASKS = {"sum11": (StudySettings(), SHRUNK), "tools": (TOOLS, SHRUNK_TOOLS)}  # --task: (settings, --shrunk's)


def train_config(algorithm: str, seed: int, base_model_dir: str, s: StudySettings) -> ml_collections.ConfigDict:
  """One run's training config: `sum_config`'s or, for the tool task, `tool_config`'s."""
  return (tool_config if s.task == TOOL_TASK else sum_config)(algorithm, seed, base_model_dir, s)


def tool_config(algorithm: str, seed: int, base_model_dir: str, s: StudySettings) -> ml_collections.ConfigDict:
  """The tool demo's config (configs/tiny_tools_cpu.py: the same model, tool, sandbox and optimizer for PACS and
  GRPO) from the study's base model, at the study's steps, batch, n and lr; no validation (pass@k replaces it)."""
  c = config_lib.load_config_file(config_lib.shipped_config_path("tiny_tools_cpu"))
  c.algorithm, c.seed, c.steps = algorithm, seed, s.steps
  c.model.hf_path, c.model.warmup = base_model_dir, ""
  c.data.val = ""
  c.rollout.n = s.n
  c.train.batch_prompts = s.batch_prompts
  c.train.mini_batch_prompts = max(1, s.batch_prompts // 2)  # the demo's two optimizer updates per step
  c.train.lr = s.lr
  c.eval_every = 0
  c.checkpoint.every = s.steps
  c.checkpoint.async_save = False
  return c


def sum_config(algorithm: str, seed: int, base_model_dir: str, s: StudySettings) -> ml_collections.ConfigDict:
  """The training config of one run: the released recipe (configs/_released.py: temperature 1, 4 updates per step,
  PACS β = 1 with the rollout reference and RLOO, GRPO/PPO as verl's scripts) on the warmed-up tiny model."""
  c = config_lib.default_config()
  c.algorithm, c.seed, c.steps = algorithm, seed, s.steps
  c.model.hf_path = base_model_dir
  c.tokenizer = "synthetic"
  c.data.train = f"synthetic/{s.warmup.task}"
  c.data.val = ""  # pass@k on held-out problems replaces the greedy validation
  c.data.instruction = ""
  c.data.max_prompt_length = 16
  c.rollout.n = s.n
  c.rollout.temperature, c.rollout.top_p = 1.0, 1.0
  c.rollout.max_new_tokens = 2  # the answer and the end marker
  c.rollout.stop_tokens = "released"
  c.train.batch_prompts = s.batch_prompts
  c.train.mini_batch_prompts = max(1, s.batch_prompts // 4)  # 4 optimizer updates per step, as released
  c.train.lr = s.lr
  c.train.schedule = "constant"
  c.train.weight_decay = 0.01
  c.train.grad_clip = {"pacs": 0.0}.get(algorithm, 1.0)  # the released PACS actor never clips; verl's clip at 1
  c.pacs.beta = 1.0
  c.pacs.adv_estimator = "rloo"
  c.pacs.use_weight = True
  c.pacs.weight_mode = "question"
  c.pacs.reference_policy = "rollout"
  c.grpo.loss_agg_mode = "seq-mean-token-sum-norm"
  c.grpo.use_kl_loss = False
  c.grpo.entropy_coeff = 0.0
  c.ppo.loss_agg_mode = "seq-mean-token-sum-norm"
  c.ppo.entropy_coeff = 0.0
  c.ppo.critic_lr = 10 * s.lr  # the released critic lr is ten times the actor's (1e-5 vs 1e-6)
  c.ppo.cliprange_value = 0.5
  c.ppo.gamma, c.ppo.lam = 1.0, 1.0
  c.eval_every = 0
  c.checkpoint.every = s.steps
  c.checkpoint.async_save = False
  c.mesh.fsdp = 1
  c.reward_workers = 1
  return c
