"""pacs-jax: PACS (and the GRPO / PPO baselines) post-training of Qwen2.5 in JAX / Flax NNX.

The public API (docs/api.md):

  cfg = load_config("tiny_cpu", {"steps": 20})          # a run config (configs/<name>.py or a file)
  metrics = train(cfg, "runs/demo")                     # or Trainer(cfg, workdir).run()
  model, tokenizer = load_pretrained("runs/demo")       # a workdir's policy, or a Hugging Face directory
  generate(model, tokenizer, ["What is 7 * 8?"])        # [[response]]
  save_pretrained(model, "out/", tokenizer=tokenizer)   # a directory transformers loads
  register_algorithm("mine", MyAlgorithm())             # an objective for config.algorithm = "mine"
  AlgorithmSettings, setting                             # its typed settings: the config's `mine` block
  register_advantage_estimator("mine")(fn)               # a group baseline an objective names
  pacs_loss, grpo_loss, clipped_policy_loss, clipped_value_loss  # the losses, pure functions of arrays

Importing the package is light: each name is imported on first use (module `__getattr__`), so that
`import pacs_jax.paths` never pulls in the trainer, and no module below imports one above it.
"""

import importlib as _importlib
import logging as _logging
import os as _os

# gs:// paths go through fsspec/gcsfs (a dependency) even where another package pulled TensorFlow in:
# etils.epath would otherwise pick TensorFlow's gfile, a second, untested GCS client. Set before
# anything (Orbax included) asks epath for a backend, which it decides once.
_os.environ.setdefault("EPATH_USE_TF", "false")

# Libraries' import-time notes that are no news to a user, silenced at their cause before any of them is imported:
# transformers' advice that PyTorch is absent (only its tokenizers are used here), and the INFO lines gcsfs
# ("experimental features enabled") and matplotlib ("generated new fontManager") log, which the commands' absl
# logging shows. Their warnings still show.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
for _library in ("gcsfs", "matplotlib"):
  _logging.getLogger(_library).setLevel(_logging.WARNING)

# name -> (module, attribute or None for the module itself): the public API, imported on first use.
_PUBLIC = {
    "load_config": ("pacs_jax.api", "load_config"),
    "Trainer": ("pacs_jax.trainer.loop", "Trainer"),
    "train": ("pacs_jax.trainer.loop", "train"),
    "load_pretrained": ("pacs_jax.api", "load_pretrained"),
    "save_pretrained": ("pacs_jax.api", "save_pretrained"),
    "generate": ("pacs_jax.api", "generate"),
    "Algorithm": ("pacs_jax.algos.algorithms", "Algorithm"),
    "register_algorithm": ("pacs_jax.algos.algorithms", "register"),
    "AlgorithmSettings": ("pacs_jax.algos.settings", "Settings"),
    "setting": ("pacs_jax.algos.settings", "setting"),
    "register_advantage_estimator": ("pacs_jax.algos.advantages", "register"),
    "pacs_loss": ("pacs_jax.algos.pacs", "pacs_loss"),
    "pacs": ("pacs_jax.algos.pacs", None),
    "grpo_loss": ("pacs_jax.algos.grpo", "grpo_loss"),
    "clipped_policy_loss": ("pacs_jax.algos.grpo", "clipped_policy_loss"),
    "clipped_value_loss": ("pacs_jax.algos.ppo", "clipped_value_loss"),
}

__all__ = ["__version__", *_PUBLIC]


def _version() -> str:
  """The installed distribution's version; from a source tree that is not installed, setup.cfg's."""
  from importlib import metadata
  try:
    return metadata.version("pacs-jax")
  except metadata.PackageNotFoundError:
    import configparser
    parser = configparser.ConfigParser()
    parser.read(_os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "setup.cfg"))
    return parser.get("metadata", "version", fallback="unknown")


__version__ = _version()


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'pacs_jax' has no attribute {name!r}")
  module, attribute = _PUBLIC[name]
  value = _importlib.import_module(module)
  value = getattr(value, attribute) if attribute else value
  globals()[name] = value  # the next lookup finds it without this function
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
