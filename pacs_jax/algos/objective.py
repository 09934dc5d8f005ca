"""An objective bound to its run (`Algorithm.bind(cfg)`): a frozen, hashable `Objective` holding every value the
step's traced functions and the loop's per-step hooks need, so they take it (a static value under jit) and never
the run's ConfigDict."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pacs_jax.algos import advantages as advantages_lib
from pacs_jax.algos.batch import Batch, Field, Reference
from pacs_jax.algos.settings import Settings


@dataclasses.dataclass(frozen=True)
class Objective:
  """One run's objective: its algorithm (an `algorithms.Algorithm`, hashed by identity), its typed settings and the
  run's values its hooks read. The hooks are called through it (`loss`, `normaliser`, `host_inputs`, ...): each
  is the algorithm's hook given this object."""
  algorithm: Any
  settings: Settings
  group_size: int  # n responses per prompt (`rollout.n`)
  temperature: float  # the sampling temperature the log-probs are taken at (`rollout.temperature`)
  logits_chunk: int  # LM-head positions at a time in the update (`train.logits_chunk`; 0 = the whole response)
  keep_logits: bool  # keep the 16-bit logits for the backward pass (`train.keep_logits`)
  reference: Reference  # whose log-probs `ref_logprobs` are
  needs_old_logprobs: bool
  tis_cap: float | None  # the rollout correction's cap C (None: no correction)
  tis_level: str  # "token" | "sequence": the correction's importance weights
  fields: tuple[Field, ...]  # the mini-batch fields (`Algorithm.batch_fields`)
  verl_micro_batch_rows: int  # the recipe's ppo_micro_batch_size_per_gpu (`train.verl_micro_batch_rows`)
  max_new_tokens: int  # R_max, the response budget (`rollout.max_new_tokens`)
  advantage_estimator: str | None  # the registered estimator its loss uses (`advantages.get`), if any

  @property
  def name(self) -> str:
    return self.algorithm.name

  @property
  def has_critic(self) -> bool:
    return self.algorithm.has_critic

  @property
  def entropy_has_grad(self) -> bool:
    return self.algorithm.entropy_has_grad(self)

  def advantages(self, values: jax.Array) -> jax.Array:
    """[B] -> [B]: the objective's estimator over groups of `group_size`."""
    return advantages_lib.get(self.advantage_estimator)(values, self.group_size)

  def loss(self, logprobs: jax.Array, entropy: jax.Array, micro: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    return self.algorithm.loss(self, logprobs, entropy, micro)

  def normaliser(self, micro: Batch, mask: jax.Array | None = None) -> jax.Array:
    return self.algorithm.normaliser(self, micro, mask)

  def critic_loss(self, values: jax.Array, micro: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    return self.algorithm.critic_loss(self, values, micro)

  def critic_mask(self, micro: Batch) -> jax.Array:
    return self.algorithm.critic_mask(micro)

  def logprob_targets(self, batch: Batch) -> jax.Array | None:
    return self.algorithm.logprob_targets(self, batch)

  def step_inputs(self, minibatches: list[Batch]) -> list[Batch]:
    return self.algorithm.step_inputs(self, minibatches)

  # The loop's per-step host hooks (numpy, one process's rows).
  def host_inputs(self, input_ids: np.ndarray, attention_mask: np.ndarray, response_len: int
                  ) -> dict[str, np.ndarray]:
    return self.algorithm.host_inputs(self, input_ids, attention_mask, response_len)

  def shape_rewards(self, scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    return self.algorithm.shape_rewards(self, scores, response_mask)

  @property
  def shapes_rewards(self) -> bool:
    return self.algorithm.shapes_rewards

  @property
  def sampling_rounds(self) -> int:
    return self.algorithm.sampling_rounds(self)

  def keep_groups(self, scores: np.ndarray) -> np.ndarray:
    return self.algorithm.keep_groups(self, scores)
