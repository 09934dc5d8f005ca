"""Flash attention kernels (`model.attention_impl`) against the XLA reference `attention.attend`: TPU splash
attention in Pallas interpret mode on CPU (alone, under an 8-device mesh, in the whole model) and GPU cuDNN
(`gpu`-marked). Compared on real-token query rows: a padded query row's output is masked out of every loss,
and the kernels give it the padding before it instead of XLA's uniform softmax over all keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.models import attention, families as registry, flash

B, T, K, G, H = 3, 200, 2, 2, 16  # T not a multiple of the 128-row blocks: the kernel pads it


def inputs(seed=0):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(B, T, K, G, H)), jnp.float32)
  k, v = (jnp.asarray(r.normal(size=(B, K, T, H)), jnp.float32) for _ in range(2))
  real = np.ones((B, T), bool)
  real[1, :37], real[2, :150] = False, False  # left padding, one row mostly padding
  causal = np.arange(T)[:, None] >= np.arange(T)[None, :]
  mask = jnp.asarray(causal[None] & real[:, None, :])  # [B, T, T] as decoder.Backbone builds it
  # Cotangent on real rows only (a loss over real tokens).
  w = jnp.asarray(r.normal(size=(B, T, K, G, H)) * real[:, :, None, None, None], jnp.float32)
  return q, k, v, mask, real, w


def value_and_grads(attend, q, k, v, mask, w):
  out = attend(q, k, v, mask)
  grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, mask) * w), argnums=(0, 1, 2))(q, k, v)
  return out, grads


def assert_equal_to_xla(attend, q, k, v, mask, real, w):
  ref, ref_grads = jax.jit(lambda *a: value_and_grads(attention.attend, *a))(q, k, v, mask, w)
  out, grads = jax.jit(lambda *a: value_and_grads(attend, *a))(q, k, v, mask, w)
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5, rtol=0)
  for name, a, b in zip("qkv", ref_grads, grads):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0, err_msg=f"d{name}")


def test_splash_equals_xla_forward_and_gradient():
  assert_equal_to_xla(flash.splash_attend, *inputs())


@pytest.mark.parametrize("fsdp,tensor", [(4, 2), (2, 4)])
def test_splash_under_a_mesh_runs_per_shard_and_equals_xla(fsdp, tensor):
  # 4 rows over fsdp, heads over tensor; with tensor = 4 the 2 kv heads cannot follow the 4 query heads'
  # split, and each query head takes its own copy of its kv head.
  q, k, v, mask, real, w = inputs(1)
  q, k, v, mask, w = (jnp.concatenate([x, x[:1]]) for x in (q, k, v, mask, w))
  real = np.concatenate([real, real[:1]])
  mesh = sharding.make_mesh(data=1, fsdp=fsdp, tensor=tensor)
  with jax.set_mesh(mesh):
    assert_equal_to_xla(flash.splash_attend, q, k, v, mask, real, w)
    lowered = jax.jit(flash.splash_attend).lower(q, k, v, mask).as_text()
  assert "shard_map" in lowered or "sdy.manual_computation" in lowered


def tiny(impl, **kw):
  cfg = registry.preset("tiny", attention_impl=impl, **kw)
  return registry.causal_lm(cfg, rngs=nnx.Rngs(0))


def token_logprobs(model, ids, mask):
  """Log-probs of each real token after a real one (the trainer's response tokens: a prompt's last token is real)."""
  logp = jax.nn.log_softmax(model(ids, mask).astype(jnp.float32))
  return jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0] * mask[:, :-1] * mask[:, 1:]


def test_whole_model_with_splash_equals_xla():
  # Logits on real tokens and the gradient of a log-prob loss, with the remat policy the released configs use.
  ids = jax.random.randint(jax.random.key(0), (2, 150), 0, 256)
  mask = jnp.ones((2, 150), jnp.int32).at[1, :40].set(0)
  real = np.asarray(mask, bool)
  kw = dict(remat=True, remat_policy="matmuls")
  ref, fast = tiny("xla", **kw), tiny("splash", **kw)
  forward = nnx.jit(lambda m, i, k: m(i, k))
  np.testing.assert_allclose(np.asarray(forward(fast, ids, mask))[real], np.asarray(forward(ref, ids, mask))[real],
                             atol=1e-5, rtol=0)
  loss = lambda m, i, k: jnp.sum(token_logprobs(m, i, k))
  g_ref, g_fast = (nnx.jit(nnx.grad(loss))(m, ids, mask) for m in (ref, fast))
  for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_fast)):
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


def test_auto_picks_the_platforms_kernel_and_bad_names_are_refused():
  assert [flash.resolve("auto", p) for p in ("tpu", "gpu", "cpu")] == ["splash", "cudnn", "xla"]
  # cuDNN takes 16-bit inputs: fp32 models on a GPU (the equality tests) keep the XLA path.
  assert [flash.resolve("auto", "gpu", d) for d in (jnp.bfloat16, jnp.float32)] == ["cudnn", "xla"]
  assert flash.resolve("auto", dtype=jnp.float32) == "xla"  # on CPU or GPU, these tests' fp32 models
  cfg = config_lib.default_config()
  cfg.model.attention_impl = "flash"
  with pytest.raises(config_lib.ConfigError, match="model.attention_impl"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)
  cfg = config_lib.default_config()
  cfg.model.remat_policy = "dots"
  with pytest.raises(config_lib.ConfigError, match="model.remat_policy"):
    config_lib.validate(cfg, num_devices=1, check_paths=False)


@pytest.mark.gpu
def test_cudnn_equals_xla_forward_and_gradient():
  # cuDNN flash attention takes 16-bit inputs only (no fp32 run exists): bf16 inputs, against XLA's attention
  # in fp32 on the same bf16 numbers, within bf16 resolution (2^-8 relative) of each array's scale.
  q, k, v, mask, real, w = inputs(2)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  f32 = lambda *xs: [np.asarray(jnp.asarray(x, jnp.float32)) for x in xs]
  ref, ref_grads = jax.jit(lambda *a: value_and_grads(attention.attend, *a))(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                                            mask, w)
  out, grads = jax.jit(lambda *a: value_and_grads(flash.cudnn_attend, *a))(q, k, v, mask, w.astype(jnp.bfloat16))
  (ref, out) = f32(ref, out)
  np.testing.assert_allclose(out[real], ref[real], atol=2 ** -7 * np.abs(ref[real]).max(), rtol=0)
  for name, a, b in zip("qkv", f32(*ref_grads), f32(*grads)):
    np.testing.assert_allclose(b, a, atol=2 ** -6 * np.abs(a).max(), rtol=0, err_msg=f"d{name}")
