"""The jitted programs a training run executes, their shardings and argument shapes: built by the same
functions for the trainer (`loop.Trainer`) and for compiling ahead of time (`pacs_jax.compile.aot`), so the two cannot drift.

Full and LoRA runs (`lora.rank` > 0) share one path: the TrainState's params are what the run trains (every
parameter, or the adapters) and the frozen part enters every program as its last argument (`adapters.Frozen`
describes it; `abstract_base` gives it abstractly): `train_step(state, minibatch, ends_step, base)`,
`logprob_fn(params, minibatch, base)`, `value_fn(critic_params, minibatch, base)`, `to_sample_params(params, base)`,
and the frozen reference `ref_logprob_fn(reference params, minibatch, NO_BASE)`. A full run's frozen part is empty
(`adapters.NO_BASE`: no leaves, so its programs have the parameters they had without it); a LoRA run's is the base
weights, and its reference the base without adapters. The rollout runs the graph without adapters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.algos import algorithms, batch as batch_lib, correction
from pacs_jax.algos.objective import Objective
from pacs_jax.models import decoder, lora
from pacs_jax.models import families
from pacs_jax.rollout import interface as rollout_interface
from pacs_jax.rollout import local as local_rollout
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import sequence_packing
from pacs_jax.trainer import train_state as state_lib
from pacs_jax.trainer import step as step_lib


def needs_frozen_ref(cfg: ml_collections.ConfigDict) -> bool:
  """A frozen copy of the initial policy is kept (PACS "frozen" reference, GRPO's KL loss)."""
  return algorithms.of(cfg).reference(cfg) is algorithms.Reference.FROZEN


def needs_old_logprobs(cfg: ml_collections.ConfigDict) -> bool:
  """The sampling policy's log-probs are computed before the step's updates (ratios; PACS "rollout" reference)."""
  return algorithms.of(cfg).needs_old_logprobs(cfg)


def updates_per_step(cfg: ml_collections.ConfigDict) -> int:
  return cfg.train.batch_prompts // cfg.train.mini_batch_prompts


def micro_batches(cfg: ml_collections.ConfigDict) -> int:
  """Micro-batches per mini-batch (gradient accumulation steps)."""
  return cfg.train.mini_batch_prompts // (cfg.train.micro_batch_prompts or cfg.train.mini_batch_prompts)


def lora_lr_multiplier(cfg: ml_collections.ConfigDict) -> float:
  """A LoRA run's learning rates over the config's: `lora.lr_multiplier`, or where it is 0 (the default) the rule
  `LoraSpec.lr_multiplier` at the policy's width (10, capped at hidden_size / (2 alpha))."""
  if cfg.lora.lr_multiplier:
    return cfg.lora.lr_multiplier
  return config_lib.lora_spec(cfg).lr_multiplier(config_lib.model_config(cfg).hidden_size)


def make_optimizers(cfg: ml_collections.ConfigDict):
  """(policy optimizer, critic optimizer or None). A LoRA run's learning rates are `lora_lr_multiplier` times the
  config's (LoRA's best is about 10x full fine-tuning's at widths of thousands), but for its saved parameters
  (`lora.modules_to_save`), which are trained in full and so at the config's rate."""
  total_updates = cfg.steps * updates_per_step(cfg)
  spec = config_lib.lora_spec(cfg)
  scale = lora_lr_multiplier(cfg) if spec else 1.0
  saved = 1 / scale if spec and spec.modules_to_save else None
  optimizer = state_lib.make_optimizer(cfg.train, scale * cfg.train.lr, total_updates, saved)
  algo, critic = algorithms.of(cfg), None
  if algo.has_critic:
    critic = state_lib.make_optimizer(cfg.train, scale * algo.critic_lr(cfg), total_updates, saved)
  return optimizer, critic


def _full_tree(tree, per_variable):
  """Per-Variable values (e.g. shardings from `sharding.state_shardings`) spread to every leaf under each Variable."""
  return jax.tree.map(lambda v, s: jax.tree.map(lambda _: s, v), tree, per_variable,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def train_state_shardings(state: state_lib.TrainState, mesh, optimizer, critic_optimizer=None) -> state_lib.TrainState:
  """Where every leaf of a (concrete or abstract) TrainState lives: parameters by their logical axes
  (train mode), Adam moments like their parameters, counters and the RNG replicated."""
  replicated = sharding.replicated(mesh)

  def params_and_opt(params, opt_state, opt):
    param_shardings = _full_tree(params, sharding.state_shardings(params, mesh, "train"))
    opt_shardings = optax.tree_map_params(opt, lambda _, s: s, opt_state, param_shardings,
                                          transform_non_params=lambda _: replicated)
    return param_shardings, opt_shardings

  params, opt_state = params_and_opt(state.params, state.opt_state, optimizer)
  critic_params = critic_opt_state = None
  if state.critic_params is not None:
    critic_params, critic_opt_state = params_and_opt(state.critic_params, state.critic_opt_state, critic_optimizer)
  return state_lib.TrainState(step=replicated, params=params, opt_state=opt_state, rng=replicated,
                              critic_params=critic_params, critic_opt_state=critic_opt_state)


def minibatch_sharding(mesh, ndim: int) -> NamedSharding:
  """A mini-batch array [k micro-batches, m rows, ...]: rows over (data, fsdp)."""
  return NamedSharding(mesh, P(None, sharding.BATCH_AXES, *([None] * (ndim - 2))))


def row_tokens(cfg: ml_collections.ConfigDict) -> int:
  """Packed rows' length T (`train.packing_row_tokens`, 0: P + R, the longest sequence), or 0 when not packed."""
  if not cfg.train.packing:
    return 0
  return cfg.train.packing_row_tokens or cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def batch_layout(cfg: ml_collections.ConfigDict, mesh=None) -> batch_lib.BatchLayout:
  """The run's mini-batch format: its algorithm's fields, `mini_batch_prompts` groups of n rows in
  `micro_batches` micro-batches; packed (`train.packing`), b rows of T tokens, b a rung of the ladder
  (`sequence_packing.ladder`: multiples of the mesh's batch shards and of the processes)."""
  k = micro_batches(cfg)
  m = cfg.rollout.n * cfg.train.mini_batch_prompts // k
  T = row_tokens(cfg)
  ladder = ()
  if T:
    shards = 1 if mesh is None else math.prod(dict(mesh.shape)[a] for a in sharding.BATCH_AXES)
    budget = cfg.train.packing_rows or m  # rows per packed micro-batch: never more than the padded layout's, unless set
    ladder = sequence_packing.ladder(budget, math.lcm(shards, jax.process_count()), cfg.train.packing_rungs)
  return batch_lib.BatchLayout.of(cfg, algorithms.of(cfg).batch_fields(cfg), k, m, T, ladder)


def minibatch_shapes(cfg: ml_collections.ConfigDict, mesh, packed_rows: int = 0,
                     merge: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
  """The arrays of one mini-batch as the train step receives them (`Trainer.update` fills the log-prob,
  value and step-input fields before the first update); packed, at `packed_rows` rows (default: the ladder's
  top), `merge` micro-batches in each packed one."""
  layout = batch_layout(cfg, mesh).with_rows(packed_rows, merge)
  return layout.abstract(lambda ndim: minibatch_sharding(mesh, ndim))


def ends_step_shape(mesh) -> jax.ShapeDtypeStruct:
  """The train step's `ends_step` argument: a replicated [] bool."""
  return jax.ShapeDtypeStruct((), jnp.bool_, sharding=sharding.replicated(mesh))


def ends_step(mesh, value: bool) -> jax.Array:
  """`ends_step` as a global array (every process passes the same value)."""
  return jax.make_array_from_process_local_data(sharding.replicated(mesh), np.asarray(value), ())


def abstract_policy(cfg: ml_collections.ConfigDict) -> decoder.CausalLM:
  """The policy's structure and shapes from `model.preset` (nothing allocated, no checkpoint read)."""
  mc = config_lib.preset_model_config(cfg)
  return nnx.eval_shape(lambda: families.causal_lm(mc, rngs=nnx.Rngs(0)))


def _abstract_parts(cfg: ml_collections.ConfigDict):
  """(policy graphdef, its trained params, critic graphdef, critic params, frozen part, reference graphdef), abstract;
  the critic's None without one."""
  spec, algo, mc = config_lib.lora_spec(cfg), algorithms.of(cfg), config_lib.preset_model_config(cfg)
  graphdef, params, base, ref_graphdef = adapters_lib.abstract_policy(
      lambda: families.causal_lm(mc, rngs=nnx.Rngs(0)), spec)
  critic_graphdef = critic_params = None
  if algo.has_critic:
    critic_graphdef, critic_params = adapters_lib.critic(lambda: algo.make_critic(mc, nnx.Rngs(1)), spec, 0)
  return graphdef, params, critic_graphdef, critic_params, base, ref_graphdef


def abstract_train_state(cfg: ml_collections.ConfigDict, mesh):
  """(policy graphdef, critic graphdef or None, TrainState of ShapeDtypeStructs in their shardings). A LoRA run's
  graphdefs have adapters, and its state's params are the adapters (`abstract_base` gives the frozen rest)."""
  graphdef, params, critic_graphdef, critic_params, _, _ = _abstract_parts(cfg)
  optimizer, critic_optimizer = make_optimizers(cfg)
  critic_opt_state = jax.eval_shape(critic_optimizer.init, critic_params) if critic_params is not None else None
  state = state_lib.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                               opt_state=jax.eval_shape(optimizer.init, params),
                               rng=jax.eval_shape(lambda: state_lib.initial_rng(0)),
                               critic_params=critic_params, critic_opt_state=critic_opt_state)
  shardings = train_state_shardings(state, mesh, optimizer, critic_optimizer)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  return graphdef, critic_graphdef, abstract


def frozen_base(cfg: ml_collections.ConfigDict, ref_graphdef, base: nnx.State, mesh) -> adapters_lib.Frozen:
  """The `adapters.Frozen` of a run whose frozen part (concrete or abstract; empty in a full run) is `base`."""
  return adapters_lib.Frozen(config_lib.lora_spec(cfg), ref_graphdef,
                             _full_tree(base, sharding.state_shardings(base, mesh, "train")))


def abstract_base(cfg: ml_collections.ConfigDict, mesh) -> tuple[adapters_lib.Frozen, nnx.State]:
  """A run's (Frozen, frozen part as ShapeDtypeStructs in their shardings: empty in a full run), from `model.preset`
  as `abstract_train_state`."""
  _, _, _, _, base, ref_graphdef = _abstract_parts(cfg)
  frozen = frozen_base(cfg, ref_graphdef, base, mesh)
  return frozen, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), base, frozen.shardings)


