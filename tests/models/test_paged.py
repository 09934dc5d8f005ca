"""Paged KV cache maths (models/paged.py) against the dense cache's: writes land where the dense cache has
them, and ragged decode attention over live pages equals dense masked attention (fp32, 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import sharding
from pacs_jax.models import attention, paged

B, K, G, H, PS, M = 5, 2, 3, 8, 4, 6  # slots, kv heads, query heads per kv head, head dim, page size, pages/slot
L = PS * M


def _paged_copy(rng, dense_k, dense_v, num_pages):
  """Scatters dense k, v [B, K, L, H] into randomly assigned pages (page 0 left null): (pages, table)."""
  perm = rng.permutation(np.arange(1, num_pages))[:B * M].reshape(B, M).astype(np.int32)
  pages = np.zeros((num_pages, PS, 2 * K, H), np.float32)
  for s in range(B):
    for row in range(L):
      p, r = perm[s, row // PS], row % PS
      pages[p, r, 0::2] = dense_k[s, :, row]
      pages[p, r, 1::2] = dense_v[s, :, row]
  return pages, perm


@pytest.fixture
def case():
  rng = np.random.default_rng(0)
  k = rng.normal(size=(B, K, L, H)).astype(np.float32)
  v = rng.normal(size=(B, K, L, H)).astype(np.float32)
  q = rng.normal(size=(B, K * G, H)).astype(np.float32)
  pages, table = _paged_copy(rng, k, v, B * M + 3)
  kv_lens = np.array([1, 7, L, 4, 13], np.int32)  # one page, a partial page, all pages, exactly one, ...
  return q, k, v, pages, table, kv_lens


def _dense_attention(q, k, v, kv_lens):
  mask = np.arange(L)[None, None, :] < kv_lens[:, None, None]  # [B, 1, L]
  out = attention.attend(jnp.asarray(q).reshape(B, 1, K, G, H), k, v, mask)
  return np.asarray(out).reshape(B, K * G, H)


def test_write_pages_lands_in_each_slots_page(case):
  q, k, v, pages, table, _ = case
  rng = np.random.default_rng(1)
  positions = np.array([0, 5, L - 1, 4, 13], np.int32)
  k_new, v_new = (rng.normal(size=(B, K, H)).astype(np.float32) for _ in range(2))
  def expected(base):
    out = base.copy()
    for s, pos in enumerate(positions):
      out[table[s, pos // PS], pos % PS, 0::2] = k_new[s]
      out[table[s, pos // PS], pos % PS, 1::2] = v_new[s]
    return out

  out = np.asarray(jax.jit(paged.write_pages)(pages, k_new, v_new, table, positions))
  np.testing.assert_array_equal(out, expected(pages))
  # Every layer's pages, written at one layer: the other layer unchanged.
  stacked = np.stack([pages, pages + 1])
  out = np.asarray(jax.jit(paged.write_pages)(stacked, k_new, v_new, table, positions, jnp.int32(1)))
  np.testing.assert_array_equal(out[0], pages)
  np.testing.assert_array_equal(out[1], expected(pages + 1))


@pytest.mark.parametrize("slack", [0, 5])
def test_ragged_attention_equals_dense_masked_attention(case, slack):
  q, k, v, pages, table, kv_lens = case
  live = int(np.sum(-(-kv_lens // PS))) + slack  # exactly the live pages, or padded to a larger budget
  fn = jax.jit(paged.ragged_decode_attention, static_argnames="page_budget")
  out = fn(q, pages, table, kv_lens, page_budget=live)
  np.testing.assert_allclose(np.asarray(out), _dense_attention(q, k, v, kv_lens), atol=1e-5, rtol=1e-5)
  # Read from every layer's pages at one layer.
  stacked = np.stack([np.zeros_like(pages), pages])
  out = jax.jit(paged.ragged_decode_attention, static_argnames="page_budget")(
      q, stacked, table, kv_lens, page_budget=live, layer=jnp.int32(1))
  np.testing.assert_allclose(np.asarray(out), _dense_attention(q, k, v, kv_lens), atol=1e-5, rtol=1e-5)


def test_live_pairs_list_only_live_pages():
  slot, page, valid = paged.live_pairs(jnp.array([1, 9, 4], jnp.int32), 4, 8)
  assert np.asarray(valid).tolist() == [True] * 5 + [False] * 3
  assert np.asarray(slot)[:5].tolist() == [0, 1, 1, 1, 2]
  assert np.asarray(page)[:5].tolist() == [0, 0, 1, 2, 0]


def test_paged_layer_on_shard_local_tables(case):
  """Two shards (a 2-device mesh): each slot's table holds indices local to its shard's half of the pages."""
  q, k, v, pages, table, kv_lens = case
  q, k, v, table, kv_lens = q[:4], k[:4], v[:4], table[:4], kv_lens[:4]
  # Shard 0 holds slots 0, 1's pages, shard 1 slots 2, 3's (the rest of each half zeroed): a table read as
  # global indices would attend to zeros.
  shard0, shard1 = pages.copy(), pages.copy()
  shard0[table[2:4].reshape(-1)] = 0
  shard1[table[0:2].reshape(-1)] = 0
  both = np.concatenate([shard0, shard1])
  positions = kv_lens - 1
  k_new, v_new = k[np.arange(4), :, positions], v[np.arange(4), :, positions]  # rewrite the last row, same values
  step = paged.PagedStep(pages=jnp.asarray(both)[None], page_table=jnp.asarray(table), positions=jnp.asarray(positions),
                         kv_lens=jnp.asarray(kv_lens), page_budget=int(np.sum(-(-kv_lens // PS))), shards=2)
  with jax.set_mesh(sharding.make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2])):
    out, new = jax.jit(paged.paged_layer)(step, jnp.int32(0), jnp.asarray(q), k_new, v_new)
  with pytest.raises(ValueError, match="2 page pools need the mesh"):
    paged.paged_layer(step, jnp.int32(0), jnp.asarray(q), k_new, v_new)
  mask = np.arange(L)[None, None, :] < kv_lens[:, None, None]
  ref = attention.attend(jnp.asarray(q).reshape(4, 1, K, G, H), k, v, mask).reshape(4, K * G, H)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(new.pages[0]), both)  # rewrote each slot's last row, same values
