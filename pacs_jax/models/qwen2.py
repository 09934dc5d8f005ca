"""Flax NNX Qwen2 / Qwen2.5 decoder, numerically the same model as transformers' `Qwen2ForCausalLM`.

Decoder layers are stacked over a leading "layers" axis and run by one `lax.scan`. Every parameter
carries its logical axis names (`logical_axes` metadata); `pacs_jax.sharding` maps them to mesh axes per
mode (train / sample). Shapes: B batch, T query length, S key length (cache rows), D hidden, N query
heads, K kv heads, G = N // K, H head dim, F mlp width, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from pacs_jax import sharding
from pacs_jax.models import attention, flash, paged, paged_kernel

@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None  # None: hidden_size // num_attention_heads
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  # Numerics / memory; not part of the HF config.
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32  # compute dtype of matmuls (bf16 on accelerators)
  remat: bool = False  # rematerialise each decoder layer in the backward pass (keep only its input)
  # >0: attend `attention_chunk` queries at a time, each block rematerialised in the backward pass, so the
  # fp32 scores peak at [B, K, G, chunk, S] instead of [B, K, G, T, S] (long responses). 0 = all at once.
  attention_chunk: int = 0
  # Uncached (training / log-prob) attention: "xla" (`attention.attend`, the reference), "splash" (TPU Pallas
  # kernels), "cudnn" (GPU flash attention) or "auto" (by the platform the program is traced for).
  attention_impl: str = "auto"
  # What a rematerialised layer saves for the backward pass (`remat=True`): "nothing" (its input only) or
  # "matmuls" (projection and MLP matmul outputs and the splash kernel's residuals: no matmul re-run).
  remat_policy: str = "nothing"

  def __post_init__(self):
    if self.head_dim is None:  # transformers' default; stored so configs compare equal after a round trip
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

  @property
  def head_size(self) -> int:
    return self.head_dim

  def replace(self, **kw) -> "Qwen2Config":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf_dict(cls, cfg: dict, **overrides) -> "Qwen2Config":
    """Builds a config from a transformers `config.json` dict (transformers 4 and 5 layouts)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
      raise ValueError(f"rope_type {rope_type!r} is not supported (only the default RoPE of Qwen2.5)")
    return cls(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim"),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        **overrides,
    )

  def to_hf_dict(self) -> dict:
    """The transformers `Qwen2Config` fields (written to `config.json` on export)."""
    return dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_hidden_layers,
        num_attention_heads=self.num_attention_heads,
        num_key_value_heads=self.num_key_value_heads,
        head_dim=self.head_size,
        hidden_act="silu",
        rms_norm_eps=self.rms_norm_eps,
        rope_theta=self.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        tie_word_embeddings=self.tie_word_embeddings,
        max_position_embeddings=self.max_position_embeddings,
        attention_dropout=0.0,
        use_sliding_window=False,
        torch_dtype="float32" if jnp.dtype(self.param_dtype) == jnp.float32 else "bfloat16",
    )


_QWEN25_COMMON = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32768)

PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                **_QWEN25_COMMON),
    "qwen2.5-1.5b": Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                                **_QWEN25_COMMON),
    "qwen2.5-3b": Qwen2Config(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                              num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                              **_QWEN25_COMMON),
    "qwen2.5-7b": Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                              **{**_QWEN25_COMMON, "vocab_size": 152064}),
    # Tiny config for tests and the CPU demo: GQA with 2 query heads per kv head.
    "tiny": Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0,
                        tie_word_embeddings=True, max_position_embeddings=2048),
}


def get_preset(name: str, **overrides) -> Qwen2Config:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides)


