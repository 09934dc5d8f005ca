"""The documented default training config (one place per field) and its validation.

Config files under `configs/` start from `default_config()` and override what differs. `validate`
(`checks.py`) runs before anything is compiled and names the offending field in its message; `files.py` reads
config files.
"""

from __future__ import annotations

import ml_collections

from pacs_jax.config.checks import (DTYPE_NAMES, ConfigError, advisories, check_lora_fits_model, check_mesh_layout,
                                    check_tokenizer_fits_model, lora_spec, validate, validate_eval)
from pacs_jax.config.defaults import default_config
from pacs_jax.config.files import CONFIGS_DIR, get_field, load_config_file, set_field, shipped_config_path

__all__ = ["CONFIGS_DIR", "DTYPE_NAMES", "ConfigError", "advisories", "check_lora_fits_model", "check_mesh_layout",
           "check_tokenizer_fits_model", "default_config", "dtype", "get_field", "load_config_file", "lora_spec",
           "model_config", "model_overrides", "preset_model_config", "set_field", "shipped_config_path", "validate",
           "validate_eval"]


def dtype(name):
  """A supported dtype (one of DTYPE_NAMES) named any way JAX and NumPy users write it: "bfloat16",
  jnp.bfloat16, np.float32, np.dtype("float32") -> the jnp scalar type."""
  import jax.numpy as jnp  # jax only when a model is built
  import numpy as np
  try:
    canonical = np.dtype(name).name if not isinstance(name, str) else name
  except TypeError:
    canonical = None
  if canonical not in DTYPE_NAMES:
    raise ValueError(f"dtype must be one of {DTYPE_NAMES} (a name, jnp or NumPy type), got {name!r}")
  return getattr(jnp, canonical)


def model_overrides(c: ml_collections.ConfigDict) -> dict:
  """The `ModelConfig` fields a run config sets on top of a preset or a checkpoint's config.json."""
  return dict(param_dtype=dtype(c.model.param_dtype), dtype=dtype(c.model.dtype), remat=c.model.remat,
              attention_chunk=c.model.attention_chunk, attention_impl=c.model.attention_impl,
              remat_policy=c.model.remat_policy)


def preset_model_config(c: ml_collections.ConfigDict):
  """The policy's `ModelConfig` from `model.preset` alone (shapes for dry runs; never reads a checkpoint)."""
  from pacs_jax.models import families
  overrides = model_overrides(c)
  if c.model.vocab_size:
    overrides["vocab_size"] = c.model.vocab_size
  return families.preset(c.model.preset, **overrides)


def model_config(c: ml_collections.ConfigDict):
  """The policy's `ModelConfig`: `model.hf_path`'s config.json when set, else the preset's."""
  from pacs_jax.models import hf
  if c.model.hf_path:
    try:
      return hf.load_config(c.model.hf_path, **model_overrides(c))
    except ValueError as e:  # a model_type no family reads, or a part of the family its model lacks
      raise ConfigError(f"config.model.hf_path: {e}") from None
  return preset_model_config(c)
