"""The reference the cached rollouts are checked against: one uncached forward of the engine's model."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def log_probs(engine, rows: int):
  """run(params, seq, temperature=1.0) -> log_softmax(logits / temperature) [len(seq), V] of one uncached forward
  over `seq`, right-padded to `rows` (causal, so the padding changes no earlier position)."""
  forward = jax.jit(lambda p, ids: nnx.merge(engine.graphdef, p)(ids).astype(jnp.float32))

  def run(params, seq, temperature=1.0):
    ids = np.zeros((1, rows), np.int32)
    ids[0, :len(seq)] = seq
    return np.asarray(jax.nn.log_softmax(forward(params, ids)[0] / temperature, axis=-1))[:len(seq)]

  return run