# ----------------------------------------------------------------------------------------------
# KV cache


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer, stacked, in the layout decode reads: [layers, B, K, S, H].

  Heads come before rows, so each (row, head) holds a contiguous [S, H] block: the minor dims tile well
  on TPU whatever the number of kv heads per chip. A decode call writes only its new rows, in place (the
  cache is carried through the layer scan and the decode loop, never re-laid out or copied).
  """
  k: jax.Array  # [layers, B, K, S, H]
  v: jax.Array  # [layers, B, K, S, H]

  @property
  def rows(self) -> int:
    return self.k.shape[3]


# Logical axes of `KVCache.k` / `.v` (see `pacs_jax.sharding`): rows over (data, fsdp), kv heads over tensor.
CACHE_AXES = ("layers", "batch", "kv_heads", None, None)


def init_cache(config: Qwen2Config, batch: int, length: int, dtype=None) -> KVCache:
  """An all-zero cache of `length` rows for each of `batch` sequences, every layer."""
  shape = (config.num_hidden_layers, batch, config.num_key_value_heads, length, config.head_size)
  dtype = dtype or config.dtype
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


# ----------------------------------------------------------------------------------------------
# Building blocks


def _param(rngs: nnx.Rngs, shape, axes, dtype, init=nnx.initializers.normal(0.02)) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

  def __call__(self, x):
    # As transformers: normalise in fp32, cast back, then scale.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


def _tensor_size() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)


def paged_decode_kernel(config: Qwen2Config, platform: str, tensor: int = 1) -> bool:
  """Whether paged decode attends with the TPU Pallas kernel (`paged_kernel`): on TPU where training uses
  splash, unless the kernel cannot take the shapes (then the XLA path, or an error if splash was asked
  for). Elsewhere (splash in interpret mode on CPU) decode takes the XLA path."""
  if flash.resolve(config.attention_impl, platform) != "splash" or platform != "tpu":
    return False
  K = config.num_key_value_heads
  local = K // tensor if K % tensor == 0 else K
  why = paged_kernel.kernel_unsupported(config.head_size, 2 * local, config.dtype)
  if why and config.attention_impl == "splash":
    raise ValueError(f"model.attention_impl='splash': the TPU paged decode kernel cannot run this model: {why}")
  return why is None


class Attention(nnx.Module):
  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
    c = config
    D, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size
    pd = c.param_dtype
    self.config = c
    self.q_kernel = _param(rngs, (D, N, H), ("embed", "q_heads", "head_dim"), pd)
    self.k_kernel = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
    self.v_kernel = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
    self.q_bias = _param(rngs, (N, H), ("q_heads", "head_dim"), pd, nnx.initializers.zeros)
    self.k_bias = _param(rngs, (K, H), ("kv_heads", "head_dim"), pd, nnx.initializers.zeros)
    self.v_bias = _param(rngs, (K, H), ("kv_heads", "head_dim"), pd, nnx.initializers.zeros)
    self.o_kernel = _param(rngs, (N, H, D), ("q_heads", "head_dim", "embed"), pd)

  def project(self, x, cos, sin):
    """x [B, T, D] -> q [B, T, N, H], k, v [B, T, K, H] (RoPE applied to q and k)."""
    dt = self.config.dtype
    x = x.astype(dt)
    wq = sharding.matmul_weight(self.q_kernel[...], ("embed", "q_heads", "head_dim"), dt)
    wk = sharding.matmul_weight(self.k_kernel[...], ("embed", "kv_heads", "head_dim"), dt)
    wv = sharding.matmul_weight(self.v_kernel[...], ("embed", "kv_heads", "head_dim"), dt)
    q = jnp.einsum("BTD,DNH->BTNH", x, wq) + self.q_bias[...].astype(dt)
    k = jnp.einsum("BTD,DKH->BTKH", x, wk) + self.k_bias[...].astype(dt)
    v = jnp.einsum("BTD,DKH->BTKH", x, wv) + self.v_bias[...].astype(dt)
    return (sharding.constrain(attention.apply_rope(q, cos, sin), ("batch", None, "heads", None)),
            attention.apply_rope(k, cos, sin), v)

  def _o_weight(self):
    return sharding.matmul_weight(self.o_kernel[...], ("q_heads", "head_dim", "embed"), self.config.dtype)

  def __call__(self, x, cos, sin, mask, cache: KVCache | None = None, layer=None, write_index=None):
    """x: [B, T, D]; mask: [B, T, S] bool (True = may attend). Returns (y [B, T, D], cache).

    Without a cache, S = T and keys are this call's tokens. With a cache (every layer's), this call's
    keys/values are written to layer `layer` (see `attention.write_kv`), and attention reads that layer's first S
    cache rows (S = the decode window). With a `paged.PagedStep` (T = 1, no mask) the step writes and reads
    the layer's pages (`paged.paged_layer`).
    """
    c = self.config
    q, k, v = self.project(x, cos, sin)
    if isinstance(cache, paged.PagedStep):  # one decode step (T = 1) on the paged cache
      out, cache = paged.paged_layer(cache, layer, q[:, 0], k[:, 0], v[:, 0],
                                     kernel=paged_decode_kernel(c, flash.platform(), _tensor_size()))
      out = sharding.constrain(out[:, None], ("batch", None, "heads", None))
      return jnp.einsum("BTNH,NHD->BTD", out, self._o_weight()), cache
    if cache is None:
      k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]
    else:
      cache = attention.write_kv(cache, layer, k, v, write_index)
      k, v = (t.astype(c.dtype) for t in attention.read_kv(cache, layer, mask.shape[-1]))  # [B, K, S, H]
    k = sharding.constrain(k, ("batch", "kv_heads", None, None))
    v = sharding.constrain(v, ("batch", "kv_heads", None, None))

    B, T, N, H = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    impl = flash.resolve(c.attention_impl, dtype=q.dtype) if cache is None else "xla"
    if impl != "xla":
      out = flash.attend(impl, q, k, v, mask)
    elif c.attention_chunk and T > c.attention_chunk:
      out = attention.attend_in_chunks(q, k, v, mask, c.attention_chunk)
    else:
      out = attention.attend(q, k, v, mask)
    out = sharding.constrain(out.reshape(B, T, N, H), ("batch", None, "heads", None))
    y = jnp.einsum("BTNH,NHD->BTD", out, self._o_weight())
    return y, cache


def silu(x):
  """x * sigmoid(x) with sigmoid(x) = (1 + tanh(x / 2)) / 2: the same function, and no exp or divide on
  [B, T, F] in the backward pass (the TPU compiler fused them into the down projection's transposed matmul,
  whose estimate they raised by 45%; qwen3b_v5p's step 15.16 -> 15.09 s compiler-optimal)."""
  return x * (0.5 + 0.5 * jnp.tanh(0.5 * x))


class MLP(nnx.Module):
  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
    D, F, pd = config.hidden_size, config.intermediate_size, config.param_dtype
    self.dtype = config.dtype
    self.gate_kernel = _param(rngs, (D, F), ("embed", "mlp"), pd)
    self.up_kernel = _param(rngs, (D, F), ("embed", "mlp"), pd)
    self.down_kernel = _param(rngs, (F, D), ("mlp", "embed"), pd)

  def __call__(self, x):
    """x [B, T, D] -> [B, T, D] (SwiGLU through [B, T, F])."""
    dt = self.dtype
    x = x.astype(dt)
    gate = jnp.einsum("BTD,DF->BTF", x, sharding.matmul_weight(self.gate_kernel[...], ("embed", "mlp"), dt))
    up = jnp.einsum("BTD,DF->BTF", x, sharding.matmul_weight(self.up_kernel[...], ("embed", "mlp"), dt))
    h = sharding.constrain(silu(gate) * up, ("batch", None, "mlp"))

    return jnp.einsum("BTF,FD->BTD", h, sharding.matmul_weight(self.down_kernel[...], ("mlp", "embed"), dt))


class DecoderLayer(nnx.Module):
  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
    c = config
    self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    self.self_attn = Attention(c, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    self.mlp = MLP(c, rngs=rngs)

  def __call__(self, x, cos, sin, mask, cache=None, layer=None, write_index=None):
    """x [B, T, D] -> (x [B, T, D], cache): pre-norm attention and MLP, each added to the residual."""
    attn_out, cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, write_index)
    x = x + attn_out.astype(x.dtype)
    x = x + self.mlp(self.post_attention_layernorm(x)).astype(x.dtype)
    return sharding.constrain(x, ("batch", None, None)), cache


# ----------------------------------------------------------------------------------------------
# The layer stack: parameters stacked over a leading "layers" axis, run by a pure lax.scan


def stacked_layers(config: Qwen2Config, rngs: nnx.Rngs) -> DecoderLayer:
  """`num_hidden_layers` decoder layers as one `DecoderLayer` whose parameters have a leading axis
  (logical name "layers"), each layer initialised from its own split of `rngs` (flax's scan-over-layers
  pattern: nnx.split_rngs + nnx.vmap)."""

  @nnx.split_rngs(splits=config.num_hidden_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None, "logical_axes": "layers"})
  def make(rngs):
    return DecoderLayer(config, rngs=rngs)

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


