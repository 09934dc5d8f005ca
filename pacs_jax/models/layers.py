"""The decoder's layers, shared by every family: RMSNorm, attention (optional q/k/v biases, optional per-head
q/k RMSNorm), the gated MLP, the decoder layer, the layers stacked and run by one `lax.scan`, and remat.

Every parameter carries its logical axis names (`logical_axes` metadata); `pacs_jax.sharding` maps them to mesh
axes per mode (train / sample). Shapes: B batch, T query length, S key length (cache rows), D hidden, N query
heads, K kv heads, G = N // K, H head dim, F mlp width, I LoRA rank.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from pacs_jax import sharding
from pacs_jax.models import attention, flash, paged, rope
from pacs_jax.models.kv_cache import KVCache
from pacs_jax.models.model_config import ModelConfig


def param(rngs: nnx.Rngs, shape, axes, dtype, init=nnx.initializers.normal(0.02)) -> nnx.Param:
  """A parameter of `shape` with its logical axis names (transformers' default init, normal(0.02))."""
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


# ----------------------------------------------------------------------------------------------
# Where a LoRA run's parts enter the layers: `pacs_jax.models.lora` puts a `lora` object (its `lora.Adapted`, static,
# in the graphdef) on each module it adapts, which holds the LoRA layer code. A module without one runs the program it
# always ran: the tests below are plain Python `if`s on its presence.


def adapted(module: nnx.Module, target: str, x, y, to_rank: str, from_rank: str):
  """y = x W of a projection, plus the update of the module's adapters for `target` where it has them
  (`lora.Adapted.update`; `to_rank` and `from_rank` are its two einsums)."""
  lora = getattr(module, "lora", None)
  return y if lora is None else lora.update(module, target, x, y, to_rank, from_rank)


def saved_or_base(module: nnx.Module, name: str) -> nnx.Variable:
  """The parameter `name` of `module`, or the trained copy of it the module computes with where it has one
  (`lora.Adapted.weight`: peft's `modules_to_save`)."""
  lora = getattr(module, "lora", None)
  return getattr(module, name) if lora is None else lora.weight(module, name)


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x²) + eps) * weight over the last axis (the weight's trained copy in a LoRA run that saves it)."""

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

  def __call__(self, x):
    # As transformers: normalise in fp32 (fp64 inputs stay fp64: the fp64 gradient checks), cast back, then scale.
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return saved_or_base(self, "weight")[...].astype(x.dtype) * x32.astype(x.dtype)


def _tensor_size() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)


