"""Training objectives as objects registered by name: what each needs, its settings, its loss and its accumulation
weight.

The trainer, the memory estimate and config validation ask `get(cfg.algorithm)`; adding an objective is one
module that subclasses `Algorithm` (with its `settings.Settings` class) and calls `register` (as tunix's
algo_core registry). The run config's `cfg.<name>` block of each registered algorithm is built from its settings
class (`settings_blocks`), so config/ names no algorithm's fields.
"""

from __future__ import annotations

import dataclasses
import importlib
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from pacs_jax.algos import batch as batch_lib
from pacs_jax.algos import settings as settings_lib
from pacs_jax.algos.batch import Batch, Reference  # noqa: F401  (algorithms name it `algorithms.Reference`)
from pacs_jax.algos.objective import Objective
from pacs_jax.algos.settings import Check, Settings

check_choice = settings_lib.choice

# The built-in objectives register themselves when their module is imported; `get` imports it on first use.
_BUILTIN_MODULES = {name: f"pacs_jax.algos.{name}" for name in ("pacs", "grpo", "ppo", "dapo", "drgrpo", "gspo")}
_REGISTRY: dict[str, "Algorithm"] = {}


class Algorithm:
  """An objective on the shared loop. Subclasses override what differs; the defaults are a critic-free,
  reference-free policy loss averaged over rows.

  A run binds its objective once (`bind`): the hooks that take `cfg` run on the host before binding (what the run
  needs, its settings, its fields); those the loop calls each step (`host_inputs`, `shape_rewards`,
  `sampling_rounds`, `keep_groups`) and those the step traces (`loss`, `normaliser`, `critic_loss`,
  `logprob_targets`, `step_inputs`, `entropy_has_grad`) take the bound `objective.Objective`, never the ConfigDict.

  A micro-batch (`batch.Batch`) is [m, ...] of each of the run's `batch_fields` (m rows = whole prompt groups):
  input_ids / attention_mask [m, L], loss_mask [m, R], rewards [m], plus what the algorithm asks for
  (old_logprobs, ref_logprobs, old_values, its `extra_fields`). Every sum over response positions (the loss, the
  advantages, the log-ratios) runs over `loss_mask`: the model's tokens, never tokens a rollout inserted.
  """

  name: str = ""
  min_group_size: int = 1  # responses per prompt the objective needs (group baselines need 2)
  has_critic: bool = False  # a value model trained beside the policy (old_values come with each mini-batch)
  # Its own settings (`cfg.<name>`): defaults, one-line docs and checks in one typed class.
  settings_class: type[Settings] = Settings
  # Settings that moved into this algorithm's block: {new field: the field older configs held it in}. A config that
  # still sets the old field (and not the new) is refused; a resume reads an older record's value from the old one.
  moved_settings: dict[str, str] = {}

  def settings(self, cfg: ml_collections.ConfigDict) -> Settings:
    """The algorithm's own settings, typed: `cfg.<name>` (the defaults when the config has no such block)."""
    return self.settings_class.from_block(cfg.get(self.name))

  def advantage_estimator(self, settings: Settings) -> str | None:
    """The registered advantage estimator (`advantages.get`) the loss uses under `settings`, or None."""
    return None

  def bind(self, cfg: ml_collections.ConfigDict) -> Objective:
    """This objective bound to the run `cfg`: every value its traced hooks read, frozen and hashable."""
    settings = self.settings(cfg)
    return Objective(
        algorithm=self, settings=settings, group_size=cfg.rollout.n, temperature=cfg.rollout.temperature,
        logits_chunk=cfg.train.logits_chunk, keep_logits=cfg.train.keep_logits, reference=self.reference(cfg),
        needs_old_logprobs=self.needs_old_logprobs(cfg), tis_cap=self.tis_cap(cfg), tis_level=self.tis_level(cfg),
        fields=self.batch_fields(cfg), verl_micro_batch_rows=cfg.train.verl_micro_batch_rows,
        max_new_tokens=cfg.rollout.max_new_tokens, advantage_estimator=self.advantage_estimator(settings))

  def validate_settings(self, cfg: ml_collections.ConfigDict, check: Check) -> None:
    """Checks the algorithm's own settings block (`cfg.<name>`) by its settings class; run for the configured
    algorithm only (another algorithm's block is never read)."""
    self.settings_class.validate(cfg.get(self.name), lambda ok, field, msg: check(ok, f"{self.name}.{field}", msg))

  def validate(self, cfg: ml_collections.ConfigDict, check: Check, num_processes: int) -> None:
    """Checks a run of this algorithm needs beyond its settings (the shared ones are config.validate's)."""

  def reference(self, cfg: ml_collections.ConfigDict) -> Reference:
    """The reference policy the loss compares against, if any (`ref_logprobs`)."""
    return Reference.NONE

  def needs_old_logprobs(self, cfg: ml_collections.ConfigDict) -> bool:
    """`old_logprobs`: the sampling policy's log-probs, computed before the step's first update (ratios, and the
    rollout reference)."""
    return self.reference(cfg) is Reference.ROLLOUT

  # Whether the loss applies the rollout correction (truncated importance weights between the behaviour policy and
  # π_old, `tis_cap`): the objectives whose parity with verl's TIS is tested (GRPO, PPO, PACS).
  supports_rollout_correction = False
  # The correction's level when `rollout.tis_level` is "" (`correction.LEVELS`): "token" for a per-token loss,
  # "sequence" for one whose terms are whole responses.
  rollout_correction_level = "token"

  def tis_cap(self, cfg: ml_collections.ConfigDict) -> float | None:
    """The cap C of the truncated importance weights min(π_old / μ, C) (`rollout.tis_imp_ratio_cap` > 0), or None
    without the correction."""
    cap = cfg.rollout.get("tis_imp_ratio_cap", -1.0)
    return float(cap) if cap > 0 else None

  def tis_level(self, cfg: ml_collections.ConfigDict) -> str:
    """"token" | "sequence": one importance weight per token or per response (`rollout.tis_level`, "" = the
    objective's own `rollout_correction_level`)."""
    return cfg.rollout.get("tis_level", "") or self.rollout_correction_level

  def batch_fields(self, cfg: ml_collections.ConfigDict) -> tuple[batch_lib.Field, ...]:
    """Every field of this algorithm's mini-batches under `cfg` (a `batch.BatchLayout`'s): the rollout's, the
    passes it needs, its own `extra_fields`. Follows from `needs_old_logprobs`, `reference`, `has_critic`,
    `tis_cap` and `extra_fields`: override those, not this."""
    fields = list(batch_lib.ROLLOUT_FIELDS)
    if self.needs_old_logprobs(cfg):
      fields.append(batch_lib.OLD_LOGPROBS)
    if self.reference(cfg) is not Reference.NONE:
      fields.append(batch_lib.REF_LOGPROBS)
    if self.has_critic:
      fields.append(batch_lib.OLD_VALUES)
    if self.tis_cap(cfg) is not None:
      fields.append(batch_lib.BEHAVIOUR_LOGPROBS)
    return tuple(fields) + tuple(self.extra_fields(cfg))

  def extra_fields(self, cfg: ml_collections.ConfigDict) -> tuple[batch_lib.Field, ...]:
    """The algorithm's own mini-batch fields (`batch.per_response`): host inputs (source `batch.HOST`, from
    `host_inputs`) and step inputs (`batch.STEP`, from `step_inputs`)."""
    return ()

  def host_inputs(self, objective: Objective, input_ids: np.ndarray, attention_mask: np.ndarray,
                  response_len: int) -> dict[str, np.ndarray]:
    """Per-row [rows, R] numpy inputs built on the host from a process's rows (before batching): the
    `extra_fields` of source `batch.HOST`."""
    return {}

  # The loss sees rewards other than the verifier's scores (`shape_rewards` overridden): the metrics then report
  # both, the verifier's mean as `reward/mean` and the shaped rewards' as `reward/shaped_mean`.
  shapes_rewards: bool = False

  def shape_rewards(self, objective: Objective, scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """The rewards [rows] the loss sees, from the verifier's scores [rows] and the response masks [rows, R] (host
    numpy, one process's rows): the scores themselves unless the objective shapes them (DAPO's overlong penalty;
    an objective that overrides this sets `shapes_rewards`)."""
    return scores

  def sampling_rounds(self, objective: Objective) -> int:
    """Rollouts a step may draw to fill its batch with groups `keep_groups` keeps (dynamic sampling): 1, the
    default, is one rollout with every group kept; 0 is no limit."""
    return 1

  def keep_groups(self, objective: Objective, scores: np.ndarray) -> np.ndarray:
    """[U] the prompt groups of the verifier's scores [rows] (rows prompt-major) a dynamically sampled step keeps."""
    return np.ones(scores.shape[0] // objective.group_size, bool)

  def logprob_targets(self, objective: Objective, batch: Batch) -> jax.Array | None:
    """The tokens [..., R] whose log-probs the policy passes read (a micro- or mini-batch's field), or None: the
    response tokens."""
    return None

  def step_inputs(self, objective: Objective, minibatches: list[Batch]) -> list[Batch]:
    """Fields computed over the whole step's batch (jitted), one dict per mini-batch [k, m, R]: the
    `extra_fields` of source `batch.STEP`, after the log-prob and value passes."""
    return [{} for _ in minibatches]

  def entropy_has_grad(self, objective: Objective) -> bool:
    """The entropy is part of the objective (otherwise it is only a metric and carries no gradient)."""
    return False

  def loss(self, objective: Objective, logprobs: jax.Array, entropy: jax.Array,
           micro: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The policy loss of one micro-batch from the current log-probs / entropies [m, R] -> (loss, metrics)."""
    raise NotImplementedError

  def normaliser(self, objective: Objective, micro: Batch, mask: jax.Array | None = None) -> jax.Array:
    """What the loss over `mask` (default: the loss mask) is a mean over: the micro-batch's accumulation
    weight, so that k micro-batches give the unsplit mini-batch's gradient. Default: rows."""
    return jnp.asarray(micro["rewards"].shape[0], jnp.float32)

  def critic_loss(self, objective: Objective, values: jax.Array,
                  micro: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The value loss of one micro-batch from the critic's values [m, R] (`has_critic` only)."""
    raise NotImplementedError

  def make_critic(self, model_config, rngs):
    """A fresh critic module for a policy of `model_config` (`has_critic` only)."""
    raise NotImplementedError

  def critic_lr(self, cfg: ml_collections.ConfigDict) -> float:
    """The critic optimizer's learning rate (`has_critic` only)."""
    raise NotImplementedError

  def critic_mask(self, micro: Batch) -> jax.Array:
    """[m, R] positions the value loss averages over (its accumulation weight's mask)."""
    return micro["loss_mask"]


def register(name: str, algorithm: Algorithm) -> Algorithm:
  """Makes `algorithm` the objective of `config.algorithm = name`; returns it."""
  if not isinstance(algorithm, Algorithm):
    raise TypeError(f"{name}: an algorithm must be an Algorithm instance, got {type(algorithm).__name__}")
  algorithm.name = name
  _REGISTRY[name] = algorithm
  return algorithm


def names() -> tuple[str, ...]:
  """Every registered name, the built-in ones included."""
  return tuple(sorted(set(_REGISTRY) | set(_BUILTIN_MODULES)))


def is_registered(name: str) -> bool:
  return name in _REGISTRY or name in _BUILTIN_MODULES


def get(name: str) -> Algorithm:
  """The algorithm registered as `name` (a built-in one is imported on first use)."""
  if name not in _REGISTRY and name in _BUILTIN_MODULES:
    importlib.import_module(_BUILTIN_MODULES[name])
  try:
    return _REGISTRY[name]
  except KeyError:
    raise KeyError(f"unknown algorithm {name!r}; registered: {', '.join(names())}") from None


def of(cfg: ml_collections.ConfigDict) -> Algorithm:
  """The configured algorithm."""
  return get(cfg.algorithm)


def bind(cfg: ml_collections.ConfigDict) -> Objective:
  """The configured algorithm bound to `cfg` (`Algorithm.bind`)."""
  return of(cfg).bind(cfg)


def settings_blocks() -> dict[str, ml_collections.ConfigDict]:
  """{name: its settings block of defaults} for every registered algorithm (those with settings), the run
  config's algorithm blocks."""
  blocks = {}
  for name in names():
    settings_class = get(name).settings_class
    if dataclasses.fields(settings_class):
      blocks[name] = settings_class.block()
  return blocks
