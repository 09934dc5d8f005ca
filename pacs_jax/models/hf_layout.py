"""Where each Qwen2 parameter lives in a Hugging Face checkpoint: tensor names and layouts, both ways."""

from __future__ import annotations

import dataclasses

import numpy as np

from pacs_jax.models.qwen2 import Qwen2Config

# Each entry: our state path (and layer, for the stacked decoder layers) ->
# (HF tensor name, layout). Layouts say how our array (one layer's slice) is laid out relative to HF's
# [out, in] weights:
#   "same"      ours == HF
#   "t"         ours [in, out] == HF[out, in].T
#   "heads_in"  ours [D, N, H] == HF[N*H, D].T reshaped (q/k/v kernels)
#   "heads"     ours [N, H] == HF[N*H] reshaped (q/k/v biases)
#   "heads_out" ours [N, H, D] == HF[D, N*H].T reshaped (o kernel)


@dataclasses.dataclass(frozen=True)
class TensorMap:
  path: tuple  # path in nnx.state(model)
  hf_name: str
  layout: str
  layer: int | None = None  # decoder layers are stacked: the HF tensor is slice `layer` of our array


def tensor_maps(config: Qwen2Config) -> list[TensorMap]:
  maps = [TensorMap(("model", "embed_tokens"), "model.embed_tokens.weight", "same"),
          TensorMap(("model", "norm", "weight"), "model.norm.weight", "same")]
  ours = ("model", "layers")
  for i in range(config.num_hidden_layers):
    hf = f"model.layers.{i}."
    maps += [
        TensorMap(ours + ("input_layernorm", "weight"), hf + "input_layernorm.weight", "same", i),
        TensorMap(ours + ("post_attention_layernorm", "weight"), hf + "post_attention_layernorm.weight", "same", i),
        TensorMap(ours + ("self_attn", "o_kernel"), hf + "self_attn.o_proj.weight", "heads_out", i),
        TensorMap(ours + ("mlp", "gate_kernel"), hf + "mlp.gate_proj.weight", "t", i),
        TensorMap(ours + ("mlp", "up_kernel"), hf + "mlp.up_proj.weight", "t", i),
        TensorMap(ours + ("mlp", "down_kernel"), hf + "mlp.down_proj.weight", "t", i),
    ]
    for p in "qkv":
      maps += [TensorMap(ours + ("self_attn", f"{p}_kernel"), hf + f"self_attn.{p}_proj.weight", "heads_in", i),
               TensorMap(ours + ("self_attn", f"{p}_bias"), hf + f"self_attn.{p}_proj.bias", "heads", i)]
  if not config.tie_word_embeddings:
    maps.append(TensorMap(("lm_head",), "lm_head.weight", "t"))
  return maps


def hf_shape(layout: str, shape: tuple) -> tuple:
  """The HF tensor shape that holds our array of `shape` under `layout`."""
  if layout == "same":
    return shape
  if layout == "t":
    return shape[::-1]
  if layout == "heads_in":
    return (shape[1] * shape[2], shape[0])
  if layout == "heads":
    return (shape[0] * shape[1],)
  if layout == "heads_out":
    return (shape[2], shape[0] * shape[1])
  raise ValueError(layout)


def to_hf(layout: str, x: np.ndarray) -> np.ndarray:
  """Our array (one layer's slice) -> the HF tensor (see the layouts above)."""
  if layout == "same":
    return x
  if layout == "t":
    return x.T  # [in, out] -> [out, in]
  if layout == "heads_in":
    return x.reshape(x.shape[0], -1).T  # [D, N, H] -> [N*H, D]
  if layout == "heads":
    return x.reshape(-1)  # [N, H] -> [N*H]
  if layout == "heads_out":
    return x.reshape(-1, x.shape[2]).T  # [N, H, D] -> [D, N*H]
  raise ValueError(layout)


def slice_bounds(s: slice, dim: int) -> tuple[int, int]:
  start, stop, step = s.indices(dim)
  if step != 1:
    raise ValueError("strided shard slices are not supported")
  return start, stop


def read_slice(tensor_slice, layout: str, shape: tuple, index: tuple) -> np.ndarray:
  """Reads our array's `index` (tuple of slices over `shape`) from an HF tensor, loading only that part.

  The head_dim axis is never sharded, so whole heads are read and sliced afterwards when needed.
  """
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  b = [slice_bounds(s, d) for s, d in zip(index, shape)]
  if layout == "same":
    return tensor_slice[tuple(slice(lo, hi) for lo, hi in b)]
  if layout == "t":
    (r0, r1), (c0, c1) = b
    return tensor_slice[c0:c1, r0:r1].T
  if layout == "heads_in":  # ours [D, N, H]
    (d0, d1), (n0, n1), (h0, h1) = b
    H = shape[2]
    x = tensor_slice[n0 * H:n1 * H, d0:d1].T  # [d, n*H]
    return x.reshape(d1 - d0, n1 - n0, H)[:, :, h0:h1]
  if layout == "heads":  # ours [N, H]
    (n0, n1), (h0, h1) = b
    H = shape[1]
    return tensor_slice[n0 * H:n1 * H].reshape(n1 - n0, H)[:, h0:h1]
  if layout == "heads_out":  # ours [N, H, D]
    (n0, n1), (h0, h1), (d0, d1) = b
    H = shape[1]
    x = tensor_slice[d0:d1, n0 * H:n1 * H].T  # [n*H, d]
    return x.reshape(n1 - n0, H, d1 - d0)[:, h0:h1, :]
  raise ValueError(layout)
