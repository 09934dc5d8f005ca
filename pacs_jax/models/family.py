"""What a model family is: the record `pacs_jax.models.families` holds for each Hugging Face `model_type`."""

from __future__ import annotations

import dataclasses

from pacs_jax.models import hf_layout, layers
from pacs_jax.models.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
  """A decoder family: its config class (defaults, HF config.json both ways), its checkpoint names, its decoder
  layer and its presets (random-init shapes by name)."""
  config: type[ModelConfig]  # config.model_type is the registry key
  hf_names: dict[tuple, tuple[str, str]] = dataclasses.field(default_factory=lambda: hf_layout.LLAMA_NAMES)
  layer: type[layers.DecoderLayer] = layers.DecoderLayer
  presets: dict[str, ModelConfig] = dataclasses.field(default_factory=dict)

  @property
  def model_type(self) -> str:
    return self.config.model_type
