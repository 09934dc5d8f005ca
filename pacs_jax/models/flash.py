"""Flash attention kernels for the uncached (training / log-prob) passes: TPU splash attention (Pallas) and
GPU cuDNN, with the same inputs and results as `attention.attend` on real-token rows.

Shapes as `attention`: q [B, T, K, G, H]; k, v [B, K, T, H]; N = K * G query heads, query head n = k * G + g
uses kv head k (transformers' grouping).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from pacs_jax import sharding
from pacs_jax.models import attention

IMPLS = ("auto", "xla", "splash", "cudnn")
# `jax.checkpoint` name of the splash forward's inputs and residuals (output, log-sum-exp): a remat policy
# that saves it keeps the backward pass from re-running the forward kernel or what prepares its inputs.
SPLASH_RESIDUALS = "splash_residuals"
SPLASH_KERNELS = ("splash_mha_", "splash_mqa_")  # names of the kernels' scopes (and compiled instructions)
_LANES = 128  # splash blocks are multiples of the TPU lane width


def platform() -> str:
  """The platform the current trace targets: the mesh's devices under `jax.set_mesh` (also an ahead-of-time
  TPU topology on a CPU host), else jax's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def resolve(impl: str, target: str | None = None, dtype=None) -> str:
  """"auto" -> the platform's kernel (tpu: splash; gpu: cudnn, which takes 16-bit inputs only, so fp32
  stays on xla; else xla); others as given."""
  if impl not in IMPLS:
    raise ValueError(f"model.attention_impl must be one of {IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  kernel = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(target or platform(), "xla")
  if kernel == "cudnn" and dtype is not None and jnp.dtype(dtype) == jnp.float32:
    return "xla"
  return kernel


def segment_ids(mask) -> jax.Array:
  """Segment ids [B, T] of an uncached pass's mask: packed rows' own ids (`attention.Segments`), or those of a
  padded mask [B, T, T] = causal & key is real (1 = real token, 0 = padding): token t is real iff it may attend
  to itself. Padding is its own segment, so a real query never sees a padded key; a padded query sees the
  padded keys before it (never an empty row)."""
  if isinstance(mask, attention.Segments):
    return mask.ids
  return jnp.diagonal(mask, axis1=1, axis2=2).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# TPU splash attention


def block_size(T: int) -> int:
  """Query / key block of the splash kernels for T rows: 512 when it divides T rounded to the lane width
  (4,608 = 9 x 512), else the lane width."""
  padded = -(-T // _LANES) * _LANES
  return 512 if padded % 512 == 0 else _LANES


def _block_sizes(block: int) -> splash.BlockSizes:
  # Separate dq and dkv backward kernels (MaxText's default), not the fused one: the fused kernel writes dq
  # as one bf16 partial per key block ([b, T / block, n, T, H]: 9 at 4,608 rows) and XLA sums them after
  # the kernel, a reduction that cost 10% of the 3B train step's backward layer (by the compiler's cycles)
  # and rounds each partial to bf16. The dq kernel re-does q.k and dO.v instead (2 of 9 kernel matmuls).
  return splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                           block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
                           use_fused_bwd_kernel=False)


def _splash_shard(q, k, v, seg, *, interpret: bool):
  """One shard: q [b, n, T, H] (pre-scaled), k, v [b, k, T, H], seg [b, T] -> [b, n, T, H]."""
  n, T = q.shape[1], q.shape[2]
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((T, T))] * n)
  kernel = splash.make_splash_mha(mask, block_sizes=_block_sizes(block_size(T)), head_shards=1, q_seq_shards=1,
                                  residual_checkpoint_name=SPLASH_RESIDUALS, interpret=interpret)
  return jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s)))(q, k, v, seg)


