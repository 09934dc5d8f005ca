"""The pure train step `(state, minibatch, ends_step, base) -> (state, metrics)` and the log-prob / value passes it
needs, one path for full and LoRA runs: the state's params are the trained part and `base` the frozen part
(`adapters.NO_BASE`, no leaves, in a full run: its programs keep the parameters they had without it).

A mini-batch (an `algos.batch.Batch`) has a leading micro-batch axis: every array is [k, m, ...] with k
micro-batches of m rows (whole prompt groups). Gradients are accumulated over micro-batches weighted by each
one's share of the loss normaliser (the algorithm's `normaliser`), so k micro-batches give exactly the unsplit
mini-batch's gradient. A training step is several such updates; its last one (`ends_step`, a traced [] bool
argument: one compiled step for every update) also advances `state.step` and the RNG. What differs between
algorithms comes from the run's bound objective (`algos.objective.Objective`, `Algorithm.bind(cfg)`); this module
knows none by name, and no ConfigDict reaches its traced functions.

Shapes: B rows, L = P + R tokens (prompt left-padded to P, response right-padded to R), D model width,
V vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pacs_jax import sharding
from pacs_jax.algos.batch import Batch
from pacs_jax.algos.masked import masked_mean
from pacs_jax.algos.objective import Objective
from pacs_jax.models import chunked_logprobs
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import train_state as state_lib
from pacs_jax.trainer.train_state import TrainState


def response_logprobs(model, input_ids, attention_mask, response_len: int, temperature: float,
                      with_entropy: bool = False, targets=None,
                      logits_chunk: int = chunked_logprobs.DEFAULT_CHUNK_SIZE, keep_logits: bool = False):
  """Log-probs [B, R] (and entropies) of the response tokens input_ids[:, P:] (or `targets` [B, R]) under
  logits / temperature.

  The hidden state at position t predicts token t + 1, so the response's predictors are [P-1, L-1).
  The LM head runs on `logits_chunk` positions at a time (0: the whole response at once), never building a
  full fp32 [B, R, V]; each chunk's logits are recomputed in the backward pass, or kept (`keep_logits`:
  16-bit [B, R, V] in all; `train.logits_chunk`, `train.keep_logits`).
  """
  hidden = model.model(input_ids, attention_mask)  # [B, L, D]
  L = input_ids.shape[1]
  P = L - response_len
  targets = input_ids[:, P:] if targets is None else targets
  return chunked_logprobs.token_logprobs_from_hidden(hidden[:, P - 1:L - 1], model.logits, targets, temperature,
                                                     chunk_size=logits_chunk or response_len,
                                                     with_entropy=with_entropy, keep_logits=keep_logits)


def response_values(critic, input_ids, attention_mask, response_len: int):
  """Values [B, R] of the states before each response token (aligned with `response_logprobs`)."""
  values = critic(input_ids, attention_mask)  # [B, L]
  L = input_ids.shape[1]
  return values[:, L - response_len - 1:L - 1]


# Packed rows (trainer/sequence_packing.py): the model runs on b rows of T tokens, several sequences in a row; what
# it computes comes back [m, R] per response through `response_index` (0 where a response has no position).


def _unpack(x, index):
  """x [b, T] on the packed positions -> [m, R] at `index` (flat packed positions; past the end: 0)."""
  return jnp.take(x.reshape(-1), index, mode="fill", fill_value=0)


def packed_response_logprobs(model, micro, response_len: int, temperature: float, with_entropy: bool = False,
                             targets=None, logits_chunk: int = chunked_logprobs.DEFAULT_CHUNK_SIZE,
                             keep_logits: bool = False):
  """`response_logprobs` of a packed micro-batch: log-probs [m, R] (and entropies) of its responses' tokens (or
  of `targets` [m, R]). Each packed position predicts the token its response position names (the targets placed
  on the packed positions that `response_index` points at), the LM head runs on the b x T packed positions
  only, and the results come back to the responses' layout (0 past each response's last position)."""
  tokens = micro["tokens"]  # [b, T]
  b, T = tokens.shape
  index = micro["response_index"]  # [m, R]
  targets = micro["input_ids"][:, -response_len:] if targets is None else targets  # [m, R]
  hidden = model.model(tokens, segment_ids=micro["segment_ids"], positions=micro["positions"])  # [b, T, D]
  row_targets = jnp.zeros((b * T,), targets.dtype).at[index.reshape(-1)].set(targets.reshape(-1), mode="drop")
  row_targets = sharding.constrain(row_targets.reshape(b, T), ("batch", None))
  # The LM head over the rows in chunks of at most `logits_chunk`, all of one size: T = 4,608 in chunks of 1,024 would
  # be 5 with the last shifted back over 512 positions of the one before (see `chunked_logprobs._scan_chunks`);
  # 5 of 922 compute 2 twice.
  chunks = -(-T // (logits_chunk or T))
  out = chunked_logprobs.token_logprobs_from_hidden(hidden, model.logits, row_targets, temperature,
                                                    chunk_size=-(-T // chunks), with_entropy=with_entropy,
                                                    keep_logits=keep_logits)
  return tuple(_unpack(x, index) for x in out) if with_entropy else _unpack(out, index)


def micro_logprobs(model, micro, response_len: int, temperature: float, **kwargs):
  """A micro-batch's response log-probs (`response_logprobs`, or `packed_response_logprobs` for packed rows)."""
  if "segment_ids" in micro:
    return packed_response_logprobs(model, micro, response_len, temperature, **kwargs)
  return response_logprobs(model, micro["input_ids"], micro["attention_mask"], response_len, temperature, **kwargs)