class Attention(nnx.Module):
  """Grouped-query attention with RoPE; q/k/v biases with `attention_bias`, per-head q/k RMSNorm with `qk_norm`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    D, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size
    pd = c.param_dtype
    self.config = c
    self.q_kernel = param(rngs, (D, N, H), ("embed", "q_heads", "head_dim"), pd)
    self.k_kernel = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
    self.v_kernel = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
    if c.attention_bias:
      self.q_bias = param(rngs, (N, H), ("q_heads", "head_dim"), pd, nnx.initializers.zeros)
      self.k_bias = param(rngs, (K, H), ("kv_heads", "head_dim"), pd, nnx.initializers.zeros)
      self.v_bias = param(rngs, (K, H), ("kv_heads", "head_dim"), pd, nnx.initializers.zeros)
    if c.qk_norm:  # one weight [H] shared by every head
      self.q_norm = RMSNorm(H, c.rms_norm_eps, param_dtype=pd, rngs=rngs)
      self.k_norm = RMSNorm(H, c.rms_norm_eps, param_dtype=pd, rngs=rngs)
    self.o_kernel = param(rngs, (N, H, D), ("q_heads", "head_dim", "embed"), pd)

  def project(self, x, cos, sin):
    """x [B, T, D] -> q [B, T, N, H], k, v [B, T, K, H] (biases, q/k norms and RoPE applied)."""
    dt = self.config.dtype
    x = x.astype(dt)
    wq = sharding.matmul_weight(self.q_kernel[...], ("embed", "q_heads", "head_dim"), dt)
    wk = sharding.matmul_weight(self.k_kernel[...], ("embed", "kv_heads", "head_dim"), dt)
    wv = sharding.matmul_weight(self.v_kernel[...], ("embed", "kv_heads", "head_dim"), dt)
    q = self._biased(adapted(self, "q", x, jnp.einsum("BTD,DNH->BTNH", x, wq), "BTD,DI->BTI", "BTI,INH->BTNH"), "q")
    k = self._biased(adapted(self, "k", x, jnp.einsum("BTD,DKH->BTKH", x, wk), "BTD,DI->BTI", "BTI,IKH->BTKH"), "k")
    v = self._biased(adapted(self, "v", x, jnp.einsum("BTD,DKH->BTKH", x, wv), "BTD,DI->BTI", "BTI,IKH->BTKH"), "v")
    if self.config.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return (sharding.constrain(rope.apply(q, cos, sin), ("batch", None, "heads", None)), rope.apply(k, cos, sin), v)

  def _biased(self, y, name: str):
    """A projection's output plus its bias, in families with `attention_bias`."""
    if not self.config.attention_bias:
      return y
    return y + getattr(self, f"{name}_bias")[...].astype(self.config.dtype)

  def _o_project(self, out):
    """The attention output out [B, T, N, H] -> [B, T, D] through the o projection (and its adapters)."""
    w = sharding.matmul_weight(self.o_kernel[...], ("q_heads", "head_dim", "embed"), self.config.dtype)
    return adapted(self, "o", out, jnp.einsum("BTNH,NHD->BTD", out, w), "BTNH,NHI->BTI", "BTI,ID->BTD")

  def __call__(self, x, cos, sin, mask, cache: KVCache | paged.PagedStep | None = None, layer=None):
    """x: [B, T, D]; mask: [B, T, S] bool (True = may attend), or packed rows' `attention.Segments` (uncached).
    Returns (y [B, T, D], cache).

    Without a cache, S = T and keys are this call's tokens. With prefill's dense cache (every layer's), this
    call's keys/values are written to rows [0, T) of layer `layer` (see `attention.write_kv`), and attention reads
    that layer's first S cache rows. With a `paged.PagedStep` (a decode step: T = 1, no mask) the step writes and
    reads the layer's pages (`paged.paged_layer`).
    """
    c = self.config
    q, k, v = self.project(x, cos, sin)
    if isinstance(cache, paged.PagedStep):  # one decode step (T = 1) on the paged cache
      out, cache = paged.paged_layer(cache, layer, q[:, 0], k[:, 0], v[:, 0],
                                     kernel=paged.decode_kernel(c, flash.platform(), _tensor_size()))
      out = sharding.constrain(out[:, None], ("batch", None, "heads", None))
      return self._o_project(out), cache
    if cache is None:
      k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]
    else:
      cache = attention.write_kv(cache, layer, k, v)
      k, v = (t.astype(c.dtype) for t in attention.read_kv(cache, layer, mask.shape[-1]))  # [B, K, S, H]
    k = sharding.constrain(k, ("batch", "kv_heads", None, None))
    v = sharding.constrain(v, ("batch", "kv_heads", None, None))

    B, T, N, H = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    impl = flash.resolve(c.attention_impl, dtype=q.dtype) if cache is None else "xla"
    if impl != "xla":
      out = flash.attend(impl, q, k, v, mask)  # a padded mask [B, T, T] or packed rows' `attention.Segments`
    elif isinstance(mask, attention.Segments):
      out = self._attend_xla(q, k, v, mask.dense())
    else:
      out = self._attend_xla(q, k, v, mask)
    out = sharding.constrain(out.reshape(B, T, N, H), ("batch", None, "heads", None))
    return self._o_project(out), cache

  def _attend_xla(self, q, k, v, mask):
    """The XLA path: q [B, T, K, G, H], k, v [B, K, S, H], mask [B, T, S] -> [B, T, K, G, H], in blocks of
    `attention_chunk` queries when T exceeds it."""
    chunk = self.config.attention_chunk
    if chunk and q.shape[1] > chunk:
      return attention.attend_in_chunks(q, k, v, mask, chunk)
    return attention.attend(q, k, v, mask)


