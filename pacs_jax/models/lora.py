"""LoRA: low-rank adapters A, B beside the decoder layers' projection kernels (y = x W + scale · (x A) B), trained
copies of chosen norms and embeddings (peft's `modules_to_save`), the split of a model into these and the base weights,
the merge W + scale · A B for sampling, and PEFT's adapter format both ways. docs/lora.md has the design.

Shapes: D hidden, N query heads, H head dim, F mlp width, I LoRA rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import load_file

from pacs_jax import sharding
from pacs_jax.models import lora_saved
from pacs_jax.models import families
from pacs_jax.models.lora_saved import (PEFT_PREFIX, SAVEABLE, SAVED_PREFIX, PLAIN_LORA, adapter_config,  # noqa: F401
                                        base_path, saved_params, with_saved_from)
from pacs_jax.models.model_config import ModelConfig

# The projections an adapter may sit beside: target -> (its kernel's attribute, how many of the kernel's axes after
# the stacked layers' axis are inputs). The o kernel [N, H, D] has two ([N, H]); every other one has one.
TARGETS: dict[str, tuple[str, int]] = {
    "q": ("q_kernel", 1), "k": ("k_kernel", 1), "v": ("v_kernel", 1), "o": ("o_kernel", 2),
    "gate": ("gate_kernel", 1), "up": ("up_kernel", 1), "down": ("down_kernel", 1),
}
RANK_AXIS = "lora_rank"  # the adapters' rank axis, never sharded (pacs_jax.sharding)
_SUBMODULE = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
              "gate": "mlp", "up": "mlp", "down": "mlp"}  # the decoder layer's submodule that holds each kernel
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LR_RATIO = 10.0  # LoRA's best learning rate over full fine-tuning's (Thinking Machines, "LoRA Without Regret", 2025)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """What LoRA adapts and how much: `rank` I, `alpha`, `targets` (projection names q, k, v, o, gate, up, down or
  their Hugging Face names q_proj...; any other entry is a regex fullmatched against each layer's Hugging Face
  module names, e.g. `model.layers.3.self_attn.q_proj`, as peft's `target_modules`), and `use_rslora`: the update's
  scale is alpha / rank, or alpha / sqrt(rank) with rsLoRA. `modules_to_save`: norms and embeddings trained in full
  beside the adapters, as peft's `modules_to_save` (an entry names every module whose Hugging Face name ends with
  it: "norm" every norm, "model.norm" the final one, "embed_tokens"; see `saved_params`). Check it against a model
  with `validate`."""
  rank: int
  alpha: float
  targets: tuple[str, ...] = tuple(TARGETS)
  use_rslora: bool = False
  modules_to_save: tuple[str, ...] = ()

  def __post_init__(self):
    for field in ("targets", "modules_to_save"):
      value = getattr(self, field)
      object.__setattr__(self, field, (value,) if isinstance(value, str) else tuple(value))

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

  def lr_multiplier(self, hidden_size: int) -> float:
    """LoRA's learning rate over full fine-tuning's (`lora.lr_multiplier` 0): LoRA Without Regret's 10 (measured at
    widths 2048 to 8192, alpha 32), capped at hidden_size / (2 · scale · rank), tinker-cookbook's earlier rule
    (hidden_size / (2 alpha)), which grows with the width as a LoRA step's first-order effect falls behind a full
    step's. The cap binds below a width of 20 · scale · rank (640 for alpha 32): 1 for the width-64 demo."""
    return min(LR_RATIO, hidden_size / (2 * self.scale * self.rank))


def module_names(config: ModelConfig, target: str) -> list[str]:
  """The Hugging Face module name of `target` in each layer (model.layers.{i}.self_attn.q_proj ...), from the
  family's checkpoint names."""
  kernel_path = ("model", "layers", _SUBMODULE[target], TARGETS[target][0])
  weight_name, _ = families.family_of(config).hf_names[kernel_path]
  return [weight_name.removesuffix(".weight").format(i=i) for i in range(config.num_hidden_layers)]



def matrix_sides(config: ModelConfig, target: str) -> tuple[int, int]:
  """(in, out) of the target's weight matrix, as the checkpoint's [out, in] weight has them."""
  D, F = config.hidden_size, config.intermediate_size
  NH, KH = config.num_attention_heads * config.head_size, config.num_key_value_heads * config.head_size
  return {"q": (D, NH), "k": (D, KH), "v": (D, KH), "o": (NH, D), "gate": (D, F), "up": (D, F), "down": (F, D)}[target]


def _target_named(entry: str) -> str | None:
  name = entry.removesuffix("_proj")
  return name if name in TARGETS else None


