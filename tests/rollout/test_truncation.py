"""The fast top-p and top-k paths (rollout/truncation.py): exact against the sorted references whichever path a
row takes (buffer, loop, overflow), the same under a mesh as on one device, and the loops' round counts bounded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import sharding
from pacs_jax.rollout import sampling, truncation

V = 151_936


def sorted_nucleus_argmax(scaled, z, p):
  """The reference: argmax of z over a stable sort's nucleus (mass before a token, summed in float64, < p)."""
  order = np.argsort(-scaled, axis=-1, kind="stable")
  probs = np.asarray(jax.nn.softmax(jnp.asarray(np.take_along_axis(scaled, order, -1)), axis=-1), np.float64)
  mass_before = np.zeros_like(probs)
  np.put_along_axis(mass_before, order, np.cumsum(probs, -1) - probs, -1)
  return np.argmax(np.where(mass_before < p, z, -np.inf), -1), mass_before


def logits_and_noise(rows, vocab, scale, seed=0):
  rng = np.random.default_rng(seed)
  scaled = (rng.normal(size=(rows, vocab)) * scale).astype(jnp.bfloat16).astype(np.float32)  # ties, as bf16 gives
  scaled[::2, ::7] = -np.inf  # masked tokens in every other row (rows the buffer leaves to the overflow branch)
  return scaled, scaled + rng.gumbel(size=(rows, vocab)).astype(np.float32)


@pytest.mark.parametrize("regenerate", [True, False])
@pytest.mark.parametrize("p,sizes", [(0.5, (8, 1)), (0.9, (2, 1)), (0.95, None), (0.99, (1, 1))])
def test_every_path_draws_the_sorted_nucleus_argmax(p, sizes, regenerate):
  """Small buffers force rows through the buffer's loop and the overflow branch; each row's draw is still the
  argmax over the sort's nucleus (a token within float round-off of the cut aside), and the same as with a buffer
  of every row."""
  scaled, z = logits_and_noise(64, 3000, 0.5)
  run = jax.jit(lambda s, z, sizes: truncation.nucleus(s, z, lambda x, z_rows: z_rows, p, sizes, True, regenerate),
                static_argnums=2)
  got, _, _, _, rounds = run(jnp.asarray(scaled), jnp.asarray(z), sizes)
  full = run(jnp.asarray(scaled), jnp.asarray(z), (64, 64))[0]
  want, mass_before = sorted_nucleus_argmax(scaled, z, p)
  got = np.asarray(got)
  for row in np.flatnonzero(got != want):
    assert min(abs(mass_before[row, got[row]] - p), abs(mass_before[row, want[row]] - p)) < 1e-6, (p, row)
  assert (got != want).sum() <= 1
  np.testing.assert_array_equal(got, np.asarray(full))
  if p == 0.5:
    assert int(rounds) >= 1  # half the rows miss round 1: the buffer's loop ran, and most rows overflowed it


def test_log_probs_and_tokens_match_the_reference_on_the_real_vocabulary():
  scaled, _ = logits_and_noise(8, V, 1.0, seed=1)
  logits = jnp.asarray(scaled * 0.6)
  keys = jax.random.split(jax.random.key(3), 8)
  tokens, logprobs = jax.jit(sampling.TopP(0.95, 0.6).sample_with_logprobs)(logits, keys)
  expected = jax.nn.log_softmax(logits / 0.6)[jnp.arange(8), tokens]
  np.testing.assert_allclose(logprobs, expected, atol=1e-6)
  noise = np.stack([np.asarray(jax.random.gumbel(k, (V,))) for k in keys])
  z = np.asarray(logits / 0.6) + noise
  want, _ = sorted_nucleus_argmax(np.asarray(logits / 0.6), z, 0.95)
  np.testing.assert_array_equal(np.asarray(tokens), want)