def make_rollout(cfg: ml_collections.ConfigDict, model: decoder.CausalLM, mesh, eos_ids) -> rollout_interface.Rollout:
  """The run's rollout (`interface.Rollout`) by `rollout.engine`: "local", the in-process engine on `mesh` (`model`
  may be abstract: only its structure is kept), or what the named factory returns given the same keyword
  arguments."""
  slots = cfg.rollout.slots or (cfg.train.batch_prompts * cfg.rollout.n)
  kwargs = dict(model=model, slots=slots, max_prompt_length=cfg.data.max_prompt_length,
                max_new_tokens=cfg.rollout.max_new_tokens, mesh=mesh, eos_ids=eos_ids,
                page_size=cfg.rollout.page_size, kv_pages=cfg.rollout.kv_pages)
  engine = cfg.rollout.engine
  if engine == rollout_interface.LOCAL_ENGINE:
    return local_rollout.LocalRollout(**kwargs, slot_rungs=cfg.rollout.slot_rungs)
  rollout = rollout_interface.engine_factory(engine)(**kwargs)
  if not isinstance(rollout, rollout_interface.Rollout):
    raise TypeError(f"rollout.engine {engine!r} made a {type(rollout).__name__}, which lacks members of "
                    "interface.Rollout (set_weights, release, fork, ahead_of_time, generate, version, eos_ids, "
                    "weight_shardings)")
  return rollout


