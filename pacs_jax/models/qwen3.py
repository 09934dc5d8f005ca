"""Qwen3 dense (`model_type: qwen3`): no q/k/v biases; an RMSNorm over each head of q and of k before RoPE; a
head dim of its own (not hidden / heads)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pacs_jax.models.family import Family
from pacs_jax.models.model_config import ModelConfig, refuse_flags
from pacs_jax.models.qwen2 import qwen_attention_pattern


@dataclasses.dataclass(frozen=True)
class Qwen3Config(ModelConfig):
  model_type: ClassVar[str] = "qwen3"
  architecture: ClassVar[str] = "Qwen3ForCausalLM"
  qk_norm: bool = True
  attention_pattern = staticmethod(qwen_attention_pattern)

  @classmethod
  def from_hf_dict(cls, cfg: dict, **overrides) -> "Qwen3Config":
    refuse_flags(cfg, "attention_bias")  # would bias o_proj too
    return super().from_hf_dict({"head_dim": 128, **cfg}, **overrides)  # transformers' Qwen3Config default

  def to_hf_dict(self) -> dict:
    return {**super().to_hf_dict(), "attention_bias": False, "use_sliding_window": False}


FAMILY = Family(Qwen3Config)