def splash_attend(q, k, v, mask, *, interpret: bool | None = None):
  """Causal attention with left (or any) padding by the splash kernels: fully masked key blocks are
  skipped, the backward pass is a dq and a dkv kernel. q: [B, T, K, G, H]; k, v: [B, K, T, H]; mask [B, T, T]
  as `decoder.Backbone` builds it (causal & key is real). Returns [B, T, K, G, H]; rows of padded queries differ
  from `attention.attend` (they attend to the padding before them, not uniformly to every key).

  Under a mesh it runs per shard (`jax.shard_map`: batch over the batch axes, heads over tensor); off TPU
  the kernels run in Pallas interpret mode (tests).
  """
  B, T, K, G, H = q.shape
  if interpret is None:
    interpret = platform() != "tpu"
  precision = jax.config.jax_default_matmul_precision
  if not interpret and q.dtype != jnp.float32 and precision not in (None, "default", "bfloat16", "fastest"):
    # Mosaic compiles bf16 matmuls only at the default precision ("Bad lhs type").
    raise ValueError(f"splash attention on {q.dtype} inputs compiles only at the default matmul precision, not "
                     f"jax_default_matmul_precision={precision!r}: unset it or use model.attention_impl='xla'")
  seg = segment_ids(mask)
  Tp = -(-T // block_size(T)) * block_size(T)
  # Queries scaled before the kernel (it computes q . k); rows past T are padding no real query can see.
  qh = jnp.moveaxis((q * (1.0 / math.sqrt(H))).astype(q.dtype).reshape(B, T, K * G, H), 1, 2)  # [B, N, T, H]
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T), (0, 0)))
  # The kernels' inputs are saved residuals too (same name): the backward kernels read them, so with them
  # saved the backward pass re-does none of RoPE, scaling, re-layout and padding.
  qh, kp, vp = (checkpoint_name(x, SPLASH_RESIDUALS) for x in (pad(qh), pad(k.astype(q.dtype)), pad(v.astype(q.dtype))))
  seg = jnp.pad(seg, ((0, 0), (0, Tp - T)))
  run = functools.partial(_splash_shard, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and math.prod(mesh.shape.values()) > 1:
    shape = dict(mesh.shape)
    spec_q = sharding.spec_for(("batch", "heads", None, None), sharding.ACTIVATION_RULES, shape, qh.shape)
    spec_kv = sharding.spec_for(("batch", "kv_heads", None, None), sharding.ACTIVATION_RULES, shape, kp.shape)
    if spec_q[1] != spec_kv[1]:  # kv heads not split like the query heads: one kv head per query head
      kp, vp = jnp.repeat(kp, G, axis=1), jnp.repeat(vp, G, axis=1)
      spec_kv = spec_q
    run = jax.shard_map(run, mesh=mesh, in_specs=(spec_q, spec_kv, spec_kv, P(spec_q[0], None)),
                        out_specs=spec_q, check_vma=False)
  out = run(qh, kp, vp, seg)[:, :, :T]  # [B, N, T, H]
  return jnp.moveaxis(out, 1, 2).reshape(B, T, K, G, H)


def splash_kernel_flops(kernel: str, q_shape, fused_dq: bool = False) -> float:
  """Matmul flops of one splash kernel call from its name and query operand shape [..., n, T, H]: causal
  blocks only (the kernels skip blocks above the diagonal), 2 matmuls per block in the forward (q.k, p.v),
  3 in the dq kernel (q.k again, dO.v, dS.k), 4 in the dkv kernel (q.k, dO.v, p.dO, dS.q), 5 in the fused
  backward kernel (`fused_dq`: the dkv kernel that also returns dq)."""
  *lead, n, T, H = q_shape
  block = block_size(T)
  nb = T // block
  blocks = nb * (nb + 1) // 2  # on or below the diagonal
  per_block = 2.0 * block * block * H
  matmuls = 2 if "_fwd" in kernel else 3 if "_dq" in kernel else 5 if fused_dq else 4
  return matmuls * per_block * blocks * n * math.prod(lead)


# ----------------------------------------------------------------------------------------------
# GPU cuDNN


def cudnn_attend(q, k, v, mask):
  """Causal attention with key padding by cuDNN flash attention (`jax.nn.dot_product_attention`); same
  arguments and results as `splash_attend`."""
  B, T, K, G, H = q.shape
  seg = segment_ids(mask)
  # cuDNN's padding masks are right-padding lengths; left padding is a boolean mask beside the causal one.
  allowed = (seg[:, None, :, None] == seg[:, None, None, :])  # [B, 1, T, T]
  out = jax.nn.dot_product_attention(q.reshape(B, T, K * G, H), jnp.swapaxes(k, 1, 2).astype(q.dtype),
                                     jnp.swapaxes(v, 1, 2).astype(q.dtype), mask=allowed, is_causal=True,
                                     implementation="cudnn")
  return out.reshape(B, T, K, G, H)


def attend(impl: str, q, k, v, mask):
  """Dispatch for the uncached passes: "splash" / "cudnn" kernels (impl already resolved)."""
  if impl == "splash":
    return splash_attend(q, k, v, mask)
  if impl == "cudnn":
    return cudnn_attend(q, k, v, mask)
  raise ValueError(f"no flash attention kernel {impl!r}")
