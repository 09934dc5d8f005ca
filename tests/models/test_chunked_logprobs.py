"""Chunked token log-probs / entropies against torch's log_softmax + gather, and their compiled memory."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import sharding
from pacs_jax.models import chunked_logprobs as lp

# Kept logits' gradients are compared bit for bit with the recomputed ones': -O1 (conftest.py).
pytestmark = pytest.mark.xla_o1

QWEN_VOCAB = 151_936


def torch_reference(logits, tokens, temperature):
  """log_softmax + gather and −Σ p log p in float64 torch, from the same (fp32) numbers."""
  x = torch.tensor(np.asarray(logits, np.float64)) / temperature
  logp_all = torch.log_softmax(x, dim=-1)
  picked = torch.gather(logp_all, -1, torch.tensor(np.asarray(tokens))[..., None].long())[..., 0]
  entropy = -(logp_all.exp() * logp_all).sum(-1)
  return picked.numpy(), entropy.numpy()


def random_case(B=2, T=13, V=50, seed=0, scale=3.0):
  rng = np.random.default_rng(seed)
  logits = (scale * rng.normal(size=(B, T, V))).astype(np.float32)
  tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
  return logits, tokens


# A chunk size that doesn't divide T (the last chunk overlaps the one before) and one larger than T.
@pytest.mark.parametrize("chunk_size, temperature", [(5, 0.7), (64, 1.0)])
def test_logprobs_and_entropy_match_torch(chunk_size, temperature):
  logits, tokens = random_case()
  want_logp, want_entropy = torch_reference(logits, tokens, temperature)

  @jax.jit
  def all_variants(x, t):
    return (lp.token_logprobs_and_entropy(x, t, temperature, chunk_size),
            lp.token_logprobs(x, t, temperature, chunk_size))

  (logp, entropy), logp_only = all_variants(logits, tokens)
  assert logp.dtype == jnp.float32 and logp.shape == tokens.shape
  np.testing.assert_allclose(logp, want_logp, rtol=0, atol=1e-5)
  np.testing.assert_allclose(entropy, want_entropy, rtol=0, atol=1e-5)
  np.testing.assert_allclose(logp_only, want_logp, rtol=0, atol=1e-5)


def test_bf16_logits_match_torch_on_the_same_values():
  logits, tokens = random_case(T=37, V=300, seed=1)
  logits_bf16 = jnp.asarray(logits, jnp.bfloat16)
  want_logp, want_entropy = torch_reference(np.asarray(logits_bf16.astype(jnp.float32)), tokens, 1.0)
  logp, entropy = jax.jit(lambda x, t: lp.token_logprobs_and_entropy(x, t, chunk_size=8))(logits_bf16, tokens)
  np.testing.assert_allclose(logp, want_logp, rtol=0, atol=1e-5)
  np.testing.assert_allclose(entropy, want_entropy, rtol=0, atol=1e-5)


def test_gradient_matches_torch():
  logits, tokens = random_case(seed=2)
  chunk_size = 5
  temperature = 0.7
  rng = np.random.default_rng(3)
  g_logp, g_ent = rng.normal(size=tokens.shape), rng.normal(size=tokens.shape)

  x = torch.tensor(logits.astype(np.float64), requires_grad=True)
  logp_all = torch.log_softmax(x / temperature, dim=-1)
  picked = torch.gather(logp_all, -1, torch.tensor(tokens)[..., None].long())[..., 0]
  entropy = -(logp_all.exp() * logp_all).sum(-1)
  ((picked * torch.tensor(g_logp)).sum() + (entropy * torch.tensor(g_ent)).sum()).backward()

  def objective(z):
    logp, ent = lp.token_logprobs_and_entropy(z, tokens, temperature, chunk_size)
    return jnp.sum(logp * g_logp) + jnp.sum(ent * g_ent)

  logp_objective = lambda z: jnp.sum(lp.token_logprobs(z, tokens, temperature, chunk_size) * g_logp)  # noqa: E731
  grad, grad_logp_only = jax.jit(lambda z: (jax.grad(objective)(z), jax.grad(logp_objective)(z)))(logits)
  np.testing.assert_allclose(grad, x.grad.numpy(), rtol=0, atol=1e-5)
  x.grad = None
  (torch.gather(torch.log_softmax(x / temperature, -1), -1, torch.tensor(tokens)[..., None].long())[..., 0]
   * torch.tensor(g_logp)).sum().backward()
  np.testing.assert_allclose(grad_logp_only, x.grad.numpy(), rtol=0, atol=1e-5)


def test_from_hidden_equals_from_logits():
  rng = np.random.default_rng(4)
  B, T, D, V, chunk_size = 2, 11, 8, 40, 4
  hidden = rng.normal(size=(B, T, D)).astype(np.float32)
  weight = rng.normal(size=(D, V)).astype(np.float32)
  tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
  want_logp, want_entropy = torch_reference(hidden.astype(np.float64) @ weight.astype(np.float64), tokens, 0.9)

  def via_hidden(h, w):
    return jnp.sum(lp.token_logprobs_from_hidden(h, w, tokens, 0.9, chunk_size) * np.arange(T))

  def via_full_logits(h, w):
    logp_all = jax.nn.log_softmax(jnp.einsum("BTD,DV->BTV", h, w) / 0.9)
    return jnp.sum(jnp.take_along_axis(logp_all, tokens[..., None], -1)[..., 0] * np.arange(T))

  @jax.jit
  def run(h, w):
    head = lambda x: jnp.einsum("BCD,DV->BCV", x, w)  # noqa: E731  a callable head (e.g. model.logits)
    return (lp.token_logprobs_from_hidden(h, w, tokens, 0.9, chunk_size),
            lp.token_logprobs_from_hidden(h, head, tokens, 0.9, chunk_size, with_entropy=True),
            jax.grad(via_hidden, argnums=(0, 1))(h, w), jax.grad(via_full_logits, argnums=(0, 1))(h, w))

  logp, (logp2, entropy), got_grads, want_grads = run(hidden, weight)
  np.testing.assert_allclose(logp, want_logp, rtol=0, atol=1e-5)
  np.testing.assert_allclose(logp2, want_logp, rtol=0, atol=1e-5)
  np.testing.assert_allclose(entropy, want_entropy, rtol=0, atol=1e-5)
  # Gradients w.r.t. hidden and the head weight equal those through the full logits.
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_kept_logits_give_the_same_gradients_and_run_the_head_and_softmax_once_in_the_backward():
  B, T, D, V, chunk_size = 2, 12, 6, 40, 4

  def loss(h, w, tokens, keep):
    logp, entropy = lp.token_logprobs_from_hidden(h, w, tokens, 0.9, chunk_size, with_entropy=True, keep_logits=keep)
    return jnp.sum(logp * np.arange(T)) + jnp.sum(entropy)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
  # The kept path's backward is its own formula (`_kept_chunk_stats`), not autodiff's: both are checked against
  # the fp64 gradient. Each error is fp32 rounding (a few ulps of the gradient's largest entry), so which path
  # is closer on one draw depends on the CPU's summation order (one draw, seed 5, once favoured autodiff on one
  # host and the kept path on another); over several draws the kept formula's errors are no larger than
  # autodiff's. (A formula that loses accuracy shows: p = exp(x - lse) in place of exp(x - m) / s gives 2x.)
  errors = {"kept": np.zeros(2), "recomputed": np.zeros(2)}
  for seed in range(8):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(B, T, D)).astype(np.float32))
    weight = jnp.asarray(rng.normal(size=(D, V)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, V, size=(B, T)).astype(np.int32))
    with jax.enable_x64(True):
      exact = jax.grad(loss, argnums=(0, 1))(np.asarray(hidden, np.float64), np.asarray(weight, np.float64), tokens,
                                             False)
    assert exact[0].dtype == np.float64
    for name, keep in (("kept", True), ("recomputed", False)):
      for i, (g, want) in enumerate(zip(grad(hidden, weight, tokens, keep), map(np.asarray, exact))):
        error = np.max(np.abs(np.asarray(g, np.float64) - want)) / np.max(np.abs(want))
        assert error < 1e-6, (name, seed, i, error)  # about 8 fp32 ulps of the largest entry
        errors[name][i] += error
  assert np.all(errors["kept"] <= 1.25 * errors["recomputed"]), errors
  rng = np.random.default_rng(5)
  hidden = jnp.asarray(rng.normal(size=(B, T, D)).astype(np.float32))
  weight = jnp.asarray(rng.normal(size=(D, V)).astype(np.float32))
  tokens = jnp.asarray(rng.integers(0, V, size=(B, T)).astype(np.int32))
  fixed = lambda h, w, keep: loss(h, w, tokens, keep)  # noqa: E731  this draw's tokens
  # The head's [B * C, D] x [D, V] matmul in the compiled program (dW is [D, V], dh [B * C, D]): forward once
  # per chunk either way; the backward re-runs it only without kept logits.
  def head_matmuls(keep):
    hlo = jax.jit(jax.value_and_grad(fixed, argnums=(0, 1)), static_argnums=2).lower(hidden, weight, keep).compile().as_text()
    return len(re.findall(rf"= f32\[{B * chunk_size},{V}\]\{{[^}}]*\}} dot\(", hlo))
  assert head_matmuls(False) == 2 and head_matmuls(True) == 1, (head_matmuls(False), head_matmuls(True))

  # With kept logits the backward reads the forward's lse and entropy: no reduction over the vocab of its own
  # (max, sum of exp: recomputed without them, two more passes over the [B, C, V] logits per chunk).
  def vocab_reductions(fn):
    hlo = jax.jit(fn, static_argnums=2).lower(hidden, weight, True).compile().as_text()
    return len(re.findall(rf"= f32\[{B},{chunk_size}\]\{{[^}}]*\}} reduce\(", hlo))
  assert vocab_reductions(jax.value_and_grad(fixed, argnums=(0, 1))) == vocab_reductions(fixed) > 0


def test_vocab_sharded_logits_on_the_mesh():
  """Logits sharded over (batch, vocab) on 8 simulated devices give the unsharded numbers."""
  mesh = sharding.make_mesh(data=1, fsdp=2, tensor=4)
  logits, tokens = random_case(B=4, T=9, V=64, seed=5)
  placed = jax.device_put(logits, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
  with jax.set_mesh(mesh):
    logp, entropy = jax.jit(lambda x, t: lp.token_logprobs_and_entropy(x, t, chunk_size=4))(placed, tokens)
  want_logp, want_entropy = torch_reference(logits, tokens, 1.0)
  np.testing.assert_allclose(logp, want_logp, rtol=0, atol=1e-5)
  np.testing.assert_allclose(entropy, want_entropy, rtol=0, atol=1e-5)


def compiled_temp_bytes(fn, T, V=QWEN_VOCAB, B=1):
  args = (jax.ShapeDtypeStruct((B, T, V), jnp.bfloat16), jax.ShapeDtypeStruct((B, T), jnp.int32))
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", ["logprobs", "logprobs_and_entropy", "grad"])
def test_compiled_temp_memory_below_twice_the_bf16_logits(name):
  """Compile only (no execution): T = 512 keeps this cheap; benchmarks/logprobs_memory.py does T = 4096."""
  fns = {
      "logprobs": lambda x, t: lp.token_logprobs(x, t),
      "logprobs_and_entropy": lambda x, t: lp.token_logprobs_and_entropy(x, t),
      "grad": jax.grad(lambda x, t: sum(jnp.sum(a) for a in lp.token_logprobs_and_entropy(x, t))),
  }
  T = 512
  logits_bytes = T * QWEN_VOCAB * 2
  temp = compiled_temp_bytes(fns[name], T)
  assert temp < 2 * logits_bytes, f"{name}: temp {temp / 1e6:.1f} MB >= 2 x logits {logits_bytes / 1e6:.1f} MB"