def silu(x):
  """x * sigmoid(x) with sigmoid(x) = (1 + tanh(x / 2)) / 2: the same function, and no exp or divide on
  [B, T, F] in the backward pass (the TPU compiler fused them into the down projection's transposed matmul,
  whose estimate they raised by 45%; qwen3b_v5p's step 15.16 -> 15.09 s compiler-optimal)."""
  return x * (0.5 + 0.5 * jnp.tanh(0.5 * x))


class MLP(nnx.Module):
  """The gated MLP: down(activation(gate(x)) * up(x)), the activation config.json's `hidden_act`."""
  # hidden_act -> the gate's nonlinearity: the activations this MLP implements. A family with another one gives
  # its MLP subclass its own table; a config naming one the table lacks is refused (`check_activation`).
  activations: ClassVar[dict[str, Callable]] = {"silu": silu}

  @classmethod
  def check_activation(cls, config: ModelConfig) -> None:
    """ValueError unless this MLP implements `config.hidden_act`."""
    if config.hidden_act not in cls.activations:
      raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for model_type {config.model_type!r} "
                       f"(its MLP implements {', '.join(map(repr, cls.activations))})")

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.check_activation(config)
    D, F, pd = config.hidden_size, config.intermediate_size, config.param_dtype
    self.dtype = config.dtype
    self.hidden_act = config.hidden_act
    self.gate_kernel = param(rngs, (D, F), ("embed", "mlp"), pd)
    self.up_kernel = param(rngs, (D, F), ("embed", "mlp"), pd)
    self.down_kernel = param(rngs, (F, D), ("mlp", "embed"), pd)

  def __call__(self, x):
    """x [B, T, D] -> [B, T, D] (through [B, T, F])."""
    dt = self.dtype
    x = x.astype(dt)
    gate = jnp.einsum("BTD,DF->BTF", x, sharding.matmul_weight(self.gate_kernel[...], ("embed", "mlp"), dt))
    up = jnp.einsum("BTD,DF->BTF", x, sharding.matmul_weight(self.up_kernel[...], ("embed", "mlp"), dt))
    gate = adapted(self, "gate", x, gate, "BTD,DI->BTI", "BTI,IF->BTF")
    up = adapted(self, "up", x, up, "BTD,DI->BTI", "BTI,IF->BTF")
    h = sharding.constrain(self.activations[self.hidden_act](gate) * up, ("batch", None, "mlp"))
    down = jnp.einsum("BTF,FD->BTD", h, sharding.matmul_weight(self.down_kernel[...], ("mlp", "embed"), dt))
    return adapted(self, "down", h, down, "BTF,FI->BTI", "BTI,ID->BTD")


