"""What gives a checkpoint's state its meaning (algorithm, model shape, tokenizer, the objective's settings; for a
LoRA run its adapters' settings and the base model they sit on; the data and the rollout programs, from its saved
config), compared on resume: a change refuses the resume unless allowed, other config changes warn.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Any

import ml_collections
from absl import logging

from pacs_jax.algos import algorithms
from pacs_jax.config.checks import ALLOWABLE
from pacs_jax.models import hf
from pacs_jax.storage.checkpoint import CheckpointMismatch

# The model fields that decide the parameters' shapes and what they compute.
MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta",
                "rms_norm_eps")
# Config fields a resume changes as a matter of course: never warned about.
EXPECTED_CHANGES = ("steps", "checkpoint.restore", "checkpoint.allow_changes")
# Fields that decide the prompt order; the data iterator's saved position means nothing without them.
DATA_ORDER_FIELDS = ("seed", "data.train", "data.synthetic_train_size", "data.max_prompt_length",
                     "data.skip_bad_rows", "train.batch_prompts")
# Fields whose change makes a checkpoint's run another experiment: the data (the prompt order above, the validation
# set and the instruction) and the rollout programs (group size, response budget, sampling, the environment a
# response is a conversation with). A resume that changes one is refused unless checkpoint.allow_changes names its
# section ("data", "rollout").
CONFIG_SECTIONS = {
    "data": DATA_ORDER_FIELDS + ("data.val", "data.val_dir", "data.val_max_examples", "data.instruction"),
    "rollout": ("rollout.n", "rollout.max_new_tokens", "rollout.val_max_new_tokens", "rollout.temperature",
                "rollout.top_p", "rollout.top_k", "rollout.stop_tokens", "env.name", "env.max_turns"),
}
# The lora fields that decide what a LoRA checkpoint's adapters are (lora.lr_multiplier is a learning rate).
LORA_FIELDS = ("rank", "alpha", "targets", "use_rslora", "modules_to_save")
SECTIONS = ("algorithm", "model", "lora", "base", "tokenizer", "objective", *CONFIG_SECTIONS)
# A safetensors file's fingerprint reads its header and this many blocks of its tensor data, evenly spaced.
_BLOCKS, _BLOCK_BYTES = 16, 1 << 16


def tokenizer_fingerprint(tokenizer) -> dict:
  """The tokenizer's size and a hash of its vocabulary (the same text must map to the same ids)."""
  vocab = sorted(tokenizer.get_vocab().items())
  digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
  return {"vocab_size": len(vocab), "vocab_sha256": digest}


