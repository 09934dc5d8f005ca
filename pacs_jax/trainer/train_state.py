"""TrainState pytree, the optimizer (AdamW + optional global-norm clip + schedule, non-finite updates skipped) and sharded creation."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import lora_saved

# apply_if_finite falls back to applying the update after this many consecutive non-finite ones; a
# non-finite gradient must never be applied, so the limit is out of reach.
_NEVER = 2**31 - 1


@flax.struct.dataclass
class TrainState:
  """Everything a training step transforms. Graph definitions are static and live outside."""
  step: jax.Array  # [] int32: training steps done (one rollout batch, several mini-batch updates each)
  params: nnx.State  # policy parameters
  opt_state: Any
  rng: jax.Array  # [2] uint32 key data
  critic_params: nnx.State | None = None  # PPO only
  critic_opt_state: Any = None


def learning_rate_schedule(train: ml_collections.ConfigDict, lr: float, total_updates: int) -> optax.Schedule:
  if train.schedule == "constant":
    if train.warmup_steps:
      return optax.join_schedules([optax.linear_schedule(0.0, lr, train.warmup_steps), optax.constant_schedule(lr)],
                                  [train.warmup_steps])
    return optax.constant_schedule(lr)
  return optax.warmup_cosine_decay_schedule(0.0, lr, max(train.warmup_steps, 0), max(total_updates, 1),
                                            end_value=lr * train.min_lr_ratio)


def gradient_clip(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Global-norm clipping at `train.grad_clip`, or identity when it is 0 (same state layout either way)."""
  return optax.clip_by_global_norm(train.grad_clip) if train.grad_clip > 0 else optax.identity()


def make_optimizer(train: ml_collections.ConfigDict, lr: float, total_updates: int,
                   saved_lr_scale: float | None = None) -> optax.GradientTransformation:
  """AdamW, with global-norm clipping when `train.grad_clip` > 0; an update whose gradient has a NaN/Inf is
  skipped and counted. `saved_lr_scale` (a LoRA run that saves parameters, `lora.modules_to_save`): the updates of
  the saved copies (`saved_*`) are multiplied by it, so they take full fine-tuning's rate where the adapters take
  `lora.lr_multiplier` times it.

  grad_clip = 0 is the released PACS actor: its `_optimizer_step` (ritzz-ai/PACS src/pacs/pacs_actor.py)
  replaces verl's, computes the norm only to skip non-finite steps, and never clips. verl's own
  `_optimizer_step` (dp_actor.py, dp_critic.py) clips at grad_clip = 1.0: the GRPO and PPO baselines.
  """
  schedule = learning_rate_schedule(train, lr, total_updates)
  inner = optax.chain(
      gradient_clip(train),
      # inject_hyperparams keeps the learning rate of the last update in the state, for logging.
      optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b1=train.b1, b2=train.b2, eps=train.eps,
                                            weight_decay=train.weight_decay),
      *([] if saved_lr_scale is None else [optax.masked(optax.scale(saved_lr_scale), _saved_copies)]),
  )
  return optax.apply_if_finite(inner, max_consecutive_errors=_NEVER)


def _saved_copies(params) -> Any:
  """True at the leaves of a LoRA run's saved copies (`saved_<name>`, beside the adapters), False elsewhere."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: any(str(getattr(k, "key", "")).startswith(lora_saved.SAVED_PREFIX) for k in path), params)


def skipped_updates(opt_state) -> jax.Array:
  """Number of updates skipped for a non-finite gradient so far."""
  return opt_state.total_notfinite


def last_lr(opt_state) -> jax.Array:
  """The learning rate of the last applied update."""
  return opt_state.inner_state[1].hyperparams["learning_rate"]


def optimizer_metrics(opt_state) -> dict[str, jax.Array]:
  """The train step's metrics read from `make_optimizer`'s state."""
  return {"skipped_updates": skipped_updates(opt_state).astype(jnp.float32), "lr": last_lr(opt_state)}


def tree_norm(tree) -> jax.Array:
  """sqrt(Σ x²) over every leaf, in float32 (16-bit weights' squares summed in 16 bits lose the total)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def init_opt_state(optimizer: optax.GradientTransformation, params: nnx.State, mesh) -> Any:
  """Optimizer state created directly in the parameters' shardings (moments follow their params)."""
  if mesh is None:
    return optimizer.init(params)
  abstract = jax.eval_shape(optimizer.init, params)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  shardings = optax.tree_map_params(optimizer, lambda _, s: s, abstract, param_shardings,
                                    transform_non_params=lambda _: sharding.replicated(mesh))
  return jax.jit(optimizer.init, out_shardings=shardings)(params)


def initial_state(params: nnx.State, optimizer: optax.GradientTransformation, critic_params: nnx.State | None,
                  critic_optimizer: optax.GradientTransformation, mesh, seed: int) -> TrainState:
  """A run's state at step 0: its optimizers' states created in the parameters' shardings, the RNG from `seed`."""
  critic_opt_state = None
  if critic_params is not None:
    critic_opt_state = init_opt_state(critic_optimizer, critic_params, mesh)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=init_opt_state(optimizer, params, mesh),
                    rng=initial_rng(seed), critic_params=critic_params, critic_opt_state=critic_opt_state)


def initial_rng(seed: int) -> jax.Array:
  return jax.random.key_data(jax.random.key(seed))


def _split(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Key data [2] -> (the next step's key data, this step's sampling key)."""
  carry, sub = jax.random.split(jax.random.wrap_key_data(rng))
  return jax.random.key_data(carry), sub


def rollout_seed(rng: jax.Array) -> int:
  """The sampling seed of the training step that starts from `rng` (the key `advance` does not carry on)."""
  return int(jax.random.randint(_split(rng)[1], (), 0, 2**31 - 1))


def next_rollout_seed(rng: jax.Array) -> int:
  """The sampling seed of the step after the one that starts from `rng` (`advance` moves the key on the same way
  whatever the update computes): what an overlapped rollout draws before the update ends."""
  return rollout_seed(_split(rng)[0])


def rollout_seed_ahead(rng: jax.Array, steps: int) -> int:
  """The sampling seed of the step `steps` after the one that starts from `rng` (0: `rollout_seed`, 1:
  `next_rollout_seed`): what a rollout started that many steps ahead draws."""
  for _ in range(steps):
    rng = _split(rng)[0]
  return rollout_seed(rng)


def advance(state: TrainState, ends_step: jax.Array | bool = True) -> TrainState:
  """After a training step's last update (`ends_step`, a [] bool): step + 1 and the next RNG key. Runs inside
  the jitted step, so neither is ever changed on the host."""
  ends_step = jnp.asarray(ends_step, jnp.bool_)
  return state.replace(step=state.step + ends_step.astype(state.step.dtype),
                       rng=jnp.where(ends_step, _split(state.rng)[0], state.rng))