@dataclasses.dataclass
class Programs:
  """The trainer's jitted functions (the rollout holds the rollout ones); each takes the run's frozen part (empty in a
  full run) as its last argument (the module docstring)."""
  train_step: Callable  # (state, minibatch, ends_step, base) -> (state, metrics); the state is donated
  logprob_fn: Callable  # (params, minibatch, base) -> log-probs [k, m, R]: the policy's (old log-probs)
  value_fn: Callable | None  # (critic params, minibatch, base) -> values [k, m, R] (PPO)
  # (minibatches) -> [{field: [k, m, R]}]: the algorithm's step inputs (PPO's GAE), or None without any
  step_inputs: Callable | None
  to_sample_params: Callable  # (params, base) -> rollout weights (merged, compute dtype, sample layout)
  # (reference params, minibatch, NO_BASE) -> log-probs [k, m, R] of a frozen reference: the graph without adapters
  # on its own weights (a full run's: `logprob_fn` itself, on its copy of the initial weights; a LoRA run's: the base)
  ref_logprob_fn: Callable | None = None
  # (old log-probs, behaviour log-probs, response mask) [k, m, R] -> the rollout correction's importance-weight
  # statistics (`correction.importance_stats`), or None without the correction
  importance_stats: Callable | None = None


def make_programs(cfg: ml_collections.ConfigDict, graphdef, critic_graphdef, optimizer, critic_optimizer,
                  state_shardings: Any, sample_shardings: Any, frozen: adapters_lib.Frozen) -> Programs:
  """The programs of a run whose frozen part `frozen` describes (`frozen_base`). The frozen part is never donated
  and gets no gradient; the rollout weights are the trained params merged into it (a LoRA run's W + scale · A B,
  formed on device at each policy update; a full run's params as they are), cast to the compute dtype."""
  mesh = jax.tree.leaves(state_shardings)[0].mesh
  layout = batch_layout(cfg, mesh)
  abstract = layout.abstract(lambda ndim: minibatch_sharding(mesh, ndim))
  batch_shardings = {name: s.sharding for name, s in abstract.items()}
  objective = algorithms.bind(cfg)  # what the traced programs read of the run: never `cfg` itself
  # Rollout weights: sample-mode layout in the compute dtype. The model casts every weight to that
  # dtype before use, so sampling numerics are unchanged while memory and bandwidth drop.
  compute = config_lib.dtype(cfg.model.dtype)
  # One log-prob program per graph: a full run's reference has the policy's graph, so it is `logprob_fn` itself.
  logprob_program = functools.cache(lambda graph: jax.jit(step_lib.make_logprob_fn(
      graph, objective.temperature, objective.logits_chunk, objective.logprob_targets)))
  step_fn = step_lib.make_train_step(objective, graphdef, optimizer, critic_graphdef, critic_optimizer)

  return Programs(
      train_step=jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings, sharding.replicated(mesh),
                                                frozen.shardings),
                         out_shardings=(state_shardings, None), donate_argnums=(0,)),
      logprob_fn=logprob_program(graphdef),
      value_fn=(jax.jit(step_lib.make_value_fn(critic_graphdef, objective.critic_mask))
                if critic_graphdef is not None else None),
      step_inputs=_step_inputs(objective, layout),
      # A lambda, as a full run's always was: its compiled program keeps its name (jit__lambda).
      to_sample_params=jax.jit(lambda params, base: jax.tree.map(lambda x: x.astype(compute),
                                                                 lora.merge_into(base, params, frozen.spec)),
                               out_shardings=sample_shardings),
      ref_logprob_fn=logprob_program(frozen.ref_graphdef),
      importance_stats=_importance_stats(objective))


def _importance_stats(objective: Objective) -> Callable | None:
  cap = objective.tis_cap
  return None if cap is None else jax.jit(functools.partial(correction.importance_stats, cap=cap,
                                                            level=objective.tis_level))


def _step_inputs(objective: Objective, layout: batch_lib.BatchLayout) -> Callable | None:
  return jax.jit(lambda mbs: objective.step_inputs(mbs)) if layout.names(batch_lib.STEP) else None
