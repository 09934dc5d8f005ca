"""Remat (`remat=True`): the same model and gradient, with only each layer's input saved for the backward pass.

The layers run in one `lax.scan`; remat is `jax.checkpoint` of its body with a policy that saves nothing,
so the scan keeps each layer's input [B, T, D] (one [L, B, T, D] array) and recomputes the rest.
"""

import contextlib
import io
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax.models import families as registry, qwen2

# Distinct sizes, so each residual's shape says what it is: L layers, B rows, T tokens, D hidden, F mlp.
L, B, T, D, F = 3, 2, 11, 48, 80
CONFIG = qwen2.Qwen2Config(vocab_size=97, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0)


def loss_fn(graphdef):
  def loss(params, ids, mask):
    logp = jax.nn.log_softmax(nnx.merge(graphdef, params)(ids, mask))
    return jnp.sum(jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0] * mask[:, 1:])
  return loss


def inputs():
  ids = jax.random.randint(jax.random.key(1), (B, T), 0, CONFIG.vocab_size)
  mask = jnp.ones((B, T), jnp.int32).at[1, :4].set(0)
  return ids, mask


def split(config):
  return nnx.split(registry.causal_lm(config, rngs=nnx.Rngs(0)))


def saved_residuals(config) -> list[tuple[str, tuple[int, ...], str]]:
  """(dtype, shape, source) of everything the backward pass keeps (jax.ad_checkpoint.print_saved_residuals)."""
  graphdef, params = split(config)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(loss_fn(graphdef), params, *inputs())
  rows = []
  for line in out.getvalue().splitlines():
    m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
    rows.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d), m.group(3)))
  return rows


def per_layer(rows):
  """Residuals the layer scan stacks over layers (its per-layer saves), as shapes."""
  return sorted(shape for _, shape, src in rows if "argument" not in src and shape[:1] == (L,))


@pytest.mark.parametrize("chunk", [0, 4], ids=["whole_attention", "attention_chunk_4"])
def test_remat_saves_each_layers_input_only(chunk):
  rows = saved_residuals(CONFIG.replace(remat=True, attention_chunk=chunk))
  print("\n".join(f"{d}{list(s)} {src}" for d, s, src in rows))
  # Per layer: its input [B, T, D], nothing else.
  assert per_layer(rows) == [(L, B, T, D)]
  # Besides the parameters (arguments), only whole-model things: token ids, mask, RoPE tables, the last
  # layer's output and the final norm / logits that act on it, all without a layer axis.
  others = [(shape, src) for _, shape, src in rows if "argument" not in src and shape[:1] != (L,)]
  for shape, src in others:
    assert shape[:1] in ((B,), (1,)), (shape, src)
  assert max(np.prod(s) for s, _ in others) <= B * T * CONFIG.vocab_size  # the logits, at most


def test_without_remat_the_layers_save_their_intermediates():
  stacked = per_layer(saved_residuals(CONFIG))
  G = CONFIG.num_attention_heads // CONFIG.num_key_value_heads
  assert (L, B, T, D) in stacked  # residual stream
  assert (L, B, T, F) in stacked  # MLP activations
  assert (L, B, CONFIG.num_key_value_heads, G, T, T) in stacked  # attention probabilities
  assert len(stacked) > 10


@pytest.mark.parametrize("chunk", [0, 4], ids=["whole_attention", "attention_chunk_4"])
def test_remat_gives_the_same_loss_and_gradient(chunk):
  graphdef, params = split(CONFIG)
  remat_graphdef, remat_params = split(CONFIG.replace(remat=True, attention_chunk=chunk))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(remat_params)):
    np.testing.assert_array_equal(a, b)  # remat changes no parameter
  ids, mask = inputs()
  value, grads = jax.jit(jax.value_and_grad(loss_fn(graphdef)))(params, ids, mask)
  remat_value, remat_grads = jax.jit(jax.value_and_grad(loss_fn(remat_graphdef)))(params, ids, mask)
  np.testing.assert_allclose(remat_value, value, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(a))))