def scan_layers(layers: DecoderLayer, x, cos, sin, mask, cache: KVCache | None = None, write_index=None,
                remat: bool | str = False):
  """Runs stacked `layers` over x [B, T, D]: one compiled layer body whatever the depth.

  The scan body is pure: it merges (graphdef, one layer's parameters) inside its own trace, so no NNX
  object crosses a trace boundary (it runs the same under jit, grad, lax.map and while_loop). A cache
  is carried through the scan, each layer writing its rows in place. With `remat` the body saves
  nothing for the backward pass: the scan keeps each layer's input [B, T, D] and recomputes the rest; `remat`
  may name a policy instead (see `remat_policy`).
  Returns (x [B, T, D], cache).
  """
  graphdef, params = nnx.split(layers)
  num_layers = jax.tree.leaves(params)[0].shape[0]

  def body(carry, xs):
    x, cache = carry
    layer_params, index = xs
    return nnx.merge(graphdef, layer_params)(x, cos, sin, mask, cache, index, write_index), None

  if remat:
    body = jax.checkpoint(body, policy=remat_policy(remat), prevent_cse=False)
  (x, cache), _ = lax.scan(body, (x, cache), (params, jnp.arange(num_layers, dtype=jnp.int32)))
  return x, cache


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Position ids [B, T] for left-padded rows: 0 at the first real token (pads get 0 too)."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


