"""LoRA's saved modules (peft's `modules_to_save`): which parameters `lora.modules_to_save` names, their trained
copies (`saved_<name>` beside the parameter, `nnx.LoRAParam`), their PEFT tensors, and PEFT's adapter_config.json.
docs/lora.md has the design."""

from __future__ import annotations

import numpy as np
from flax import nnx

from pacs_jax.models import families
from pacs_jax.models.model_config import ModelConfig

PEFT_PREFIX = "base_model.model."  # PEFT's key of a module: this prefix, the transformers module name, lora_A/B
# A saved parameter's trained copy is `saved_<name>` beside the parameter `<name>`: the module computes with the copy
# (`lora.Adapted.weight`), and the base model's parameter stays as it was (the frozen reference reads it).
SAVED_PREFIX = "saved_"


def hf_weights(config: ModelConfig) -> dict[tuple, list[str]]:
  """{parameter path in a CausalLM of `config`: its checkpoint tensor names, one per layer for a stacked one}."""
  model = nnx.eval_shape(lambda: families.causal_lm(config, rngs=nnx.Rngs(0)))
  names = families.family_of(config).hf_names
  return {path: [names[path][0].format(i=i) for i in range(config.num_hidden_layers)] if "{i}" in names[path][0]
          else [names[path][0]] for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# The parameters a LoRA run may train in full beside its adapters (`modules_to_save`): the norms' weights, the
# embeddings (with tied embeddings, the LM head too) and an untied LM head. The projections take adapters instead.
SAVEABLE = ("weight", "embed_tokens", "lm_head")


def saved_params(spec, config: ModelConfig) -> tuple[tuple, ...]:
  """The paths (("model", "norm", "weight"), a stacked layer norm's once, ("model", "embed_tokens")) of the
  parameters `spec.modules_to_save` names in a CausalLM of `config`. An entry names, as in peft, every module whose
  name (`base_model.model.` + the Hugging Face module name, parents included) ends with it; ValueError in one line
  naming lora.modules_to_save for an entry that names no module, names one that is neither a norm nor the
  embeddings or LM head, or a layer's norm in some layers only (the layers are stacked)."""
  if not spec.modules_to_save:
    return ()
  weights = hf_weights(config)
  saveable = {path: [n.removesuffix(".weight") for n in names]
              for path, names in weights.items() if path[-1] in SAVEABLE}
  modules = {name.rsplit(".", 1)[0] for names in weights.values() for name in names}
  modules |= {m.rsplit(".", k)[0] for m in modules for k in range(1, m.count(".") + 1)}  # parents, as peft sees them
  chosen = []
  for entry in spec.modules_to_save:
    named = sorted(m for m in modules if (PEFT_PREFIX + m).endswith(entry))
    if not named:
      raise ValueError(f"lora.modules_to_save: {entry!r} names no module of the model (peft's rule: a module whose "
                       "name ends with it; e.g. 'norm' for every norm, 'model.norm' for the final one)")
    others = [m for m in named if not any(m in layer_names for layer_names in saveable.values())]
    if others:
      raise ValueError(f"lora.modules_to_save: {entry!r} names {others[0]}, which is neither a norm nor the "
                       "embeddings or LM head (the projections take adapters)")
    for path, layer_names in saveable.items():
      hits = [name in named for name in layer_names]
      if any(hits) and not all(hits):
        raise ValueError(f"lora.modules_to_save: {entry!r} names {layer_names[hits.index(True)]} in some layers "
                         "only; norms are stacked over all layers")
      if all(hits) and path not in chosen:
        chosen.append(path)
  return tuple(p for p in saveable if p in chosen)


def saved_copy(param: nnx.Param, dtype) -> nnx.LoRAParam:
  """A trained copy of `param` (in `dtype`, default the parameter's), with its logical axes."""
  return nnx.LoRAParam(param.get_value().astype(dtype or param.get_value().dtype),
                       logical_axes=tuple(param.get_metadata()["logical_axes"]))


def with_saved_from(trained: nnx.State, base: nnx.State) -> nnx.State:
  """`trained` with each saved norm's copy set to the `base` weight it copies (in the copy's dtype): for copies made
  on another model than the base (PPO's critic is built with a fresh backbone and runs on the policy's base)."""
  flat, weights = dict(nnx.to_flat_state(trained)), dict(nnx.to_flat_state(base))
  for path, var in flat.items():
    if path[-1].startswith(SAVED_PREFIX):
      flat[path] = var.replace(weights[base_path(path)].get_value().astype(var.get_value().dtype))
  return nnx.from_flat_state(flat)


def saved_copies(state: nnx.State) -> dict[tuple, nnx.Variable]:
  """{the base weight's path: its trained copy} of the saved norms in an adapter state."""
  return {base_path(path): var for path, var in nnx.to_flat_state(state) if path[-1].startswith(SAVED_PREFIX)}


def base_path(copy_path: tuple) -> tuple:
  """The path of the base parameter a saved copy (`saved_<name>`) copies."""
  return copy_path[:-1] + (copy_path[-1].removeprefix(SAVED_PREFIX),)


def per_key(path: tuple, value: np.ndarray, keys: int) -> list[np.ndarray]:
  """A saved copy as its PEFT tensors: a stacked norm's layers [L, D] one by one, our LM head [D, V] as
  transformers' [V, D], and the same embeddings [V, D] twice with tied embeddings (embed_tokens and lm_head)."""
  if path[:2] == ("model", "layers"):
    return list(value)
  return [value.T] if path == ("lm_head",) else [value] * keys


def ties_saved_embeddings(spec, config: ModelConfig) -> bool:
  """Whether `spec` saves tied embeddings: the LM head is then the trained copy too, which peft does with
  `ensure_weight_tying` (without it, peft's LM head keeps the base embeddings)."""
  return config.tie_word_embeddings and ("model", "embed_tokens") in saved_params(spec, config)


def peft_keys(spec, config: ModelConfig) -> dict[tuple, list[str]]:
  """{a saved parameter's path: its PEFT keys, one per layer for a stacked norm}: peft stores a module_to_save under
  the module's own name (`base_model.model.model.norm.weight`), without its `modules_to_save.default.` wrapper; with
  tied embeddings saved it stores the LM head's copy too (`base_model.model.lm_head.weight`)."""
  if not spec.modules_to_save:
    return {}
  weights = hf_weights(config)
  out = {path: [PEFT_PREFIX + name for name in weights[path]] for path in saved_params(spec, config)}
  if ties_saved_embeddings(spec, config):
    out[("model", "embed_tokens")].append(PEFT_PREFIX + "lm_head.weight")
  return out


def adapter_config(spec, target_modules: list[str], base_model_name_or_path: str | None,
                   ensure_weight_tying: bool = False) -> dict:
  """adapter_config.json as peft writes it for a LoRA (the fields peft and vLLM read), with `modules_to_save` as
  the spec's entries (peft matches them to modules as `saved_params` does) and `ensure_weight_tying` when tied
  embeddings are saved (`ties_saved_embeddings`)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
      "r": spec.rank, "lora_alpha": spec.alpha, "use_rslora": spec.use_rslora, "target_modules": target_modules,
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
      "modules_to_save": list(spec.modules_to_save) or None,
      "init_lora_weights": True, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
      "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None, "lora_bias": False,
      "ensure_weight_tying": ensure_weight_tying,
  }


# adapter_config.json fields whose other values change what the adapter computes: refused, each by name.
PLAIN_LORA = {"peft_type": "LORA", "use_dora": False, "bias": "none", "lora_bias": False, "fan_in_fan_out": False,
               "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
               "layers_pattern": None, "exclude_modules": None, "target_parameters": None}
