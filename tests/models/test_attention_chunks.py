"""Chunked attention (`attention_chunk`): the same model, forward and backward, in less memory."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pacs_jax import sharding
from pacs_jax.models import families as registry, kv_cache, qwen2

CONFIG = qwen2.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0)

# [B, T] inputs with rows over the batch axes (data, fsdp).
ROWS = lambda mesh: NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES, None))


def models(chunk):
  return (registry.causal_lm(CONFIG, rngs=nnx.Rngs(0)),
          registry.causal_lm(CONFIG.replace(attention_chunk=chunk), rngs=nnx.Rngs(0)))


def left_padded(B, T, seed=1):
  ids = jax.random.randint(jax.random.key(seed), (B, T), 0, CONFIG.vocab_size)
  mask = jnp.ones((B, T), jnp.int32).at[1, :5].set(0).at[2, :T // 2].set(0)
  return ids, mask


def loss(model, ids, mask):
  logp = jax.nn.log_softmax(model(ids, mask))
  return jnp.sum(jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0] * mask[:, 1:])


def test_chunked_forward_and_gradient_equal_unchunked():
  # 37 queries in blocks of 8: the last block is padded.
  whole, chunked = models(8)
  ids, mask = left_padded(3, 37)
  forward = nnx.jit(lambda m, i, k: m(i, k))
  np.testing.assert_allclose(forward(chunked, ids, mask), forward(whole, ids, mask), atol=1e-5, rtol=0)
  g_whole, g_chunked = (nnx.jit(nnx.grad(loss))(m, ids, mask) for m in (whole, chunked))
  for a, b in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_chunked)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(a))))


def test_chunked_prefill_into_the_kv_cache_equals_unchunked():
  whole, chunked = models(4)
  ids, _ = left_padded(2, 11)
  positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
  outs = []
  prefill = nnx.jit(lambda m, c: m.model.forward_with_cache(ids, positions, c))
  for model in (whole, chunked):
    outs.append(prefill(model, kv_cache.init_cache(CONFIG, batch=2, length=16)))
  np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(outs[0][1]), jax.tree.leaves(outs[1][1])):
    np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)


def test_chunked_backward_needs_less_temporary_memory():
  whole, chunked = models(64)
  ids, mask = left_padded(2, 1024)

  def temp_bytes(model):
    grad = jax.jit(lambda m, i, k: nnx.grad(loss)(m, i, k))
    return grad.lower(model, ids, mask).compile().memory_analysis().temp_size_in_bytes

  scores = 2 * CONFIG.num_attention_heads * 1024 * 1024 * 4  # one layer's fp32 scores [B, N, T, S]
  full, blocked = temp_bytes(whole), temp_bytes(chunked)
  print(f"backward temp memory: whole {full / 2**20:.1f} MiB, chunks of 64 {blocked / 2**20:.1f} MiB")
  assert full > scores  # the unchunked backward holds whole score matrices
  assert blocked < full - scores


def test_chunked_sharded_forward_equals_single_device():
  _, chunked = models(4)
  ids, mask = left_padded(8, 12)
  expected = np.asarray(nnx.jit(lambda m, i, k: m(i, k))(chunked, ids, mask))
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  model = sharding.create_sharded(lambda: registry.causal_lm(CONFIG.replace(attention_chunk=4), rngs=nnx.Rngs(0)),
                                  mesh, "train")
  with jax.set_mesh(mesh):
    got = nnx.jit(lambda m, i, k: m(i, k))(model, jax.device_put(ids, ROWS(mesh)),
                                            jax.device_put(mask, ROWS(mesh)))
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)