class Qwen2Model(nnx.Module):
  """The decoder backbone: token embeddings -> layers -> final norm. Returns hidden states [B, T, D]."""

  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed_tokens = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), c.param_dtype)
    self.layers = stacked_layers(c, rngs)
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, rngs=rngs)

  def __call__(self, input_ids, attention_mask=None):
    """input_ids, attention_mask: [B, T] (1 = real token, 0 = padding; left padding expected)."""
    B, T = input_ids.shape
    if attention_mask is None:
      attention_mask = jnp.ones((B, T), jnp.int32)
    positions = positions_from_mask(attention_mask)
    causal = jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]  # [1, T, S]
    mask = causal & (attention_mask[:, None, :] > 0)  # [B, T, S]
    hidden, _ = self._layers(input_ids, positions, mask, None, None)
    return hidden

  def forward_with_cache(self, input_ids, positions, cache: KVCache, write_index=None, window: int | None = None):
    """Cached forward. input_ids, positions: [B, T]; the cache holds rows [0, S) of each sequence.

    Sequence b's new keys go to cache rows write_index[b] + [0, T) (None: rows [0, T)); each query
    attends to every cache row whose index is <= its position (rows are filled contiguously from 0,
    without padding). Attention reads only the first `window` rows (default: all); every position must
    be below it. A `paged.PagedStep` cache (one decode step, T = 1) carries its own positions and lengths.
    Returns (hidden [B, T, D], new cache).
    """
    if isinstance(cache, paged.PagedStep):
      return self._layers(input_ids, positions, None, cache, None)
    W = cache.rows if window is None else window
    mask = jnp.arange(W)[None, None, :] <= positions[:, :, None]  # [B, T, W]
    return self._layers(input_ids, positions, mask, cache, write_index)

  def _layers(self, input_ids, positions, mask, cache, write_index):
    c = self.config
    x = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(c.dtype)  # [B, T, D]
    x = sharding.constrain(x, ("batch", None, None))
    cos, sin = attention.rope_cos_sin(positions, c.head_size, c.rope_theta)
    x, cache = scan_layers(self.layers, x, cos, sin, mask, cache, write_index, remat=c.remat and c.remat_policy)
    return self.norm(x), cache


class Qwen2ForCausalLM(nnx.Module):
  def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
    self.config = config
    self.model = Qwen2Model(config, rngs=rngs)
    if not config.tie_word_embeddings:
      self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"),
                            config.param_dtype)

  def logits(self, hidden):
    """hidden [B, T, D] -> logits [B, T, V] in the compute dtype."""
    dt = self.config.dtype
    if self.config.tie_word_embeddings:
      w = sharding.matmul_weight(self.model.embed_tokens[...], ("vocab", "embed"), dt)
      out = jnp.einsum("BTD,VD->BTV", hidden.astype(dt), w)
    else:
      out = jnp.einsum("BTD,DV->BTV", hidden.astype(dt), sharding.matmul_weight(self.lm_head[...], ("embed", "vocab"), dt))
    return sharding.constrain(out, ("batch", None, "vocab"))

  def __call__(self, input_ids, attention_mask=None):
    """Logits [B, T, V]. Left-padded rows give the same logits on real tokens as unpadded ones."""
    return self.logits(self.model(input_ids, attention_mask))

  def forward_with_cache(self, input_ids, positions, cache: KVCache, write_index=None, window: int | None = None):
    """Cached forward (see `Qwen2Model.forward_with_cache`); returns (logits [B, T, V], new cache)."""
    hidden, cache = self.model.forward_with_cache(input_ids, positions, cache, write_index, window)
    return self.logits(hidden), cache


def count_params(model: nnx.Module) -> int:
  """Number of parameters; works on abstract (`nnx.eval_shape`) models too."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
