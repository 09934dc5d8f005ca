"""Where each parameter lives in a Hugging Face checkpoint: tensor names (a family's table) and layouts, both ways."""

from __future__ import annotations

import dataclasses

import numpy as np

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


# The checkpoint names of Llama and the families that copied it (Qwen2, Qwen3): our state path -> (HF name,
# layout). "{i}" in a name marks a stacked decoder-layer parameter (the HF tensor of layer i). A model maps
# only the parameters it has (q/k/v biases with `attention_bias`, q/k norms with `qk_norm`, lm_head untied).
_LLAMA_LAYER = {  # one decoder layer: our path under ("model", "layers") -> (name under "model.layers.{i}.", layout)
    ("input_layernorm", "weight"): ("input_layernorm.weight", "same"),
    ("post_attention_layernorm", "weight"): ("post_attention_layernorm.weight", "same"),
    ("self_attn", "o_kernel"): ("self_attn.o_proj.weight", "heads_out"),
    ("mlp", "gate_kernel"): ("mlp.gate_proj.weight", "t"),
    ("mlp", "up_kernel"): ("mlp.up_proj.weight", "t"),
    ("mlp", "down_kernel"): ("mlp.down_proj.weight", "t"),
    **{("self_attn", f"{p}_{ours}"): (f"self_attn.{p}_proj.{hf}", layout)  # q_kernel: self_attn.q_proj.weight, ...
       for p in "qkv" for ours, hf, layout in (("kernel", "weight", "heads_in"), ("bias", "bias", "heads"))},
    ("self_attn", "q_norm", "weight"): ("self_attn.q_norm.weight", "same"),
    ("self_attn", "k_norm", "weight"): ("self_attn.k_norm.weight", "same"),
}
LLAMA_NAMES: dict[tuple, tuple[str, str]] = {
    ("model", "embed_tokens"): ("model.embed_tokens.weight", "same"),
    ("model", "norm", "weight"): ("model.norm.weight", "same"),
    **{("model", "layers") + ours: (f"model.layers.{{i}}.{hf}", layout) for ours, (hf, layout) in _LLAMA_LAYER.items()},
    ("lm_head",): ("lm_head.weight", "t"),
}


def tensor_maps(names: dict[tuple, tuple[str, str]], paths, num_layers: int) -> list[TensorMap]:
  """The TensorMaps of a model whose parameters sit at `paths` (its flat state's keys), in the order of
  `names` (layer by layer for the stacked ones). ValueError names a parameter `names` has no tensor for."""
  paths = set(paths)
  unmapped = sorted(paths - set(names))
  if unmapped:
    raise ValueError(f"no checkpoint tensor name for parameters {unmapped}")
  maps, layered = [], [(path, hf, layout) for path, (hf, layout) in names.items() if "{i}" in hf and path in paths]
  for path, (hf, layout) in names.items():
    if path in paths and "{i}" not in hf:
      maps.append(TensorMap(path, hf, layout))
    elif layered and path == layered[0][0]:  # the stacked layers, at the place of their first entry
      maps += [TensorMap(p, name.format(i=i), lay, i) for i in range(num_layers) for p, name, lay in layered]
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