def validate(spec: LoraSpec, config: ModelConfig) -> tuple[str, ...]:
  """The targets `spec` adapts in a model of `config` (in TARGETS order); ValueError in one line naming the
  field (lora.rank, lora.alpha, lora.targets) for a rank that is not positive or exceeds the smaller side of a
  targeted matrix, or a target that is neither a projection's name nor a pattern matching one in every layer."""
  if not isinstance(spec.rank, int) or isinstance(spec.rank, bool) or spec.rank <= 0:
    raise ValueError(f"lora.rank: must be a positive integer, got {spec.rank!r}")
  if not spec.alpha > 0:
    raise ValueError(f"lora.alpha: must be positive, got {spec.alpha!r}")
  if not spec.targets:
    raise ValueError(f"lora.targets: empty; name projections among {', '.join(TARGETS)} (or patterns)")
  names = {t: module_names(config, t) for t in TARGETS}
  chosen = set()
  for entry in spec.targets:
    chosen |= {_target_named(entry)} if _target_named(entry) else _matched_by(entry, names)
  targets = tuple(t for t in TARGETS if t in chosen)
  for t in targets:
    if spec.rank > min(matrix_sides(config, t)):
      raise ValueError(f"lora.rank: {spec.rank} is above the smaller side of the {t} projection's "
                       f"{list(matrix_sides(config, t))} matrix")
  saved_params(spec, config)
  return targets


def _matched_by(pattern: str, names: dict[str, list[str]]) -> set[str]:
  """The targets whose modules `pattern` fullmatches: in every layer, or ValueError (adapters are stacked)."""
  try:
    regex = re.compile(pattern)
  except re.error as e:
    raise ValueError(f"lora.targets: {pattern!r} is neither a projection ({', '.join(TARGETS)}) nor a valid "
                     f"pattern ({e})") from None
  hits = {t: [bool(regex.fullmatch(n)) for n in layer_names] for t, layer_names in names.items()}
  partial = [t for t, h in hits.items() if any(h) and not all(h)]
  if partial:
    raise ValueError(f"lora.targets: {pattern!r} matches the {partial[0]} projection in some layers only; adapters "
                     "are stacked over all layers")
  if not any(all(h) for h in hits.values()):
    raise ValueError(f"lora.targets: {pattern!r} is neither a projection ({', '.join(TARGETS)}) nor a pattern "
                     f"matching one (e.g. {names['q'][0]!r})")
  return {t for t, h in hits.items() if all(h)}


# ----------------------------------------------------------------------------------------------
# Adapters in the model


def adapter_names(target: str) -> tuple[str, str]:
  """The attributes that hold a target's adapters A and B (target: q, k, v, o, gate, up or down)."""
  return f"{target}_lora_a", f"{target}_lora_b"


def _adapter_weight(var: nnx.Variable, dtype):
  """An adapter as a matmul reads it (see `sharding.matmul_weight`). Inside the layer scan it is one layer's slice:
  its logical axes are the trailing ones of the stacked parameter's."""
  w = var[...]
  return sharding.matmul_weight(w, tuple(var.get_metadata()["logical_axes"])[-w.ndim:], dtype)


@dataclasses.dataclass(frozen=True)
class Adapted:
  """LoRA's layer code, put by `add_adapters` on each module it adapts or gives a saved copy, as `module.lora`: static
  (part of the graphdef, so every program of a run bakes in the same scale); the layers call it
  (`layers.adapted`, `layers.saved_or_base`), and a module without it runs the program it always ran."""
  scale: float

  def update(self, module: nnx.Module, target: str, x, y, to_rank: str, from_rank: str):
    """y = x W of a projection, plus scale · (x A) B in y's (the compute) dtype when `module` has adapters for
    `target`: unmerged, so the adapters' gradients never form a full [in, out] matrix. `to_rank` and `from_rank`
    are the two einsums (x, A -> x A; x A, B -> the update)."""
    name_a, name_b = adapter_names(target)
    if not hasattr(module, name_a):
      return y
    dt = y.dtype
    xa = jnp.einsum(to_rank, x.astype(dt), _adapter_weight(getattr(module, name_a), dt))
    return y + jnp.einsum(from_rank, xa, _adapter_weight(getattr(module, name_b), dt)) * self.scale

  def weight(self, module: nnx.Module, name: str) -> nnx.Variable:
    """The parameter `name` of `module`, or its trained copy (`saved_<name>`) where the module has one."""
    copy = SAVED_PREFIX + name
    return getattr(module, copy) if hasattr(module, copy) else getattr(module, name)


