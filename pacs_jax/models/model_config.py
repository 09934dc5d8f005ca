"""The decoder's configuration, the same fields for every family: a family subclasses `ModelConfig` to set its
defaults and its translation from and to a Hugging Face config.json (see `pacs_jax.models.families`)."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any, ClassVar

import jax.numpy as jnp

from pacs_jax.models import rope


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  model_type: ClassVar[str] = ""  # config.json's model_type: the family's key in the registry
  architecture: ClassVar[str] = ""  # config.json's architectures[0]

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None  # None: hidden_size // num_attention_heads
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: rope.Llama3Scaling | None = None  # None: the default RoPE
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  attention_bias: bool = False  # biases on the q, k and v projections (Qwen2)
  qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3)
  hidden_act: str = "silu"  # the MLP gate's nonlinearity, by transformers' name (the family's MLP implements it)
  # Numerics / memory; not part of the HF config.
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32  # compute dtype of matmuls (bf16 on accelerators)
  remat: bool = False  # rematerialise each decoder layer in the backward pass (keep only its input)
  # >0: attend `attention_chunk` queries at a time, each block rematerialised in the backward pass, so the
  # fp32 scores peak at [B, K, G, chunk, S] instead of [B, K, G, T, S] (long responses). 0 = all at once.
  attention_chunk: int = 0
  # Uncached (training / log-prob) attention: "xla" (`attention.attend`, the reference), "splash" (TPU Pallas
  # kernels), "cudnn" (GPU flash attention) or "auto" (by the platform the program is traced for).
  attention_impl: str = "auto"
  # What a rematerialised layer saves for the backward pass (`remat=True`): "nothing" (its input only) or
  # "matmuls" (projection and MLP matmul outputs and the splash kernel's residuals: no matmul re-run).
  remat_policy: str = "nothing"

  def __post_init__(self):
    if self.head_dim is None:  # transformers' default; stored so configs compare equal after a round trip
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

  @property
  def head_size(self) -> int:
    return self.head_dim

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf_dict(cls, cfg: dict, **overrides) -> "ModelConfig":
    """Builds a config from a transformers `config.json` dict (transformers 4 and 5 layouts); a field the dict
    lacks takes this family's default, and so do the architecture flags (attention_bias, qk_norm). KeyError
    names a required field that is missing; ValueError an attention pattern the layer stack cannot run (the
    registry refuses a `hidden_act` the family's MLP does not implement)."""
    check_attention_pattern(cls.model_type, cls.attention_pattern(cfg), cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    theta, scaling = rope.from_hf(cfg)
    return cls(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim"),
        hidden_act=cfg.get("hidden_act", defaults["hidden_act"]),
        rms_norm_eps=cfg.get("rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
        max_position_embeddings=cfg.get("max_position_embeddings", defaults["max_position_embeddings"]),
        **overrides,
    )

  @staticmethod
  def attention_pattern(cfg: dict) -> tuple[str, ...]:
    """Each layer's attention as config.json sets it, in transformers 5's words (`layer_types`: "full_attention",
    "sliding_attention", ...). Without `layer_types`, read as Mistral reads it: a `sliding_window` (any value but
    null) slides every layer; so does `use_sliding_window: true`. A family whose transformers class gates the
    window otherwise (Qwen's `max_window_layers`) overrides this."""
    if cfg.get("layer_types") is not None:
      return tuple(cfg["layer_types"])
    slides = cfg.get("sliding_window") is not None or bool(cfg.get("use_sliding_window"))
    return ("sliding_attention" if slides else "full_attention",) * cfg["num_hidden_layers"]

  def to_hf_dict(self) -> dict:
    """The transformers config fields (written to `config.json` on export)."""
    return dict(
        architectures=[self.architecture],
        model_type=self.model_type,
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_hidden_layers,
        num_attention_heads=self.num_attention_heads,
        num_key_value_heads=self.num_key_value_heads,
        head_dim=self.head_size,
        hidden_act=self.hidden_act,
        rms_norm_eps=self.rms_norm_eps,
        **rope.to_hf(self.rope_theta, self.rope_scaling),
        tie_word_embeddings=self.tie_word_embeddings,
        max_position_embeddings=self.max_position_embeddings,
        attention_dropout=0.0,
        torch_dtype="float32" if jnp.dtype(self.param_dtype) == jnp.float32 else "bfloat16",
    )


WINDOW_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers")


def check_attention_pattern(model_type: str, kinds: tuple[str, ...], cfg: dict) -> None:
  """ValueError unless every layer is "full_attention": the layer stack runs one layer body for all layers
  (`layers.scan_layers`), and that body attends to every earlier token."""
  counts = collections.Counter(kinds)
  if set(counts) <= {"full_attention"}:
    return
  source = "layer_types" if cfg.get("layer_types") is not None else ", ".join(
      f"{k}={json.dumps(cfg[k])}" for k in WINDOW_FIELDS if k in cfg)
  if len(counts) > 1:
    pattern = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    raise ValueError(f"layers of different kinds ({pattern}, from {source}) are not supported for model_type "
                     f"{model_type!r}: its layer stack runs one layer body for every layer")
  raise ValueError(f"{kinds[0]} in every layer (from {source}) is not supported for model_type {model_type!r}: "
                   "every layer attends to all earlier tokens")


def refuse_flags(cfg: dict, *names: str) -> None:
  """ValueError when config.json sets one of the boolean fields `names` (parts this family's model lacks)."""
  for name in names:
    if cfg.get(name):
      raise ValueError(f"{name}=true is not supported for model_type {cfg.get('model_type')!r}")
