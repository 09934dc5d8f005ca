"""Model families by Hugging Face `model_type`, and every way to build a model: from a config, a config.json dict or
a preset name. Adding a family: a module with its `ModelConfig` subclass and `FAMILY`, and one line below.
"""

from __future__ import annotations

from flax import nnx

from pacs_jax.models import decoder, hf_layout, llama, qwen2, qwen3
from pacs_jax.models.family import Family
from pacs_jax.models.model_config import ModelConfig

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
  """Adds (or replaces) the family of `family.model_type`."""
  FAMILIES[family.model_type] = family
  return family


register(qwen2.FAMILY)
register(qwen3.FAMILY)
register(llama.FAMILY)


def family_of(config: ModelConfig) -> Family:
  return get(config.model_type)


def get(model_type: str) -> Family:
  if model_type not in FAMILIES:
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {tuple(FAMILIES)}")
  return FAMILIES[model_type]


def causal_lm(config: ModelConfig, *, rngs: nnx.Rngs) -> decoder.CausalLM:
  """The family's decoder with its LM head (randomly initialised from `rngs`)."""
  return decoder.CausalLM(config, family_of(config).layer, rngs=rngs)


def backbone(config: ModelConfig, *, rngs: nnx.Rngs) -> decoder.Backbone:
  """The family's decoder without a head (hidden states), e.g. under a value head."""
  return decoder.Backbone(config, family_of(config).layer, rngs=rngs)


def config_from_hf(cfg: dict, **overrides) -> ModelConfig:
  """A config.json dict -> its family's config; ValueError for a model_type no family has, and for a part its
  model lacks (a `hidden_act` its MLP does not implement, sliding windows...)."""
  family = get(cfg.get("model_type"))
  config = family.config.from_hf_dict(cfg, **overrides)
  family.layer.mlp_cls.check_activation(config)
  return config


def preset(name: str, **overrides) -> ModelConfig:
  """A preset of any family by name, with `overrides` (dtype, remat...)."""
  for family in FAMILIES.values():
    if name in family.presets:
      return family.presets[name].replace(**overrides)
  raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(preset_names())}")


def preset_names() -> list[str]:
  return [name for family in FAMILIES.values() for name in family.presets]


def tensor_maps(config: ModelConfig, paths) -> list[hf_layout.TensorMap]:
  """The HF tensor of each parameter of a model of `config` whose flat state has `paths`."""
  return hf_layout.tensor_maps(family_of(config).hf_names, paths, config.num_hidden_layers)
