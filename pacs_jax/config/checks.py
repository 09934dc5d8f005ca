"""Validation of a run config: `validate` runs before anything is compiled and names the offending field in its
message (ConfigError); `validate_eval` checks evaluation's config, `advisories` warns about likely mistakes."""

from __future__ import annotations

import math

import os

import ml_collections

from pacs_jax import paths
from pacs_jax.algos import algorithms, correction
from pacs_jax.config import env_checks
from pacs_jax.config.defaults import default_config
from pacs_jax.config.files import get_field
from pacs_jax.data import prompts
from pacs_jax.rewards import named as reward_named

DTYPE_NAMES = ("float32", "bfloat16")  # model.dtype, model.param_dtype, evaluate --dtype, export --dtype
LR_SCHEDULES = ("constant", "cosine")
RESTORE_MODES = ("latest", "never")
ROLLOUT_MODES = ("sync", "one_step_off", "async")  # rollout.mode
# The checkpoint record's sections a resume may be allowed to change (`checkpoint.allow_changes`; the record is
# storage/resume.py's); the model's shape never can.
ALLOWABLE = ("algorithm", "tokenizer", "objective", "data", "rollout")


# Fields that were removed, and why: a config (file, override) that still sets one fails naming it.
REMOVED_FIELDS = {
    "rollout.kv_cache": "the rollout always uses the paged KV cache (rollout.page_size and rollout.kv_pages size "
                        "it); delete the setting",
}


class ConfigError(ValueError):
  """A config field has a bad value; the message names the field."""


def _check(ok: bool, field: str, msg: str):
  if not ok:
    raise ConfigError(f"config.{field}: {msg}")


def _corrected() -> list[str]:
  """The objectives that apply the rollout correction."""
  return [n for n in algorithms.names() if algorithms.get(n).supports_rollout_correction]


def _check_enum(value, choices: tuple, field: str) -> None:
  algorithms.check_choice(_check, value, choices, field)


WANDB_MODES = ("online", "offline", "disabled")


def _check_wandb(c: ml_collections.ConfigDict) -> None:
  if "wandb" not in c or not c.wandb.enabled:
    return
  import importlib.util
  _check(importlib.util.find_spec("wandb") is not None, "wandb.enabled", "wandb is not installed (pip install wandb)")
  _check_enum(c.wandb.mode, WANDB_MODES, "wandb.mode")
  _check(bool(c.wandb.project), "wandb.project", "must name a project")
  _check(c.wandb.init_timeout_s > 0, "wandb.init_timeout_s", f"must be positive (seconds), got {c.wandb.init_timeout_s}")