def add_adapters(model: nnx.Module, spec: LoraSpec, rngs: nnx.Rngs, *, dtype=None, mesh=None) -> nnx.Module:
  """Puts `nnx.LoRAParam` adapters A [layers, .., I] and B [layers, I, ..] beside each targeted kernel of every
  decoder layer of `model` (a CausalLM, or any module holding the decoder, such as PPO's critic), in place, and
  returns it. Initialised as peft: A kaiming-uniform (a = sqrt(5): U(±1/sqrt(fan_in))), B = 0, so the model's
  output is unchanged. `dtype`: the adapters' (default: the kernels'); with a `mesh` they are placed in their
  train-mode shardings. Works on abstract models too (`nnx.eval_shape`, `sharding.create_sharded`)."""
  targets = validate(spec, model.config)
  if nnx.state(model, nnx.LoRAParam):
    raise ValueError("the model has LoRA adapters already")
  for _, module in list(nnx.iter_modules(model)):
    adapted = [t for t in targets if isinstance(getattr(module, TARGETS[t][0], None), nnx.Param)]
    for t in adapted:
      a, b = _init_adapters(getattr(module, TARGETS[t][0]), TARGETS[t][1], spec.rank, rngs, dtype)
      name_a, name_b = adapter_names(t)
      setattr(module, name_a, a)
      setattr(module, name_b, b)
    if adapted:
      module.lora = Adapted(spec.scale)
  saved = saved_params(spec, model.config)
  for path, module in list(nnx.iter_modules(model)):
    for name in SAVEABLE:
      if path + (name,) in saved:
        setattr(module, SAVED_PREFIX + name, lora_saved.saved_copy(getattr(module, name), dtype))
        module.lora = Adapted(spec.scale)
  if mesh is not None:
    adapters = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.device_put(adapters, sharding.state_shardings(adapters, mesh, "train")))
  return model


def _init_adapters(kernel: nnx.Param, inputs: int, rank: int, rngs: nnx.Rngs, dtype):
  """For a stacked kernel [layers, *in, *out]: A [layers, *in, I] ~ U(±1/sqrt(fan_in)) (peft's
  kaiming_uniform_(a=sqrt(5))) and B [layers, I, *out] = 0, with the kernel's logical axes for its dims."""
  shape, axes = kernel.get_value().shape, tuple(kernel.get_metadata()["logical_axes"])
  dtype = dtype or kernel.get_value().dtype
  split = 1 + inputs
  bound = 1 / math.sqrt(math.prod(shape[1:split]))
  a = jax.random.uniform(rngs.params(), shape[:split] + (rank,), dtype, -bound, bound)
  b = jnp.zeros(shape[:1] + (rank,) + shape[split:], dtype)
  return (nnx.LoRAParam(a, logical_axes=axes[:split] + (RANK_AXIS,)),
          nnx.LoRAParam(b, logical_axes=axes[:1] + (RANK_AXIS,) + axes[split:]))


def split(model: nnx.Module):
  """(graphdef, adapters, base): the model's `nnx.LoRAParam` state and the rest of its parameters (LoRAParam
  subclasses Param, so it is filtered first). `nnx.merge(graphdef, adapters, base)` rebuilds the model."""
  return nnx.split(model, nnx.LoRAParam, nnx.Param)


def merge_into(base: nnx.State, adapters: nnx.State, spec: LoraSpec | None) -> nnx.State:
  """`base` with W + scale · A B for each kernel that has adapters, and each saved norm's trained weight in place of
  its base weight (what the sampler runs): pure jnp, so it runs on device where the arrays are (jit it with the
  sampling shardings as out_shardings). The product is formed and added in fp32 at full matmul precision (TPU's
  default would round A and B to bf16), then cast to W's dtype. `adapters` may hold plain weights too (a full run's
  trained part, on an empty base, `spec` None): they are taken as they are."""
  flat = dict(nnx.to_flat_state(base))
  flat.update((path, var) for path, var in nnx.to_flat_state(adapters) if not isinstance(var, nnx.LoRAParam))
  pairs = _adapter_pairs(adapters)
  for (prefix, target), (a, b) in pairs.items():
    path = prefix + (TARGETS[target][0],)
    w = flat[path].get_value()
    delta = _product(a.get_value(), b.get_value(), w.shape)
    flat[path] = flat[path].replace((w.astype(jnp.float32) + spec.scale * delta).astype(w.dtype))
  for path, copy in lora_saved.saved_copies(adapters).items():
    flat[path] = flat[path].replace(copy.get_value().astype(flat[path].get_value().dtype))
  return nnx.from_flat_state(flat)


