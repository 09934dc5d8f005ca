"""The laptop study's settings: one training config for every registered objective (the released recipe's structure
at tiny sizes, the same lr, n, batch and steps for all), the warm-up, the seeds and the pass@k evaluation."""

from __future__ import annotations

import dataclasses

import ml_collections

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms
from pacs_jax.study.warmup import WarmupSettings

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
  warmup: WarmupSettings = WarmupSettings()

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


# The shrunk study of the tests: every part runs, on a handful of steps and problems.
SHRUNK = StudySettings(algorithms=ALGORITHMS, seeds=(0, 1), steps=2, batch_prompts=4, n=4, eval_problems=6,
                       eval_n=16, warmup=WarmupSettings(steps=10, batch=16))


def train_config(algorithm: str, seed: int, base_model_dir: str, s: StudySettings) -> ml_collections.ConfigDict:
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