def _check_moved_settings(c: ml_collections.ConfigDict, algo: algorithms.Algorithm) -> None:
  """Refuses a setting the algorithm now reads from its own block that is still set only where older configs held
  it (it would be ignored silently)."""
  defaults = default_config()
  for new, old in algo.moved_settings.items():
    if get_field(c, old) != get_field(defaults, old) and get_field(c, new) == get_field(defaults, new):
      _check(False, old, f"{c.algorithm} reads {new} now, not {old}: set {new} = {get_field(c, old)!r}")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, num_processes: int = 1,
             devices=None, check_paths: bool = True) -> None:
  """Checks a config before anything is built; raises ConfigError naming the field.

  With `devices` (real ones, or a TPU topology's abstract ones) the mesh is also laid out on them.
  `check_paths=False` (--dry_run, --compile_only: nothing is loaded) skips checking that local paths exist.
  """
  from pacs_jax import sharding
  from pacs_jax.rollout import placement
  if devices is not None:
    num_devices = len(devices)
  _check(algorithms.is_registered(c.algorithm), "algorithm",
         f"must be one of {algorithms.names()}, got {c.algorithm!r}")
  algo = algorithms.get(c.algorithm)
  _check(c.steps > 0, "steps", f"must be positive, got {c.steps}")
  _check(c.rollout.n >= 1, "rollout.n", f"must be >= 1, got {c.rollout.n}")
  if c.rollout.n < algo.min_group_size:
    _check(False, "rollout.n", f"{c.algorithm} compares responses within a group and needs n >= {algo.min_group_size}")
  _check(c.rollout.temperature > 0, "rollout.temperature", "must be > 0 (greedy is used for validation only)")
  t = c.train
  _check(t.batch_prompts > 0, "train.batch_prompts", "must be positive")
  _check(t.mini_batch_prompts > 0 and t.batch_prompts % t.mini_batch_prompts == 0, "train.mini_batch_prompts",
         f"must divide train.batch_prompts={t.batch_prompts} (mini-batches hold whole groups), got {t.mini_batch_prompts}")
  micro = t.micro_batch_prompts or t.mini_batch_prompts
  _check(t.mini_batch_prompts % micro == 0, "train.micro_batch_prompts",
         f"must divide train.mini_batch_prompts={t.mini_batch_prompts} (micro-batches hold whole groups), got {micro}")
  _check(t.logits_chunk >= 0, "train.logits_chunk", f"must be >= 0 (0 = the whole response), got {t.logits_chunk}")
  _check(t.lr > 0, "train.lr", "must be positive")
  _check_enum(t.schedule, LR_SCHEDULES, "train.schedule")
  _check(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 = no clipping), got {t.grad_clip}")
  _check(t.verl_micro_batch_rows >= 1, "train.verl_micro_batch_rows", f"must be >= 1, got {t.verl_micro_batch_rows}")
  longest = c.data.max_prompt_length + c.rollout.max_new_tokens
  _check(t.packing_row_tokens == 0 or t.packing_row_tokens >= longest, "train.packing_row_tokens",
         f"must be 0 (P + R) or hold the longest sequence (max_prompt_length + max_new_tokens = {longest}), got "
         f"{t.packing_row_tokens}")
  _check(t.packing_rungs >= 1, "train.packing_rungs", f"must be >= 1, got {t.packing_rungs}")
  micro_rows = (t.micro_batch_prompts or t.mini_batch_prompts) * c.rollout.n
  _check(t.packing_rows == 0 or t.packing_rows >= micro_rows, "train.packing_rows",
         f"must be 0 (a micro-batch's {micro_rows} rows) or at least that many (every sequence may need a row of its "
         f"own), got {t.packing_rows}")
  _check_sampling(c)
  algo.validate_settings(c, _check)  # the configured algorithm's own block; another's is never read
  algo.validate(c, _check, num_processes)
  _check_moved_settings(c, algo)
  _check(c.model.hf_path or c.model.preset, "model.hf_path",
         "set it to your model's directory (or a hub id such as Qwen/Qwen2.5-0.5B), or set model.preset")
  _check(bool(c.data.train.strip(", ")), "data.train",
         "set it to your problems: .jsonl/.json/.parquet files of {\"problem\", \"answer\"} rows, hf://owner/name, "
         "or synthetic/<task>")
  _check_enum(c.model.param_dtype, DTYPE_NAMES, "model.param_dtype")
  _check(c.model.attention_chunk >= 0, "model.attention_chunk", "must be >= 0 (0 = all queries at once)")
  from pacs_jax.models import flash, layers
  _check_enum(c.model.attention_impl, flash.IMPLS, "model.attention_impl")
  _check_enum(c.model.remat_policy, layers.REMAT_POLICIES, "model.remat_policy")
  _check(c.checkpoint.every > 0, "checkpoint.every", "must be positive")
  _check(c.checkpoint.keep >= 0, "checkpoint.keep", "must be >= 0 (0 = keep every checkpoint)")
  _check_enum(c.checkpoint.restore, RESTORE_MODES, "checkpoint.restore")
  unknown = [s for s in c.checkpoint.allow_changes.split(",") if s.strip() and s.strip() not in ALLOWABLE]
  _check(not unknown, "checkpoint.allow_changes", f"{unknown} are not among {ALLOWABLE} (comma-separated)")
  _check(c.checkpoint.lock_stale_after_s > 0, "checkpoint.lock_stale_after_s", "must be positive (seconds)")
  _check(isinstance(c.health.patience, int) and c.health.patience >= 0, "health.patience",
         f"must be an integer >= 0 (steps; 0 = no dead-run check), got {c.health.patience!r}")
  _check(c.health.entropy_tolerance >= 0, "health.entropy_tolerance",
         f"must be >= 0 (nats), got {c.health.entropy_tolerance}")
  _check(c.health.max_param_growth == 0 or c.health.max_param_growth > 1, "health.max_param_growth",
         f"must be > 1 (times the starting norm; 0 = off), got {c.health.max_param_growth}")
  _check(c.health.max_update_ratio >= 0, "health.max_update_ratio",
         f"must be >= 0 (times the parameter norm; 0 = off), got {c.health.max_update_ratio}")
  _check(c.log_every >= 1, "log_every", f"must be >= 1 (the last step is always logged), got {c.log_every}")
  _check(c.eval_every >= 0, "eval_every", f"must be >= 0 (0 = no validation), got {c.eval_every}")
  _check(c.rollout.slots >= 0, "rollout.slots", f"must be >= 0 (0 = the whole rollout batch), got {c.rollout.slots}")
  _check(c.rollout.val_max_new_tokens >= 0, "rollout.val_max_new_tokens",
         f"must be >= 0 (0 = max_new_tokens), got {c.rollout.val_max_new_tokens}")
  for field, why in REMOVED_FIELDS.items():
    section, _, name = field.rpartition(".")
    _check(name not in (get_field(c, section) if section else c), field, f"was removed: {why}")
  _check(c.rollout.page_size >= 1, "rollout.page_size", f"must be >= 1, got {c.rollout.page_size}")
  _check(c.rollout.tis_imp_ratio_cap <= 0 or algo.supports_rollout_correction, "rollout.tis_imp_ratio_cap",
         f"the rollout correction is for {', '.join(_corrected())}, not {c.algorithm!r}: set it <= 0 (off)")
  _check_enum(c.rollout.tis_level, ("",) + correction.LEVELS, "rollout.tis_level")
  _check_enum(c.rollout.mode, ROLLOUT_MODES, "rollout.mode")
  from pacs_jax.rollout import interface as rollout_interface
  why = rollout_interface.engine_problem(c.rollout.engine)
  _check(why is None, "rollout.engine", why)
  if c.rollout.mode == "one_step_off":
    _check(c.rollout.max_staleness in (0, 1), "rollout.max_staleness",
           f"one_step_off runs one rollout ahead: 0 or 1, got {c.rollout.max_staleness!r} (async takes more)")
  _check(isinstance(c.rollout.max_staleness, int) and c.rollout.max_staleness >= 0, "rollout.max_staleness",
         f"must be an integer >= 0 (policy versions), got {c.rollout.max_staleness!r}")
  if c.rollout.mode != "sync":
    _check(algo.sampling_rounds(algo.bind(c)) == 1, "rollout.mode",
           f"{c.rollout.mode} needs one rollout per step; {c.algorithm} samples dynamically (its refills draw prompts)")

  env_checks.validate_env(c, _check, num_processes, lambda: algo.sampling_rounds(algo.bind(c)))
  _check(c.rollout.slot_rungs >= 1, "rollout.slot_rungs", f"must be >= 1 (1 = no ladder), got {c.rollout.slot_rungs}")
  _check(c.rollout.kv_pages >= 0, "rollout.kv_pages", f"must be >= 0 (0 = enough for every slot), got {c.rollout.kv_pages}")
  _check_lora(c)
  if not c.model.hf_path and c.lora.rank:  # the preset's shapes are known without reading anything
    from pacs_jax.models import families
    _check(c.model.preset in families.preset_names(), "model.preset",
           f"one of {sorted(families.preset_names())}, got {c.model.preset!r}")
    check_lora_fits_model(c, families.preset(c.model.preset))
  _check_wandb(c)
  _check(c.data.val_max_examples >= 0, "data.val_max_examples", f"must be >= 0 (0 = all), got {c.data.val_max_examples}")
  _check(c.data.synthetic_train_size > 0, "data.synthetic_train_size", "must be positive")
  _check(c.data.synthetic_val_size > 0, "data.synthetic_val_size", "must be positive")
  _check(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
  _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
  for field in ("model.hf_path", "tokenizer"):
    spec = c.model.hf_path if field == "model.hf_path" else c.tokenizer
    built_in = spec in ("synthetic", "synthetic_tools")
    if check_paths and spec and not built_in and paths.looks_local(spec) and not os.path.isdir(spec):
      _check(False, field, f"{spec!r} is not a directory (relative to {os.getcwd()}); give a local Hugging Face "
                           "model directory or a hub id such as Qwen/Qwen2.5-3B")
  num_devices, devices = _trainer_share(c, num_devices, devices, num_processes)
  sizes = {"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": c.mesh.tensor}
  for axis, size in sizes.items():
    _check(size == -1 or size >= 1, f"mesh.{axis}", f"must be >= 1 or -1, got {size}")
  _check(sum(v == -1 for v in sizes.values()) <= 1, "mesh", "at most one of data/fsdp/tensor may be -1")
  if num_devices is not None:
    field = next((f"mesh.{a}" for a, v in sizes.items() if v != -1 and v > 1), "mesh")
    try:
      resolved = sharding.mesh_sizes(**sizes, num_devices=num_devices)
    except ValueError as e:
      split = "" if not c.rollout.devices else (
          f": rollout.devices={c.rollout.devices} leaves the trainer {num_devices} devices; set "
          f"--config.mesh.fsdp=-1 (the rest) or mesh sizes whose product is {num_devices}")
      raise ConfigError(f"config.{field}: {e}{split}") from None
    why = placement.check(c.rollout.devices, None, resolved["tensor"], num_processes)
    _check(why is None, "rollout.devices", why)
    batch_shards = resolved["data"] * resolved["fsdp"]
    micro_rows = micro * c.rollout.n
    _check(micro_rows % batch_shards == 0, "train.micro_batch_prompts",
           f"micro-batch rows ({micro} prompts x n={c.rollout.n} = {micro_rows}) must be divisible by data*fsdp = {batch_shards}")
    shards = math.lcm(batch_shards, num_processes)  # the packed rows' quantum (`programs.batch_layout`)
    _check(not t.packing or t.packing_rows % shards == 0, "train.packing_rows",
           f"packed rows are split over data*fsdp = {batch_shards} devices and {num_processes} processes: must be a "
           f"multiple of {shards}, got {t.packing_rows}")
  _check_topology(c)
  if devices is not None:
    check_mesh_layout(c, devices)
  _check(t.batch_prompts % num_processes == 0, "train.batch_prompts",
         f"must be divisible by the {num_processes} processes (each feeds an equal share)")
  # Each process contributes its own rows to every micro-batch (and so to every mini-batch); with fewer
  # prompts than processes per micro-batch a prompt's group would be cut across processes and the
  # loss would compare responses of different prompts.
  _check(micro % num_processes == 0, "train.micro_batch_prompts",
         f"micro-batch prompts ({micro}) must be divisible by the {num_processes} processes, so that each "
         "process feeds whole groups to every micro-batch")


def _trainer_share(c: ml_collections.ConfigDict, num_devices, devices, num_processes: int):
  """(num_devices, devices) the trainer's mesh is laid out on: all but the last `rollout.devices`."""
  from pacs_jax.rollout import placement
  why = placement.check(c.rollout.devices, num_devices, None, num_processes)
  _check(why is None, "rollout.devices", why)
  if not c.rollout.devices or num_devices is None:
    return num_devices, devices
  if devices is None:
    return num_devices - c.rollout.devices, None
  trainer_devices, rollout_devices = placement.split_devices(devices, c.rollout.devices)
  why = placement.process_layout(trainer_devices, rollout_devices)
  _check(why is None, "rollout.devices", why)
  return num_devices - c.rollout.devices, trainer_devices


def _check_sampling(c: ml_collections.ConfigDict) -> None:
  """The fields training and evaluation share: sampling, lengths, dtype, seed, the reward and its workers."""
  from pacs_jax.rollout import stop_tokens
  _check(0 < c.rollout.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {c.rollout.top_p}")
  _check(c.rollout.max_new_tokens > 0, "rollout.max_new_tokens", "must be positive")
  _check(c.rollout.top_k >= 0, "rollout.top_k", f"must be >= 0 (0 = off), got {c.rollout.top_k}")
  _check(stop_tokens.parse_stop_tokens(c.rollout.stop_tokens) is not None, "rollout.stop_tokens",
         f'"released" | "chat" | comma-separated token ids, got {c.rollout.stop_tokens!r}')
  _check_enum(c.model.dtype, DTYPE_NAMES, "model.dtype")
  _check(c.data.max_prompt_length > 0, "data.max_prompt_length", "must be positive")
  _check(isinstance(c.seed, int) and 0 <= c.seed < 2**31, "seed", f"must be an integer in [0, 2**31), got {c.seed!r}")
  _check(c.reward_workers >= 1, "reward_workers", f"must be >= 1 (math-verify worker processes), got {c.reward_workers}")
  _check(c.reward_timeout_s > 0, "reward_timeout_s", f"must be positive (seconds), got {c.reward_timeout_s}")
  # The built-in is known to be one (importing it to check would cost math-verify's 0.4 s import in every check).
  why = None if c.reward.fn == reward_named.BUILTIN else reward_named.problem(c.reward.fn)
  _check(why is None, "reward.fn", why)


def lora_spec(c: ml_collections.ConfigDict):
  """The run's `models.lora.LoraSpec`, or None for full fine-tuning (`lora.rank` 0)."""
  if not c.lora.rank:
    return None
  from pacs_jax.models import lora
  targets = tuple(t.strip() for t in c.lora.targets.split(",") if t.strip())
  saved = tuple(m.strip() for m in c.lora.get("modules_to_save", "").split(",") if m.strip())  # older records lack it
  return lora.LoraSpec(rank=c.lora.rank, alpha=c.lora.alpha, targets=targets, use_rslora=c.lora.use_rslora,
                       modules_to_save=saved)


def _check_lora(c: ml_collections.ConfigDict) -> None:
  """The `lora` fields that need no model: rank 0 (off) with another lora field set is refused (that field would
  be ignored). `modules_to_save` is the exception: a full run trains those norms too, so a config may name the norms
  its LoRA runs save (configs/tiny_cpu.py does) and still run full fine-tuning at rank 0."""
  _check(isinstance(c.lora.rank, int) and not isinstance(c.lora.rank, bool) and c.lora.rank >= 0, "lora.rank",
         f"must be a positive integer (0 = off: full fine-tuning), got {c.lora.rank!r}")
  _check(c.lora.lr_multiplier >= 0, "lora.lr_multiplier",
         f"must be positive (or 0: the width rule), got {c.lora.lr_multiplier!r}")
  if not c.lora.rank:
    defaults = default_config().lora
    changed = [k for k in defaults if k not in ("rank", "modules_to_save") and c.lora[k] != defaults[k]]
    _check(not changed, "lora.rank", f"is 0 (LoRA off), but lora.{changed[0] if changed else ''} is set: set "
                                     "lora.rank to the adapters' rank (e.g. 16)")


def check_lora_fits_model(c: ml_collections.ConfigDict, model_config) -> None:
  """Raises ConfigError naming the lora field when the adapters do not fit the run's model (a rank above a
  targeted matrix's smaller side, a target that names no projection)."""
  spec = lora_spec(c)
  if spec is None:
    return
  from pacs_jax.models import lora
  try:
    lora.validate(spec, model_config)
  except ValueError as e:  # "lora.<field>: ..."
    raise ConfigError(f"config.{e}") from None


def check_tokenizer_fits_model(c: ml_collections.ConfigDict, tokenizer_size: int, model_vocab: int) -> None:
  """Raises ConfigError naming config.tokenizer when the tokenizer has ids the model cannot embed, or when a real
  model (model.hf_path) is paired with a tokenizer of a small fraction of its vocabulary (the 64-token synthetic
  one beside a 151,936-token Qwen): the model would read and write words it never learnt."""
  tokenizer = c.tokenizer or c.model.hf_path or "synthetic"
  model = c.model.hf_path or f"preset {c.model.preset}"
  mismatch = tokenizer_size > model_vocab or (c.model.hf_path and 2 * tokenizer_size < model_vocab)
  _check(not mismatch, "tokenizer",
         f"the tokenizer ({tokenizer!r}, {tokenizer_size} tokens) does not fit the model ({model}, vocabulary "
         f"{model_vocab}); set --config.tokenizer='' to use the model's own tokenizer (model.hf_path), or the "
         "directory of the tokenizer it was trained with")


def advisories(c: ml_collections.ConfigDict) -> list[str]:
  """Warnings for a config that runs but is likely not what was meant (a real model on the synthetic task, real
  problems without an instruction)."""
  from pacs_jax.rewards import synthetic as synthetic_verifier
  out = []
  def synthetic_parts(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if synthetic_verifier.is_synthetic(s.strip())]
  if c.model.hf_path and not c.tokenizer.startswith("synthetic"):  # a model made for the task names its tokenizer
    for field in ("data.train", "data.val"):
      if synthetic_parts(get_field(c, field)):
        out.append(f"config.{field}={get_field(c, field)!r} is the built-in synthetic task (a 64-token vocabulary) "
                   f"beside a real model (model.hf_path={c.model.hf_path!r}): set --config.{field} to your own "
                   f"problems{' or to empty for no validation' if field == 'data.val' else ''}")
  real = [s for s in c.data.train.split(",") if s.strip() and not synthetic_verifier.is_synthetic(s.strip())]
  if real and not c.data.instruction:
    out.append("config.data.instruction is empty: the prompts carry the problems alone, without the released "
               f"instruction ({prompts.MATH_INSTRUCTION!r}); math-verify reads the final answer")
  return out


def validate_eval(c: ml_collections.ConfigDict) -> None:
  """Checks evaluation's config (`eval.eval_settings.eval_config()`, the training config's field names for what the two
  share); raises ConfigError naming the field."""
  _check(c.rollout.n >= 1, "rollout.n", f"must be >= 1, got {c.rollout.n}")
  _check(c.rollout.temperature >= 0, "rollout.temperature", f"must be >= 0 (0 = greedy), got {c.rollout.temperature}")
  _check(c.rollout.slots >= 1, "rollout.slots", f"must be >= 1, got {c.rollout.slots}")
  _check(c.mesh.tensor >= 1, "mesh.tensor", f"must be >= 1, got {c.mesh.tensor}")
  _check_sampling(c)
  env_checks.validate_block(c.env, _check)


def _check_topology(c: ml_collections.ConfigDict) -> None:
  """The TPU or GPU target agrees with the chip and host counts the config states."""
  h = c.hardware
  _check(not (h.tpu_topology and h.gpu_target), "hardware.gpu_target",
         f"a config targets a TPU slice or GPUs, not both (hardware.tpu_topology={h.tpu_topology!r})")
  _check_gpu_target(h)
  if not h.tpu_topology:
    return
  from pacs_jax import sharding
  try:
    chips = sharding.topology_chips(h.tpu_topology)
  except ValueError as e:
    raise ConfigError(f"config.hardware.tpu_topology: {e}") from None
  _check(h.num_devices in (0, chips), "hardware.num_devices",
         f"{h.tpu_topology} has {chips} chips, got {h.num_devices}")
  hosts = max(1, chips // sharding.TPU_CHIPS_PER_HOST)
  _check(h.num_processes in (0, hosts), "hardware.num_processes",
         f"{h.tpu_topology} has {hosts} hosts of {sharding.TPU_CHIPS_PER_HOST} chips, got {h.num_processes}")


def _check_gpu_target(h: ml_collections.ConfigDict) -> None:
  from pacs_jax import gpu_targets
  _check(bool(h.gpu_target) == bool(h.gpu_topology), "hardware.gpu_topology" if h.gpu_target else "hardware.gpu_target",
         f"set both hardware.gpu_target and hardware.gpu_topology, or neither (got {h.gpu_target!r}, {h.gpu_topology!r})")
  if not h.gpu_target:
    return
  _check(h.gpu_target in gpu_targets.TARGETS, "hardware.gpu_target",
         f"one of {' | '.join(gpu_targets.TARGETS)}, got {h.gpu_target!r}")
  try:
    gpus, hosts = gpu_targets.topology_gpus(h.gpu_topology), gpu_targets.topology_hosts(h.gpu_topology)
  except ValueError as e:
    raise ConfigError(f"config.hardware.gpu_topology: {e}") from None
  _check(h.num_devices in (0, gpus), "hardware.num_devices", f"{h.gpu_topology} has {gpus} GPUs, got {h.num_devices}")
  _check(h.num_processes in (0, hosts), "hardware.num_processes",
         f"{h.gpu_topology} has {hosts} hosts (one process each), got {h.num_processes}")


def check_mesh_layout(c: ml_collections.ConfigDict, devices) -> None:
  """The mesh (data, fsdp, tensor) can be laid out on `devices`, each host holding whole batch shards."""
  from pacs_jax import sharding
  try:
    sharding.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, devices=devices)
  except ValueError as e:
    topology = c.hardware.tpu_topology or c.hardware.gpu_topology
    where = f" of {topology}" if topology else ""
    raise ConfigError(f"config.mesh.data/fsdp/tensor = {c.mesh.data}/{c.mesh.fsdp}/{c.mesh.tensor}: cannot be laid "
                      f"out on the {len(devices)} devices{where}: {e}") from e