def _product(a, b, shape):
  """A [layers, *in, I] @ B [layers, I, *out] -> [layers, *in, *out] (fp32, full precision)."""
  layers, rank = a.shape[0], a.shape[-1]
  ab = jnp.matmul(a.reshape(layers, -1, rank).astype(jnp.float32), b.reshape(layers, rank, -1).astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
  return ab.reshape(shape)


def _adapter_pairs(adapters: nnx.State) -> dict[tuple, tuple[nnx.Variable, nnx.Variable]]:
  """{(module path, target): (A, B)} of an adapter state."""
  flat = dict(nnx.to_flat_state(adapters))
  out = {}
  for target in TARGETS:
    name_a, name_b = adapter_names(target)
    out.update({(path[:-1], target): (var, flat[path[:-1] + (name_b,)]) for path, var in flat.items()
                if path[-1] == name_a})
  return out


def without_adapters(model: nnx.Module) -> nnx.Module:
  """A copy of `model` with its adapters removed (its base weights as they are)."""
  model = nnx.clone(model)
  for _, module in list(nnx.iter_modules(model)):
    for target in TARGETS:
      for name in adapter_names(target):
        if hasattr(module, name):
          delattr(module, name)
    if hasattr(module, "lora"):
      del module.lora
    for name in SAVEABLE:
      if hasattr(module, SAVED_PREFIX + name):
        delattr(module, SAVED_PREFIX + name)
  return model


def merged_model(model: nnx.Module, spec: LoraSpec) -> nnx.Module:
  """The model without adapters whose kernels are W + scale · A B and whose saved norms have their trained
  weights: what `hf.save_pretrained` exports."""
  _, adapters, base = split(model)
  graphdef, _ = nnx.split(without_adapters(model))
  return nnx.merge(graphdef, merge_into(base, adapters, spec))


# ----------------------------------------------------------------------------------------------
# PEFT's adapter format: {module}.lora_A.weight [I, in], {module}.lora_B.weight [out, I], one per layer.


def _peft_keys(config: ModelConfig, target: str, which: str) -> list[str]:
  return [f"{PEFT_PREFIX}{name}.lora_{which}.weight" for name in module_names(config, target)]


def to_peft(adapters: nnx.State, spec: LoraSpec, config: ModelConfig,
            base_model_name_or_path: str | None = None) -> tuple[dict[str, np.ndarray], dict]:
  """({PEFT key: array}, adapter_config.json's dict) of a CausalLM's adapters, for `peft.PeftModel.from_pretrained`
  and vLLM. Arrays are read to the host (every process must call it on a multi-host mesh)."""
  tensors, modules = {}, set()
  for (prefix, target), (a, b) in _adapter_pairs(adapters).items():
    if prefix != ("model", "layers", _SUBMODULE[target]):
      raise ValueError(f"adapters at {prefix}: PEFT's format holds a causal LM's decoder-layer adapters only")
    a, b = (np.asarray(multihost_utils.process_allgather(v.get_value(), tiled=True)) for v in (a, b))
    for i, (key_a, key_b) in enumerate(zip(_peft_keys(config, target, "A"), _peft_keys(config, target, "B"))):
      tensors[key_a] = np.ascontiguousarray(a[i].reshape(-1, a.shape[-1]).T)  # [*in, I] -> [I, in]
      tensors[key_b] = np.ascontiguousarray(b[i].reshape(b.shape[1], -1).T)  # [I, *out] -> [out, I]
    modules.add(module_names(config, target)[0].rsplit(".", 1)[-1])
  saved = lora_saved.saved_copies(adapters)
  for path, keys in lora_saved.peft_keys(spec, config).items():
    value = np.asarray(multihost_utils.process_allgather(saved[path].get_value(), tiled=True))
    tensors.update({key: np.ascontiguousarray(w) for key, w in zip(keys, lora_saved.per_key(path, value, len(keys)))})
  return tensors, adapter_config(spec, sorted(modules), base_model_name_or_path,
                                                      lora_saved.ties_saved_embeddings(spec, config))


def spec_from_peft(cfg: dict, where: str = ADAPTER_CONFIG) -> LoraSpec:
  """The LoraSpec of a PEFT adapter_config.json dict; ValueError naming the field for what a plain LoRA (with
  saved norms, `modules_to_save`) lacks."""
  for field, plain in PLAIN_LORA.items():
    value = cfg.get(field, plain)
    if value != plain and (plain or value):  # None, {}, [] and false all mean "none" where that is the plain value
      raise ValueError(f"{where}: {field}={cfg[field]!r} is not supported (a plain LoRA has {plain!r})")
  targets = cfg.get("target_modules")
  if targets == "all-linear":
    targets = list(TARGETS)
  elif isinstance(targets, (list, tuple)):  # peft: a module whose name is the entry or ends with "." + the entry
    targets = [t if _target_named(t) else rf"(.*\.)?{re.escape(t)}" for t in targets]
  missing = [field for field in ("r", "lora_alpha") if field not in cfg]
  if missing:
    raise ValueError(f"{where}: missing field {missing[0]!r}")
  return LoraSpec(rank=cfg["r"], alpha=cfg["lora_alpha"], targets=targets or (),
                  use_rslora=bool(cfg.get("use_rslora", False)),
                  modules_to_save=tuple(cfg.get("modules_to_save") or ()))


def from_peft(folder: str, model: nnx.Module, *, dtype=None) -> LoraSpec:
  """Loads a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) into `model` (a CausalLM),
  adding its adapters (and saved norms) first when it has none; returns the folder's LoraSpec. ValueError for a
  folder whose adapters do not fit the model (a missing, extra or misshapen tensor names it)."""
  config_path, weights_path = os.path.join(folder, ADAPTER_CONFIG), os.path.join(folder, ADAPTER_WEIGHTS)
  with open(config_path) as f:
    peft_config = json.load(f)
  spec = spec_from_peft(peft_config, config_path)
  try:
    ties = lora_saved.ties_saved_embeddings(spec, model.config)
  except ValueError as e:  # "lora.modules_to_save: ..."
    raise ValueError(f"{config_path}: modules_to_save={list(spec.modules_to_save)!r} is not supported "
                     f"({str(e).split(': ', 1)[1]})") from None
  if ties and not peft_config.get("ensure_weight_tying"):
    raise ValueError(f"{config_path}: ensure_weight_tying=False with tied embeddings in modules_to_save is not "
                     "supported (peft's LM head keeps the base embeddings there; ours is the trained copy)")
  if not nnx.state(model, nnx.LoRAParam):
    add_adapters(model, spec, nnx.Rngs(0), dtype=dtype)
  scales = {m.lora.scale for _, m in nnx.iter_modules(model) if hasattr(m, "lora")}
  if scales != {spec.scale}:
    raise ValueError(f"{config_path}: the adapters' scale {spec.scale} differs from the model's adapters' {scales}")
  tensors = load_file(weights_path)
  adapters = nnx.state(model, nnx.LoRAParam)
  used = set()
  for (prefix, target), (a, b) in _adapter_pairs(adapters).items():
    for var, which in ((a, "A"), (b, "B")):
      keys = _peft_keys(model.config, target, which)
      var.set_value(jnp.asarray(_stacked(tensors, keys, var.get_value().shape, which, weights_path),
                                var.get_value().dtype))
      used.update(keys)
  saved = lora_saved.saved_copies(adapters)
  for path, keys in lora_saved.peft_keys(spec, model.config).items():
    var = saved[path]
    missing = [key for key in keys if key not in tensors]
    if missing:
      raise ValueError(f"{weights_path}: missing {missing[0]}")
    layered, shape = path[:2] == ("model", "layers"), var.get_value().shape
    weight = np.stack([tensors[key] for key in keys]) if layered else tensors[keys[0]]  # [L, D], [V, D]
    weight = weight.T if path == ("lm_head",) else weight  # transformers' [V, D] -> ours [D, V]
    if weight.shape != shape:
      raise ValueError(f"{weights_path}: {keys[0]} has shape {list(weight.shape[layered:])}, expected "
                       f"{list(shape[layered:])}")
    var.set_value(jnp.asarray(weight, var.get_value().dtype))
    used.update(keys)
  if set(tensors) - used:
    raise ValueError(f"{weights_path}: {sorted(set(tensors) - used)[0]} is no adapter of this model's targets")
  nnx.update(model, adapters)
  return spec


def _stacked(tensors: dict, keys: list[str], shape: tuple, which: str, where: str) -> np.ndarray:
  """One adapter [layers, ...] from its per-layer PEFT tensors (A: [I, in], B: [out, I])."""
  layers = []
  for key in keys:
    if key not in tensors:
      raise ValueError(f"{where}: missing {key}")
    t = tensors[key].T  # A: [in, I]; B: [I, out]
    expected = (math.prod(shape[1:-1]), shape[-1]) if which == "A" else (shape[1], math.prod(shape[2:]))
    if t.shape != expected:
      raise ValueError(f"{where}: {key} has shape {list(t.shape[::-1])}, expected {list(expected[::-1])}")
    layers.append(t.reshape(shape[1:]))
  return np.stack(layers)
