"""Config files: `load_config_file` runs a file's `get_config()` with dotted-key overrides; `get_field` / `set_field`
read and write a dotted field; `shipped_config_path` finds a shipped config by name."""

from __future__ import annotations

import os

import ml_collections


# The repository's configs/ folder beside the package (an editable install or a source checkout).
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def shipped_config_path(name: str) -> str:
  """The path of a shipped config by name (`"tiny_cpu"` -> configs/tiny_cpu.py). Raises FileNotFoundError."""
  path = os.path.join(CONFIGS_DIR, f"{name}.py")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{name!r}: neither a config file nor a config of {CONFIGS_DIR}")
  return path


def load_config_file(path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
  """Runs a config file's `get_config()` (as `--config` does) and applies dotted-key overrides."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(f"_pacs_config_{abs(hash(path))}", path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"{path}: not a Python config file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"{path}: has no get_config()")
  cfg = module.get_config()
  for key, value in (overrides or {}).items():
    try:
      set_field(cfg, key, value)
    except KeyError:
      raise KeyError(f"{path}: config has no field {key!r}") from None
  return cfg


def get_field(cfg: ml_collections.ConfigDict, dotted: str):
  """cfg["a"]["b"] for "a.b"."""
  for key in dotted.split("."):
    cfg = cfg[key]
  return cfg


def set_field(cfg: ml_collections.ConfigDict, dotted: str, value) -> None:
  """cfg["a"]["b"] = value for "a.b"; KeyError for a field the config does not have."""
  *parents, leaf = dotted.split(".")
  node = get_field(cfg, ".".join(parents)) if parents else cfg
  if leaf not in node:
    raise KeyError(dotted)
  node[leaf] = value