def _safetensors_fingerprint(path: str, digest) -> None:
  """Adds a safetensors file's name, size, header (tensor names, dtypes, shapes, offsets) and _BLOCKS blocks of its
  tensor data, evenly spaced, to `digest`: a few MiB read, where hashing a 7B model's 15 GB would take minutes."""
  size = os.path.getsize(path)
  digest.update(f"{os.path.basename(path)}:{size}:".encode())
  with open(path, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    digest.update(f.read(header_len))
    start = 8 + header_len
    for i in range(_BLOCKS):
      f.seek(start + (size - start) * i // _BLOCKS)
      digest.update(f.read(_BLOCK_BYTES))


def base_fingerprint(cfg: ml_collections.ConfigDict) -> dict:
  """What identifies a LoRA run's frozen base weights: a sha256 of `model.hf_path`'s config.json and its
  safetensors files (`_safetensors_fingerprint`), or the preset, vocabulary, dtype and seed of a random init."""
  if not cfg.model.hf_path:
    return {"preset": cfg.model.preset, "vocab_size": cfg.model.vocab_size, "param_dtype": cfg.model.param_dtype,
            "seed": cfg.seed}
  directory = hf.resolve_path(cfg.model.hf_path)
  digest = hashlib.sha256()
  with open(os.path.join(directory, hf.CONFIG_FILE), "rb") as f:
    digest.update(f.read())
  for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
    _safetensors_fingerprint(path, digest)
  return {"sha256": digest.hexdigest()[:16]}


def _lora_section(lora: dict) -> dict | None:
  """The record's `lora` section of a config's lora block: None for full fine-tuning (rank 0). Saved norms are
  recorded when there are some, so a record written before `lora.modules_to_save` existed still matches."""
  if not lora.get("rank"):
    return None
  return {k: lora.get(k) for k in LORA_FIELDS if k != "modules_to_save" or lora.get(k)}


def make_record(cfg: ml_collections.ConfigDict, hf_config: dict, tokenizer) -> dict:
  """The record of a run of `cfg` (a LoRA run's adds `lora` and the `base` fingerprint; a full run's has neither,
  as before LoRA existed)."""
  algorithm = cfg.algorithm
  objective = algorithms.get(algorithm).settings(cfg).as_dict()  # the algorithm's own typed settings
  record = {
      "algorithm": algorithm,
      "model": {k: hf_config.get(k) for k in MODEL_FIELDS},
      "tokenizer": {"name": cfg.tokenizer or cfg.model.hf_path, **tokenizer_fingerprint(tokenizer)},
      "objective": {f"{algorithm}.{k}": v for k, v in sorted(objective.items())},
  }
  lora = _lora_section(cfg.lora.to_dict())
  if lora is not None:
    record.update(lora=lora, base=base_fingerprint(cfg))
  return record


def legacy_record(saved_config: dict) -> dict:
  """The part of a record that a checkpoint saved before records existed still tells (its config)."""
  algorithm = saved_config.get("algorithm")
  model = saved_config.get("model", {})
  record = {
      "algorithm": algorithm,
      "model": {k: model.get(k) for k in ("preset", "hf_path", "vocab_size")},
      "tokenizer": {"name": saved_config.get("tokenizer") or model.get("hf_path")},
      "objective": {f"{algorithm}.{k}": v for k, v in sorted(saved_config.get(algorithm, {}).items())},
  }
  lora = _lora_section(saved_config.get("lora", {}))
  return {**record, "lora": lora} if lora is not None else record


def legacy_record_of(cfg: ml_collections.ConfigDict) -> dict:
  return legacy_record(json.loads(cfg.to_json_best_effort()))


def with_moved_settings(saved: dict, saved_config: dict) -> dict:
  """`saved` (a record) with the objective fields its algorithm has since moved into its own block
  (`Algorithm.moved_settings`) read from where its saved config held them."""
  algorithm = saved.get("algorithm")
  if not algorithms.is_registered(algorithm):
    return saved
  old_values = flatten(saved_config)
  moved = {new: old_values[old] for new, old in algorithms.get(algorithm).moved_settings.items()
           if new not in saved.get("objective", {}) and old in old_values}
  return {**saved, "objective": dict(sorted({**saved.get("objective", {}), **moved}.items()))} if moved else saved


def differences(saved: dict, current: dict) -> dict[str, list[str]]:
  """{section: ["field: saved -> current", ...]} for each record section that differs."""
  out = {}
  for section in SECTIONS:
    old, new = saved.get(section), current.get(section)
    if (old == new or section == "objective" and "algorithm" in out  # another algorithm has other settings
        or section == "base" and ("lora" in out or "model" in out)):  # the adapters or shapes differ already
      continue
    if section == "lora" and not (old and new):  # LoRA on one side only: its rank says it
      old, new = {"rank": (old or {}).get("rank", 0)}, {"rank": (new or {}).get("rank", 0)}
    if isinstance(old, dict) and isinstance(new, dict):
      keys = sorted(set(old) | set(new))
      out[section] = [f"{k if section == 'objective' else f'{section}.{k}'}: {old.get(k)!r} -> {new.get(k)!r}"
                      for k in keys if old.get(k) != new.get(k)]
    else:
      out[section] = [f"{section}: {old!r} -> {new!r}"]
  return out


def refusal(step: int, directory: str, diffs: dict[str, list[str]], allowed: tuple[str, ...]) -> str | None:
  """The one-line refusal for the differences not allowed, or None when the resume may go on."""
  blocking = {k: v for k, v in diffs.items() if k not in allowed}
  if not blocking:
    return None
  changes = "; ".join(line for lines in blocking.values() for line in lines)
  allowable = [k for k in blocking if k in ALLOWABLE]
  if "model" in blocking or "lora" in blocking:
    what = "the parameters cannot be restored into another shape" if "model" in blocking else (
        "adapters are resumed with the settings they were trained with")
    fix = f"{what}: use another --workdir, or --config.checkpoint.restore=never to start from scratch here"
  elif "base" in blocking:
    fix = ("its adapters were trained on another base model: set model.hf_path (or the seed of a random init) to "
           "that base, use another --workdir, or --config.checkpoint.restore=never to start from scratch here")
  else:
    fix = (f"use another --workdir, or --config.checkpoint.allow_changes={','.join(allowable)} to resume this "
           "state anyway")
  return f"{directory}: checkpoint step {step} was trained with another {'/'.join(blocking)} ({changes}); {fix}"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
  return out


def other_changes(saved_config: dict, cfg: ml_collections.ConfigDict, skip: tuple[str, ...]) -> list[str]:
  """Config fields changed since the checkpoint, beyond the record's and those in `skip`: "field: old -> new"."""
  old, new = flatten(saved_config), flatten(json.loads(cfg.to_json_best_effort()))
  prefixes = tuple(f"{s}." for s in skip)
  return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
          if old.get(k) != new.get(k) and k not in skip and not k.startswith(prefixes)
          and k not in EXPECTED_CHANGES]


def changed_data_fields(saved: dict, cfg: ml_collections.ConfigDict,
                        fields: tuple[str, ...] = DATA_ORDER_FIELDS) -> dict[str, tuple[Any, Any]]:
  """{field: (saved value, current value)} for the `fields` (default: the data order's) that differ from a
  checkpoint's config; a field the checkpoint's config lacks (an older version's) is not compared."""
  changed = {}
  for field in fields:
    old, new = saved, cfg
    for part in field.split("."):
      old = old.get(part) if isinstance(old, dict) else None
      new = new.get(part) if new is not None else None
    if old is not None and old != new:
      changed[field] = (old, new)
  return changed


def config_differences(saved_config: dict, cfg: ml_collections.ConfigDict) -> dict[str, list[str]]:
  """{"data" | "rollout": ["field: saved -> current", ...]} for the CONFIG_SECTIONS fields that changed."""
  out = {}
  for section, fields in CONFIG_SECTIONS.items():
    changed = changed_data_fields(saved_config, cfg, fields)
    if changed:
      out[section] = [f"{field}: {old!r} -> {new!r}" for field, (old, new) in changed.items()]
  return out


def check(step: int, where: str, saved_config: dict, saved_record: dict | None, record: dict,
          cfg: ml_collections.ConfigDict) -> None:
  """Refuses (CheckpointMismatch) checkpoint `step` in `where` when its state means something else under `cfg`
  (whose record is `record`), or when the data or the rollout programs changed (`CONFIG_SECTIONS`), unless
  checkpoint.allow_changes names the section; warns about the other config fields that changed."""
  if saved_record is None:
    logging.warning("%s: checkpoint step %d predates resume records: only its saved config is compared", where,
                    step)
    saved, current = legacy_record(saved_config), legacy_record_of(cfg)
  else:
    saved, current = saved_record, record
  saved = with_moved_settings(saved, saved_config)
  allowed = tuple(filter(None, (s.strip() for s in cfg.checkpoint.allow_changes.split(","))))
  diffs = {**differences(saved, current), **config_differences(saved_config, cfg)}
  refused = refusal(step, where, diffs, allowed)
  if refused:
    raise CheckpointMismatch(refused)
  for section in diffs:
    logging.warning("resuming step %d with another %s, as checkpoint.allow_changes permits: %s", step, section,
                    "; ".join(diffs[section]))
  # Every algorithm's block: the record compares the configured one's; another's means nothing to this run.
  others = other_changes(saved_config, cfg, ("algorithm", "tokenizer", *algorithms.names(),
                                            *(f for fields in CONFIG_SECTIONS.values() for f in fields)))
  if others:
    logging.warning("config changed since checkpoint step %d: %s", step, "; ".join(others))
  for field, (old, new) in changed_data_fields(saved_config, cfg).items():
    logging.warning("config.%s changed since the checkpoint (%r -> %r): the restored data position refers "
                    "to the old prompt order", field, old, new)