class DecoderLayer(nnx.Module):
  """Pre-norm attention and MLP. A family with another norm, attention or MLP subclasses this and names its
  class below (the registry's `Family.layer`); the state paths and HF names stay those of the parts it keeps."""
  norm_cls = RMSNorm
  attention_cls = Attention
  mlp_cls = MLP

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.input_layernorm = self.norm_cls(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    self.self_attn = self.attention_cls(c, rngs=rngs)
    self.post_attention_layernorm = self.norm_cls(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype,
                                                  rngs=rngs)
    self.mlp = self.mlp_cls(c, rngs=rngs)

  def __call__(self, x, cos, sin, mask, cache=None, layer=None):
    """x [B, T, D] -> (x [B, T, D], cache): pre-norm attention and MLP, each added to the residual."""
    attn_out, cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
    x = x + attn_out.astype(x.dtype)
    x = x + self.mlp(self.post_attention_layernorm(x)).astype(x.dtype)
    return sharding.constrain(x, ("batch", None, None)), cache


# ----------------------------------------------------------------------------------------------
# The layer stack: parameters stacked over a leading "layers" axis, run by a pure lax.scan


def stacked_layers(config: ModelConfig, layer: type[DecoderLayer], rngs: nnx.Rngs) -> DecoderLayer:
  """`num_hidden_layers` decoder layers as one `layer` whose parameters have a leading axis
  (logical name "layers"), each layer initialised from its own split of `rngs` (flax's scan-over-layers
  pattern: nnx.split_rngs + nnx.vmap)."""

  @nnx.split_rngs(splits=config.num_hidden_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None, "logical_axes": "layers"})
  def make(rngs):
    return layer(config, rngs=rngs)

  return make(rngs)


REMAT_POLICIES = ("nothing", "matmuls")


def remat_policy(name: str):
  """The `jax.checkpoint` policy of a rematerialised layer: "nothing" saves nothing (the scan keeps the
  layer's input); "matmuls" saves the outputs of the weight matmuls (q/k/v/o projections, MLP gate/up/down)
  and the splash kernel's inputs and residuals, so the backward pass recomputes only elementwise work (norms,
  SiLU) and the XLA path's attention. (Saving RMSNorm's row scales too made the 3B step slower: 15.29 s
  against 15.16 s compiler-optimal.)"""
  if name in ("nothing", True):
    return jax.checkpoint_policies.nothing_saveable
  if name == "matmuls":
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(flash.SPLASH_RESIDUALS))
  raise ValueError(f"model.remat_policy must be one of {REMAT_POLICIES}, got {name!r}")


def scan_layers(layers: DecoderLayer, x, cos, sin, mask, cache: KVCache | paged.PagedStep | None = None,
                remat: bool | str = False, unroll: bool = False):
  """Runs stacked `layers` over x [B, T, D]: one compiled layer body whatever the depth.

  The scan body is pure: it merges (graphdef, one layer's parameters) inside its own trace, so no NNX
  object crosses a trace boundary (it runs the same under jit, grad, lax.map and while_loop). A cache
  is carried through the scan, each layer writing its rows in place. With `remat` the body saves
  nothing for the backward pass: the scan keeps each layer's input [B, T, D] and recomputes the rest; `remat`
  may name a policy instead (see `remat_policy`).
  With `unroll` the layers run unrolled (a decode step on the TPU kernel's paged cache: `decode_unroll`).
  Returns (x [B, T, D], cache).
  """
  graphdef, params = nnx.split(layers)
  num_layers = jax.tree.leaves(params)[0].shape[0]

  def body(carry, xs):
    x, cache = carry
    layer_params, index = xs
    return nnx.merge(graphdef, layer_params)(x, cos, sin, mask, cache, index), None

  if remat:
    body = jax.checkpoint(body, policy=remat_policy(remat), prevent_cse=False)
  (x, cache), _ = lax.scan(body, (x, cache), (params, jnp.arange(num_layers, dtype=jnp.int32)),
                           unroll=num_layers if unroll else 1)
  return x, cache


def decode_unroll(config, cache) -> bool:
  """Whether the layers run unrolled: a decode step (`paged.PagedStep`) where it attends with the TPU kernel. Each
  layer of the scanned step paid ~30 small instructions of its own (its norm weights' and index's dynamic slices,
  the kernel's metadata), weight-bound one-token steps their fixed cost: unrolled, qwen3b_v5p's 16-step decode
  call is costed 26.7 ms instead of 30.0 (docs/tpu.md). Elsewhere (CPU, GPU, prefill, training) the layer scan.
  `config`: the model's `ModelConfig`."""
  return isinstance(cache, paged.PagedStep) and paged.decode_kernel(config, flash.platform(), _tensor_size())


