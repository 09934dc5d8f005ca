"""Qwen2 / Qwen2.5 (`model_type: qwen2`): Llama's decoder with biases on the q, k and v projections."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pacs_jax.models.family import Family
from pacs_jax.models.model_config import ModelConfig


def qwen_attention_pattern(cfg: dict) -> tuple[str, ...]:
  """Each layer's attention as transformers' Qwen2Config and Qwen3Config derive it: `layer_types` when given, else
  a window (`sliding_window`, default 4096) only with `use_sliding_window`, and only from layer
  `max_window_layers` (default 28) on. Qwen2.5's config.json names a window with `use_sliding_window: false`:
  every layer attends to all earlier tokens."""
  if cfg.get("layer_types") is not None:
    return tuple(cfg["layer_types"])
  window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
  first = cfg.get("max_window_layers", 28)
  return tuple("sliding_attention" if window is not None and i >= first else "full_attention"
               for i in range(cfg["num_hidden_layers"]))


@dataclasses.dataclass(frozen=True)
class Qwen2Config(ModelConfig):
  model_type: ClassVar[str] = "qwen2"
  architecture: ClassVar[str] = "Qwen2ForCausalLM"
  rope_theta: float = 1_000_000.0
  attention_bias: bool = True  # transformers' Qwen2Attention always has them (no config field)
  attention_pattern = staticmethod(qwen_attention_pattern)

  def to_hf_dict(self) -> dict:
    return {**super().to_hf_dict(), "use_sliding_window": False}


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

FAMILY = Family(Qwen2Config, presets=PRESETS)
