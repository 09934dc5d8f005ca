"""Sharded forward on 8 simulated CPU devices equals the single-device forward; shardings are the declared ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import sharding
from pacs_jax.models import families as registry, hf, qwen2

MESHES = {"fsdp4_tensor2": dict(fsdp=4, tensor=2), "data2_fsdp4": dict(data=2, fsdp=4)}
# Tiny config whose dims the mesh axes divide (so nothing silently falls back to replication).
CONFIG = qwen2.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0,
                           tie_word_embeddings=False)


def make_model():
  return registry.causal_lm(CONFIG, rngs=nnx.Rngs(0))


def batch():
  ids = np.random.default_rng(0).integers(1, CONFIG.vocab_size, (8, 12)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, :5] = 0
  mask[6, :9] = 0
  return jnp.asarray(ids), jnp.asarray(mask)


def forward(model, ids, mask):
  return model(ids, mask)


def test_eight_devices():
  assert jax.device_count() == 8


def test_make_mesh_sizes_and_errors():
  assert dict(sharding.make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  with pytest.raises(ValueError, match="data\\*fsdp\\*tensor = 6"):
    sharding.make_mesh(data=3, fsdp=1, tensor=2)
  with pytest.raises(ValueError, match="at most one"):
    sharding.make_mesh(data=-1, fsdp=-1)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_forward_equals_single_device(mesh_name):
  ids, mask = batch()
  expected = np.asarray(nnx.jit(forward)(make_model(), ids, mask))
  mesh = sharding.make_mesh(**MESHES[mesh_name])
  model = sharding.create_sharded(make_model, mesh, "train")
  # Parameters live in their declared shardings, not replicated; stacked layers keep their leading
  # "layers" axis whole (each device holds its slice of every layer).
  attn, mlp = model.model.layers.self_attn, model.model.layers.mlp
  expect_spec = {"q": P(None, "fsdp", "tensor", None), "up": P(None, "fsdp", "tensor"), "embed": P("tensor", "fsdp")}
  for name, var in (("q", attn.q_kernel), ("up", mlp.up_kernel), ("embed", model.model.embed_tokens)):
    sh = var[...].sharding
    assert sh.is_equivalent_to(NamedSharding(mesh, expect_spec[name]), var[...].ndim), (name, sh.spec)
    assert not sh.is_fully_replicated
    assert len(var[...].addressable_shards) == 8
    assert var[...].addressable_shards[0].data.size < var[...].size
  with jax.set_mesh(mesh):
    ids_s = jax.device_put(ids, NamedSharding(mesh, P(sharding.BATCH_AXES, None)))
    mask_s = jax.device_put(mask, NamedSharding(mesh, P(sharding.BATCH_AXES, None)))
    got = nnx.jit(forward)(model, ids_s, mask_s)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)


def test_sample_mode_keeps_weights_whole_along_fsdp():
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  model = sharding.create_sharded(make_model, mesh, "sample")
  q, down = model.model.layers.self_attn.q_kernel[...], model.model.layers.mlp.down_kernel[...]
  assert q.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tensor", None)), 4)
  assert down.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tensor", None)), 3)


def test_non_dividing_dims_stay_replicated():
  spec = sharding.spec_for(("kv_heads", "head_dim"), sharding.PARAM_RULES["train"], {"tensor": 4}, (2, 64))
  assert spec == P(None, None)


def test_activation_constraints_are_real_on_cpu():
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  model = sharding.create_sharded(make_model, mesh, "train")
  ids, mask = batch()
  graphdef, state = nnx.split(model)
  with jax.set_mesh(mesh):
    hlo = jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, m)).lower(state, ids, mask).as_text()
  # The scanned layer body (traced once for all layers) constrains its residual stream, q / k / v, the
  # attention output and the MLP activations; embeddings and logits are constrained outside it.
  assert "stablehlo.while" in hlo
  assert hlo.count("sharding_constraint") + hlo.count("@Sharding") >= 6 + 2


def test_load_pretrained_into_mesh_reads_slices(tmp_path):
  import torch
  import transformers
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
  single, _ = hf.load_pretrained(str(tmp_path))
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  sharded, _ = hf.load_pretrained(str(tmp_path), mesh=mesh)
  q = sharded.model.layers.self_attn.q_kernel[...]
  assert q.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp", "tensor", None)), 4)
  # Each device holds only its slice of the checkpoint (of every layer).
  assert q.addressable_shards[0].data.shape == (2, 16, 2, 16)
  for a, b in zip(jax.tree.leaves(nnx.state(single)), jax.tree.leaves(nnx.state(sharded))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
