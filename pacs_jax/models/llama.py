"""Llama 3 (`model_type: llama`): the plain decoder (no biases), with Llama 3.1's RoPE scaling when config.json
asks for it (`rope_type: llama3`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pacs_jax.models.family import Family
from pacs_jax.models.model_config import ModelConfig, refuse_flags


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
  model_type: ClassVar[str] = "llama"
  architecture: ClassVar[str] = "LlamaForCausalLM"

  @classmethod
  def from_hf_dict(cls, cfg: dict, **overrides) -> "LlamaConfig":
    refuse_flags(cfg, "attention_bias", "mlp_bias")
    return super().from_hf_dict(cfg, **overrides)

  def to_hf_dict(self) -> dict:
    return {**super().to_hf_dict(), "attention_bias": False, "mlp_bias": False}


FAMILY = Family(LlamaConfig)