@pytest.mark.parametrize("k", [1, 20, 50])
def test_top_k_by_blocks_equals_lax_top_k(k):
  """Values and ids as lax.top_k over the whole vocabulary, ties included (bf16 logits, -inf, all equal)."""
  scaled, _ = logits_and_noise(6, V, 1.0, seed=k)
  scaled[0] = 0.0  # every token tied
  scaled[1, :300] = scaled[1].max()  # ties at the top, across blocks
  x = jnp.asarray(scaled)
  values, ids = jax.jit(truncation.top_k, static_argnums=1)(x, k)
  want_values, want_ids = jax.lax.top_k(x, k)
  np.testing.assert_array_equal(values, want_values)
  np.testing.assert_array_equal(ids, want_ids)


def test_top_k_draws_are_those_of_lax_top_k():
  """TopK's draws, bit for bit, are the categorical draw over lax.top_k's candidates from the same key."""
  logits = jax.random.normal(jax.random.key(0), (16, V)).astype(jnp.bfloat16).astype(jnp.float32) * 2
  keys = jax.random.split(jax.random.key(1), 16)

  def before(row, key):
    top, index = jax.lax.top_k(row[None], 20)
    return index[0, jax.random.categorical(key, top / 0.7, axis=-1)[0]]

  want = jax.jit(jax.vmap(before))(logits, keys)
  np.testing.assert_array_equal(jax.jit(sampling.TopK(20, 0.7).sample)(logits, keys), want)


def test_the_same_draws_under_a_mesh():
  """Batch shards take their later rounds on their own rows (shard_map), vocabulary split over tensor: the draws
  equal one device's."""
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  logits = jax.random.normal(jax.random.key(0), (32, 8192)) * 0.3
  keys = jax.random.split(jax.random.key(1), 32)
  alone = {m: jax.jit(m.sample_with_logprobs)(logits, keys) for m in (sampling.TopP(0.9, 0.6), sampling.TopK(4, 0.6))}
  shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), "tensor"))
  with jax.set_mesh(mesh):
    assert truncation.batch_groups(32) == 4
    for method, (tokens, logprobs) in alone.items():
      got = jax.jit(method.sample_with_logprobs)(jax.device_put(logits, shard), keys)
      np.testing.assert_array_equal(got[0], tokens)
      np.testing.assert_allclose(got[1], logprobs, atol=1e-6)
    # The TPU's way (noise drawn again, rows gathered by a matmul) on the shards, against one device's CPU way.
    scaled = logits / 0.6
    z = scaled + jax.vmap(lambda k: jax.random.gumbel(k, (8192,)))(keys)
    tpu_way = jax.jit(lambda s, z: truncation.nucleus(s, z, lambda x, z_rows: z_rows, 0.9, (2, 1), regenerate=True))
    np.testing.assert_array_equal(tpu_way(jax.device_put(scaled, shard), z)[0], alone[sampling.TopP(0.9, 0.6)][0])


def test_round_counts_are_bounded_by_the_model():
  """Near-uniform logits (a row's first draw misses with probability about 1 - p, the most it can): the buffer's
  loop runs no more rounds than `loop_rounds` allows, and no more than 3 in any of these draws."""
  rows, p = 128, 0.95
  logits = jax.random.normal(jax.random.key(0), (rows, V)).astype(jnp.bfloat16).astype(jnp.float32) * 0.3
  scaled = logits / 0.6

  @jax.jit
  def rounds(scaled, seed):  # the logits an argument: closed over, they were a 78 MB constant folded for a minute
    z = scaled + jax.random.gumbel(jax.random.key(seed), scaled.shape)
    return truncation.nucleus(scaled, z, lambda x, z_rows: z_rows, p, with_rounds=True)[4]

  got = np.array([int(rounds(scaled, seed)) for seed in range(8)])
  model, _, _ = truncation.loop_rounds(rows, 1, p)
  assert got.max() <= 3 and got.mean() <= model.mean() + 3 * model.std() / np.sqrt(len(got)), (got, model.mean())
  assert truncation.retry_sizes(128, 0.95) == (16, 2)
