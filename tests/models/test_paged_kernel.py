"""The TPU ragged paged attention kernel (interpret mode on CPU) against the XLA path (`paged.
ragged_decode_attention`) and plain softmax attention over each slot's rows, per shard under a mesh, and compiled ahead of time for a TPU v5p topology."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from pacs_jax import sharding
from pacs_jax.models import paged, paged_kernel
from pacs_jax.compile import aot_measure
from tests.pallas_interpret import ragged_paged_attention_interpreted

K, G, H, PS = 2, 2, 128, 16  # kv heads, query heads per kv head, head dim (the kernel needs 128 lanes), page size
N = K * G


def dense_reference(q, pages, page_table, kv_lens):
  """Softmax attention of each slot's query over its first kv_lens rows, read page by page: [B, N, H]."""
  q, pages = np.asarray(q, np.float64), np.asarray(pages, np.float64)
  out = np.zeros_like(q)
  for s, (row_pages, n) in enumerate(zip(np.asarray(page_table), np.asarray(kv_lens))):
    rows = pages[row_pages].reshape(-1, 2 * K, H)[:n]  # [n, 2K, H]
    k, v = rows[:, 0::2], rows[:, 1::2]  # [n, K, H]
    for h in range(N):
      scores = k[:, h // G] @ q[s, h] / np.sqrt(H)
      p = np.exp(scores - scores.max())
      out[s, h] = (p / p.sum()) @ v[:, h // G]
  return out


def gathered_attention(q, pages, page_table, kv_lens):
  """The same in jnp, one gather of each slot's whole table (a per-shard function for the sharding test)."""
  (B, M), n, k = page_table.shape, q.shape[1], pages.shape[2] // 2  # per shard: its own heads
  rows = pages[page_table].reshape(B, M * PS, 2 * k, H)  # [B, M * ps, 2K, H]
  k_rows, v = rows[:, :, 0::2], rows[:, :, 1::2]  # [B, S, K, H]
  scores = jnp.einsum("BKGH,BSKH->BKGS", q.reshape(B, k, n // k, H), k_rows, precision="highest") / np.sqrt(H)
  scores = jnp.where(jnp.arange(M * PS)[None, None, None, :] < kv_lens[:, None, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("BKGS,BSKH->BKGH", probs, v, precision="highest").reshape(B, n, H)


def random_case(rng, slots, pages_per_slot, pool, kv_lens):
  """Random queries and pages; each slot's page table a random draw of distinct pages from the pool."""
  q = jnp.asarray(rng.normal(size=(slots, N, H)), jnp.float32)
  pages = jnp.asarray(rng.normal(size=(pool, PS, 2 * K, H)), jnp.float32)
  table = rng.permutation(np.arange(1, pool))[:slots * pages_per_slot].reshape(slots, pages_per_slot)
  return q, pages, jnp.asarray(table, jnp.int32), jnp.asarray(kv_lens, jnp.int32)


def test_kernel_equals_the_xla_path_and_softmax_attention_over_each_slots_pages():
  """Acceptance 1 (decode kernel): fp32, 1e-5."""
  rng = np.random.default_rng(0)
  # One row, a full page, one past a page, several pages, the whole table.
  kv_lens = [1, PS, PS + 1, 3 * PS - 5, 4 * PS]
  q, pages, table, lens = random_case(rng, len(kv_lens), 4, 32, kv_lens)
  with ragged_paged_attention_interpreted():
    out = paged_kernel.pallas_decode_attention(q, pages, table, lens, num_kv_pages_per_block=2,
                                               num_queries_per_block=1)
  live = sum(-(-n // PS) for n in kv_lens)
  xla = paged.ragged_decode_attention(q, pages, table, lens, page_budget=live + 3)  # 3 padding pairs
  np.testing.assert_allclose(np.asarray(out), np.asarray(xla), rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), dense_reference(q, pages, table, lens), rtol=0, atol=1e-5)


def test_pages_past_a_slots_length_are_never_read():
  rng = np.random.default_rng(1)
  q, pages, table, lens = random_case(rng, 3, 4, 16, [5, 20, 33])
  with ragged_paged_attention_interpreted():
    run = lambda p: np.asarray(paged_kernel.pallas_decode_attention(q, p, table, lens, num_kv_pages_per_block=1,
                                                                    num_queries_per_block=1))
    before = run(pages)
    # NaN in every row beyond each slot's length (the rest of its last page, and its unused pages).
    dead = np.ones(pages.shape[:2], bool)
    for row_pages, n in zip(np.asarray(table), np.asarray(lens)):
      for i, page in enumerate(row_pages):
        dead[page, :max(0, min(PS, n - i * PS))] = False
    after = run(jnp.where(jnp.asarray(dead)[:, :, None, None], jnp.nan, pages))
  np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 4, 1)], ids=["data2_fsdp2_tensor2", "fsdp4"])
def test_on_shards_runs_each_pool_with_local_page_indices(mesh_shape):
  """8 CPU devices: slots and page pools split over the batch axes, kv heads over tensor; each shard's
  page table holds indices into its own pool. Equals the unsharded function on global indices. (The
  kernel's TPU interpreter does not run under a multi-device shard_map on CPU; the TPU compile below
  covers the kernel per shard.)"""
  mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:np.prod(mesh_shape)])
  shape = dict(mesh.shape)
  slots, pool_local, per_slot = 8, 8, 3
  d = paged_kernel.batch_shards(shape, slots)
  assert d == mesh_shape[0] * mesh_shape[1]
  rng = np.random.default_rng(2)
  kv_lens = rng.integers(1, per_slot * PS + 1, size=slots)
  q = jnp.asarray(rng.normal(size=(slots, N, H)), jnp.float32)
  pages = jnp.asarray(rng.normal(size=(d * pool_local, PS, 2 * K, H)), jnp.float32)
  local = np.stack([rng.permutation(np.arange(1, pool_local))[:per_slot] for _ in range(slots)])  # [B, M]
  global_table = local + (np.arange(slots) // (slots // d) * pool_local)[:, None]

  kernel = gathered_attention
  axes = (paged_kernel.QUERY_AXES, paged_kernel.PAGE_AXES, paged_kernel.SLOT_AXES + (None,), paged_kernel.SLOT_AXES)
  specs = paged_kernel.shard_specs(shape, slots=slots, kv_heads=K, axes=axes)
  args = [jax.device_put(x, NamedSharding(mesh, s))
          for x, s in zip((q, pages, jnp.asarray(local, jnp.int32), jnp.asarray(kv_lens, jnp.int32)), specs)]
  with jax.set_mesh(mesh):
    sharded = jax.jit(lambda *a: paged_kernel.on_shards(kernel, a, axes, paged_kernel.QUERY_AXES, slots=slots,
                                                        kv_heads=K))(*args)
  whole = kernel(q, pages, jnp.asarray(global_table, jnp.int32), jnp.asarray(kv_lens, jnp.int32))
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(whole), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(whole), dense_reference(q, pages, global_table, kv_lens), rtol=0, atol=1e-5)


def test_kernel_shape_limits_are_named():
  assert paged_kernel.kernel_unsupported(128, 4, jnp.bfloat16) is None
  assert paged_kernel.kernel_unsupported(128, 2, jnp.float32) is None
  assert "head_dim 64" in paged_kernel.kernel_unsupported(64, 4, jnp.bfloat16)
  assert "kv heads per shard" in paged_kernel.kernel_unsupported(128, 6, jnp.bfloat16)


def test_kernel_compiles_for_tpu_v5p_per_shard():
  """Acceptance 2 (decode kernel): the sharded kernel call compiles ahead of time for a v5p slice (libtpu,
  no TPU) as a Mosaic custom call, one per shard, with no all-gather of the pages."""
  with aot_measure.persistent_cache_off():
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=sharding.tpu_topology_devices("v5p:2x2x1"))
  slots, pool, per_slot = 64, 2 * 256, 16
  axes = (paged_kernel.QUERY_AXES, paged_kernel.PAGE_AXES, paged_kernel.SLOT_AXES + (None,), paged_kernel.SLOT_AXES)
  specs = paged_kernel.shard_specs(dict(mesh.shape), slots=slots, kv_heads=K, axes=axes)
  shapes = [((slots, N, H), jnp.bfloat16), ((pool, PS, 2 * K, H), jnp.bfloat16), ((slots, per_slot), jnp.int32),
            ((slots,), jnp.int32)]
  args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(mesh, p)) for (s, t), p in zip(shapes, specs)]
  fn = lambda *a: paged_kernel.on_shards(paged_kernel.pallas_decode_attention, a, axes, paged_kernel.QUERY_AXES,
                                         slots=slots, kv_heads=K)
  # Under the suite's "highest" matmul precision (tests/conftest.py): bf16 tiles take the default one.
  with aot_measure.persistent_cache_off(), jax.set_mesh(mesh):
    compiled = jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  assert "tpu_custom_call" in text
  assert "all-gather" not in text
  # Per chip: a quarter of the pool (fsdp 2 x tensor 2), read in place (no temporary copy of it).
  pool_bytes_per_chip = pool * PS * 2 * K * H * 2 // 4
  assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes_per_chip / 4