def micro_values(critic, micro, response_len: int):
  """A micro-batch's values [m, R] of the states before each response token (`response_values`; packed rows:
  at the packed positions that predict them)."""
  if "segment_ids" in micro:
    values = critic(micro["tokens"], segment_ids=micro["segment_ids"], positions=micro["positions"])  # [b, T]
    return _unpack(values, micro["response_index"])
  return response_values(critic, micro["input_ids"], micro["attention_mask"], response_len)


def make_train_step(objective: Objective, graphdef, optimizer: optax.GradientTransformation,
                    critic_graphdef=None, critic_optimizer: optax.GradientTransformation | None = None,
                    optimizer_metrics: Callable[[Any], dict[str, jax.Array]] = state_lib.optimizer_metrics
                    ) -> Callable[..., tuple[TrainState, dict]]:
  """Builds the pure step `(state, minibatch, ends_step=True, base=NO_BASE)`: accumulate gradients over
  micro-batches, then one (possibly skipped) update; when `ends_step` (the training step's last mini-batch; by
  default the mini-batch is a whole training step), `state.step` + 1 and the next RNG key. `objective`: the run's
  (`algorithms.bind(cfg)`).

  `optimizer_metrics(opt_state)`: the metrics read from the optimizer state (skipped updates, learning rate).
  The models are the state's trained params on the frozen `base` (PPO's critic on its backbone, `critic_base`), and
  the gradients are the trained params' only: all of them in a full run, a LoRA run's adapters (and critic head).
  """
  temperature = objective.temperature

  def losses(base):
    """The policy's and the critic's micro-batch losses of their trained params on the frozen `base`."""

    def micro_loss(params, micro):
      model = adapters_lib.merge(graphdef, params, base)
      R = micro["loss_mask"].shape[-1]
      logp, entropy = micro_logprobs(model, micro, R, temperature, with_entropy=True,
                                     targets=objective.logprob_targets(micro), logits_chunk=objective.logits_chunk,
                                     keep_logits=objective.keep_logits)
      # The entropy only carries gradient when it is part of the objective (GRPO's entropy bonus).
      loss, metrics = objective.loss(logp, entropy if objective.entropy_has_grad else jax.lax.stop_gradient(entropy),
                                     micro)
      metrics = dict(metrics)
      metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), micro["loss_mask"])
      return loss, metrics

    def critic_loss(critic_params, micro):
      critic = adapters_lib.merge(critic_graphdef, critic_params, adapters_lib.critic_base(base))
      R = micro["loss_mask"].shape[-1]
      return objective.critic_loss(micro_values(critic, micro, R), micro)

    return micro_loss, critic_loss

  def accumulate(loss_fn, params, minibatch, weight_fn):
    """Σ_j c_j ∇loss_j / Σ_j c_j over micro-batches j (c_j = the loss normaliser of micro-batch j); the metrics
    averaged with the same weights."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(carry, micro):
      grads_sum, metrics_sum, weight_sum = carry
      (loss, metrics), grads = grad_fn(params, micro)
      w = weight_fn(micro)
      metrics = dict(metrics, loss=loss)
      grads_sum = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), grads_sum, grads)
      metrics_sum = jax.tree.map(lambda a, m: a + w * m.astype(jnp.float32), metrics_sum, metrics)
      return (grads_sum, metrics_sum, weight_sum + w), None

    first = jax.tree.map(lambda x: x[0], minibatch)
    zeros_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    _, metrics_shape = jax.eval_shape(loss_fn, params, first)
    metrics_shape = dict(metrics_shape, loss=jax.ShapeDtypeStruct((), jnp.float32))
    zeros_metrics = jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), metrics_shape)
    (grads, metrics, total), _ = jax.lax.scan(body, (zeros_grads, zeros_metrics, jnp.float32(0)), minibatch)
    if objective.sampling_rounds > 1:
      # A mini-batch no loss sees (loss mask all 0: dynamic sampling's filler when a step kept no group) has
      # normaliser 0 and a zero gradient, not 0/0; any other total is divided by as it is. (Only where a filler can
      # occur: every other run's program is the one compiled before.)
      total = jnp.where(total > 0, total, 1.0)
    grads = jax.tree.map(lambda g, p: (g / total).astype(p.dtype), grads, params)
    metrics = jax.tree.map(lambda m: m / total, metrics)
    return grads, metrics

  def apply(optimizer, params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train_step(state: TrainState, minibatch: Batch, ends_step: jax.Array | bool = True,
                 base: nnx.State = adapters_lib.NO_BASE) -> tuple[TrainState, dict]:  # minibatch: [k, m, ...] each
    micro_loss, critic_loss = losses(base)
    grads, metrics = accumulate(micro_loss, state.params, minibatch, objective.normaliser)
    metrics["grad_norm"] = optax.tree.norm(grads)
    params, opt_state = apply(optimizer, state.params, state.opt_state, grads)
    metrics.update(optimizer_metrics(opt_state))
    critic_params, critic_opt_state = state.critic_params, state.critic_opt_state
    if critic_graphdef is not None:
      value_weight = lambda m: objective.normaliser(m, objective.critic_mask(m))
      critic_grads, critic_metrics = accumulate(critic_loss, critic_params, minibatch, value_weight)
      metrics.update({k if k.startswith("critic/") else f"critic/{k}": v for k, v in critic_metrics.items()})
      metrics["critic/grad_norm"] = optax.tree.norm(critic_grads)
      critic_params, critic_opt_state = apply(critic_optimizer, critic_params, critic_opt_state, critic_grads)
    state = state.replace(params=params, opt_state=opt_state, critic_params=critic_params,
                          critic_opt_state=critic_opt_state)
    return state_lib.advance(state, ends_step), metrics

  return train_step


# What the log-prob and value passes map over, one micro-batch at a time (and packed rows' inputs where present).
_MODEL_INPUTS = ("input_ids", "attention_mask", "loss_mask")
_PACKED_INPUTS = ("tokens", "segment_ids", "positions", "response_index")


def make_logprob_fn(graphdef, temperature: float, logits_chunk: int = chunked_logprobs.DEFAULT_CHUNK_SIZE,
                    targets: Callable[[Batch], jax.Array | None] | None = None) -> Callable[..., jax.Array]:
  """(params, minibatch [k, m, ...], base=NO_BASE) -> log-probs [k, m, R] of the responses (or of
  `targets(minibatch)` [k, m, R], e.g. the algorithm's `logprob_targets`) under the trained `params` on the frozen
  `base`, one micro-batch at a time (`logits_chunk` as `response_logprobs`)."""

  def fn(params, minibatch, base=adapters_lib.NO_BASE):  # `fn`: the name of its compiled programs
    R = minibatch["loss_mask"].shape[-1]

    def one(micro):  # merged inside the mapped function's trace, so no module crosses a trace boundary
      model = adapters_lib.merge(graphdef, params, base)
      return micro_logprobs(model, micro, R, temperature, targets=micro.get("targets"), logits_chunk=logits_chunk)

    mapped = {k: minibatch[k] for k in _MODEL_INPUTS + _PACKED_INPUTS if k in minibatch}
    tokens = targets(minibatch) if targets is not None else None
    if tokens is not None:
      mapped["targets"] = tokens
    return jax.lax.map(one, mapped)

  return fn


def make_value_fn(critic_graphdef, critic_mask: Callable[[Batch], jax.Array]) -> Callable[..., jax.Array]:
  """(critic params, minibatch [k, m, ...], base=NO_BASE) -> values [k, m, R], zero outside `critic_mask(micro)`
  [m, R] (the algorithm's; PPO's is attention_mask[:, -R-1:-1], as the released dp_critic.compute_values); the
  critic's frozen backbone is the policy's frozen `base`'s (`adapters.critic_base`: none in a full run)."""

  def fn(critic_params, minibatch, base=adapters_lib.NO_BASE):  # `fn`: the name of its compiled programs
    R = minibatch["loss_mask"].shape[-1]
    backbone = adapters_lib.critic_base(base)

    def one(micro):
      critic = adapters_lib.merge(critic_graphdef, critic_params, backbone)
      values = micro_values(critic, micro, R)
      return values * critic_mask(micro).astype(values.dtype)

    return jax.lax.map(one, {k: minibatch[k] for k in _MODEL_INPUTS + _PACKED_INPUTS if k in minibatch})

  return fn
