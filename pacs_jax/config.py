"""The documented default training config (one place per field) and its validation.

Config files under `configs/` start from `default_config()` and override what differs. `validate`
runs before anything is compiled and names the offending field in its message.
"""

from __future__ import annotations

import math
import os

import ml_collections

from pacs_jax import paths
from pacs_jax.algos import registry as algo_registry
from pacs_jax.data import prompts

ALGORITHMS = ("pacs", "grpo", "ppo")
DTYPE_NAMES = ("float32", "bfloat16")  # model.dtype, model.param_dtype, evaluate --dtype, export --dtype
LR_SCHEDULES = ("constant", "cosine")
RESTORE_MODES = ("latest", "never")
REFERENCE_POLICIES = ("frozen", "rollout")
REWARD_METHODS = ("1", "2")


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.algorithm = "pacs"  # pacs | grpo | ppo: the objective on the same loop
  c.steps = 300  # training steps (one rollout batch each)

  # Model: a preset (random init; "tiny" for tests and the CPU demo) or a Hugging Face checkpoint dir.
  c.model = ml_collections.ConfigDict()
  c.model.preset = "tiny"  # used when hf_path is empty
  c.model.hf_path = ""  # a local transformers checkpoint directory (Qwen2.5, Qwen3, Llama 3: models/registry.py)
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"  # compute dtype; bfloat16 on GPU/TPU
  c.model.remat = False  # rematerialise decoder layers in the backward pass
  c.model.attention_chunk = 0  # >0: attention over blocks of this many queries (memory of long sequences)
  # Training / log-prob attention: "auto" (TPU: splash, GPU: cudnn, else xla) | "xla" | "splash" | "cudnn".
  c.model.attention_impl = "auto"
  c.model.remat_policy = "nothing"  # with remat: "nothing" (keep layer inputs) | "matmuls" (no matmul re-run)
  c.model.vocab_size = 0  # >0 overrides the preset's vocab (the synthetic task's tokenizer is small)

  # Tokenizer: "synthetic" (built in, for the synthetic task) or a path (defaults to model.hf_path).
  c.tokenizer = ""

  c.data = ml_collections.ConfigDict()
  c.data.train = "synthetic/mod3"  # synthetic/<task> | comma-separated .json/.jsonl/.parquet files, hf://owner/name
  c.data.val = "synthetic/mod3"  # same forms; "" disables validation
  c.data.synthetic_train_size = 4096
  c.data.synthetic_val_size = 64
  c.data.max_prompt_length = 512  # longer prompts are dropped (counted), never truncated
  # Appended to the problem (after one space) in the user message; "" for none (synthetic tasks).
  c.data.instruction = prompts.MATH_INSTRUCTION
  c.data.skip_bad_rows = False
  c.data.val_max_examples = 0  # >0: evaluate on the first N validation problems only
  # A folder of the released evaluation sets (<name>/test.jsonl for gsm8k, math500, aime2024, aime2025,
  # amc23, as in ../shared/data); every file found there is validated on, beside data.val.
  c.data.val_dir = ""

  c.rollout = ml_collections.ConfigDict()
  c.rollout.n = 8  # responses per prompt (group size)
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0  # 0 = off
  c.rollout.max_new_tokens = 4096
  c.rollout.slots = 0  # concurrent decode slots; 0 = the whole rollout batch
  c.rollout.val_max_new_tokens = 0  # 0 = max_new_tokens
  # Decode KV cache: "paged" (pages of page_size rows taken as rows grow, returned when they finish; decode
  # reads each slot's live pages) or "dense" (slots x max length rows, read up to the longest busy row).
  c.rollout.kv_cache = "paged"
  c.rollout.page_size = 64
  c.rollout.kv_pages = 0  # KV memory in pages, all batch shards together; 0 = enough for every slot at full length
  # Which tokens end a response, and how far the response mask runs (docs/algorithm.md "Padding and stopping"):
  #   "released": the tokenizer's EOS plus generation_config.json's eos_token_id (config.json's when there is
  #     none), as verl's vLLM rollout; the mask runs up to and including the first generation-config EOS
  #     (verl's get_response_mask), the rest is padded with the pad token.
  #   "chat": the released set plus Qwen's chat stop tokens <|im_end|> and <|endoftext|>; the mask runs up
  #     to and including the token that stopped the response.
  #   "151643,151645": exactly these ids, as "chat" otherwise.
  c.rollout.stop_tokens = "released"

  c.train = ml_collections.ConfigDict()
  c.train.batch_prompts = 1024  # prompts per step (each sampled rollout.n times)
  c.train.mini_batch_prompts = 256  # one optimizer step per mini-batch of whole groups
  c.train.micro_batch_prompts = 0  # gradient accumulation; 0 = the whole mini-batch at once
  # LM head positions per chunk in the train step and log-prob passes (0 = the whole response at once): the
  # fp32 softmax never exceeds [rows, chunk, V]. Each chunk's logits are recomputed in the backward pass unless
  # keep_logits saves them (16-bit [rows, R, V] per micro-batch: no head matmul re-run; the v5p configs).
  c.train.logits_chunk = 128
  c.train.keep_logits = False
  c.train.lr = 1e-6
  c.train.schedule = "constant"  # constant | cosine (linear warmup, then cosine decay to lr * min_lr_ratio)
  c.train.warmup_steps = 0  # optimizer updates
  c.train.min_lr_ratio = 0.0
  c.train.weight_decay = 0.01
  c.train.b1 = 0.9
  c.train.b2 = 0.999
  c.train.eps = 1e-8
  c.train.grad_clip = 1.0  # global-norm clip; 0 = off (the released PACS actor never clips; GRPO/PPO clip at 1)
  # verl's ppo_micro_batch_size_per_gpu of the released runs (actor and critic). Numerics only, not memory
  # (that is micro_batch_prompts): under "seq-mean-token-sum-norm" the released GRPO/PPO losses sum this many
  # rows per micro-batch and average the micro-batches, so their gradient is this many times the per-sequence
  # mean (before the clip); pacs.exact_padding_replication packs rows in groups of this many.
  c.train.verl_micro_batch_rows = 8

  # PACS (docs/algorithm.md): r̂ from log-prob ratios, ψ = advantage of r̂ in the group, BCE(ψ, R) with weights.
  c.pacs = ml_collections.ConfigDict()
  c.pacs.beta = 1.0
  c.pacs.reward_method = "1"  # "1": β Σ (log π − log π_ref); "2": β Σ log π / |o|
  c.pacs.adv_estimator = "rloo"  # rloo | grpo | naive
  c.pacs.norm_adv_by_std = True  # grpo estimator only
  c.pacs.use_weight = True
  c.pacs.weight_mode = "question"  # question | only_positive | only_negative
  c.pacs.reference_policy = "frozen"  # frozen (initial model) | rollout (the sampling policy, as released)
  # Off: r̂ sums the masked response tokens (docs/algorithm.md). On: it also sums the term verl's remove-padding forward
  # leaves at the first padding position of a response that ended early: the log-prob of the next packed row's
  # first token given this row (rows packed in groups of train.verl_micro_batch_rows; the last wraps to the first).
  c.pacs.exact_padding_replication = False

  c.grpo = ml_collections.ConfigDict()
  c.grpo.clip_ratio_low = 0.2
  c.grpo.clip_ratio_high = 0.2
  c.grpo.clip_ratio_c = 3.0  # dual clip for negative advantages
  c.grpo.loss_agg_mode = "seq-mean-token-sum-norm"
  c.grpo.norm_adv_by_std = True
  c.grpo.use_kl_loss = False
  c.grpo.kl_coef = 0.001
  c.grpo.entropy_coeff = 0.0

  c.ppo = ml_collections.ConfigDict()
  c.ppo.critic_lr = 1e-5
  c.ppo.cliprange_value = 0.5
  c.ppo.gamma = 1.0
  c.ppo.lam = 1.0

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1  # -1 = the remaining devices
  c.mesh.tensor = 1

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 20  # steps; the last step is always saved
  c.checkpoint.keep = 3  # the newest K checkpoints are kept; 0 = keep every one (the released runs)
  c.checkpoint.async_save = True
  # latest: resume from the newest checkpoint that restores (a damaged newer one is set aside with a
  # warning); exit with an error if checkpoints exist but none restores. never: start from scratch, the
  # existing checkpoints moved to checkpoints_set_aside/.
  c.checkpoint.restore = "latest"
  # A resume refuses a checkpoint trained with another algorithm, tokenizer or objective settings
  # (storage/resume.py); a comma-separated list of those it may change anyway ("algorithm,tokenizer,objective").
  c.checkpoint.allow_changes = ""
  # One trainer per workdir: a lock whose holder runs on another host is taken over after this long
  # without a heartbeat (on the same host: as soon as its process is gone).
  c.checkpoint.lock_stale_after_s = 300.0

  c.eval_every = 5  # validation (greedy, per-source accuracy); 0 = off
  # Per-step JSONL dumps of the generations, as the released trainer.rollout_data_dir / validation_data_dir
  # ("" = off): one line per response {input, output, score, step, data_source, ground_truth}, file <step>.jsonl.
  c.rollout_data_dir = ""
  c.validation_data_dir = ""
  c.log_every = 1
  c.reward_workers = 2
  c.reward_timeout_s = 10.0

  # The target machine: `--compile_only` and `--dry_run` build the mesh and compile for it before any launch.
  c.hardware = ml_collections.ConfigDict()
  # A TPU slice as libtpu names it, "<generation>:<topology>": "v5p:2x4x4" is a v5p-64 (32 chips, 8 hosts),
  # "v5p:4x4x4" a v5p-128 (64 chips, 16 hosts). "" = no TPU target (GPU / CPU configs).
  c.hardware.tpu_topology = ""
  # NVIDIA GPUs to compile for on any machine (jax's CUDA plugin: pip install -e ".[gpu-compile]"): the GPU, one of
  # pacs_jax/gpu_targets ("h100-sxm-80gb"), and "<slices>x<hosts>x<gpus per host>" ("1x1x8": one 8-GPU node).
  # "" = no GPU target (TPU / CPU configs, or --compile_only on the GPU machine itself).
  c.hardware.gpu_target = ""
  c.hardware.gpu_topology = ""
  c.hardware.num_devices = 0  # accelerator chips of the target slice (0 = the devices present)
  c.hardware.hbm_gb = 0.0  # memory per chip, e.g. 95 on TPU v5p, 80 on H100
  c.hardware.num_processes = 0  # JAX processes (hosts) of the target slice, e.g. chips / 4 on v5p (0 = 1)

  # Multi-host: empty = auto-detect on TPU VMs (or single process elsewhere).
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""
  c.distributed.num_processes = 0
  c.distributed.process_id = -1
  return c


class ConfigError(ValueError):
  """A config field has a bad value; the message names the field."""


def _check(ok: bool, field: str, msg: str):
  if not ok:
    raise ConfigError(f"config.{field}: {msg}")


def _check_enum(value, choices: tuple, field: str) -> None:
  _check(value in choices, field, f"{' | '.join(choices)}, got {value!r}")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, num_processes: int = 1,
             devices=None, check_paths: bool = True) -> None:
  """Checks a config before anything is built; raises ConfigError naming the field.

  With `devices` (real ones, or a TPU topology's abstract ones) the mesh is also laid out on them.
  `check_paths=False` (--dry_run, --compile_only: nothing is loaded) skips checking that local paths exist.
  """
  from pacs_jax import sharding
  from pacs_jax.algos import grpo, pacs  # the enum lists of their options
  if devices is not None:
    num_devices = len(devices)
  _check(algo_registry.is_registered(c.algorithm), "algorithm",
         f"must be one of {algo_registry.names()}, got {c.algorithm!r}")
  algo = algo_registry.get(c.algorithm)
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
  _check_sampling(c)
  p = c.pacs
  _check(p.reward_method in REWARD_METHODS, "pacs.reward_method", f'"1" | "2", got {p.reward_method!r}')
  _check_enum(p.adv_estimator, pacs.ADV_ESTIMATORS, "pacs.adv_estimator")
  _check_enum(p.weight_mode, pacs.WEIGHT_MODES, "pacs.weight_mode")
  _check_enum(p.reference_policy, REFERENCE_POLICIES, "pacs.reference_policy")
  algo.validate(c, _check, num_processes)
  _check(c.grpo.loss_agg_mode in grpo.LOSS_AGG_MODES, "grpo.loss_agg_mode", f"unknown mode {c.grpo.loss_agg_mode!r}")
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
  allowable = ("algorithm", "tokenizer", "objective")  # (storage/resume.py ALLOWABLE; storage is a layer above)
  unknown = [s for s in c.checkpoint.allow_changes.split(",") if s.strip() and s.strip() not in allowable]
  _check(not unknown, "checkpoint.allow_changes", f"{unknown} are not among {allowable} (comma-separated)")
  _check(c.checkpoint.lock_stale_after_s > 0, "checkpoint.lock_stale_after_s", "must be positive (seconds)")
  _check(c.log_every >= 1, "log_every", f"must be >= 1 (the last step is always logged), got {c.log_every}")
  _check(c.eval_every >= 0, "eval_every", f"must be >= 0 (0 = no validation), got {c.eval_every}")
  _check(c.rollout.slots >= 0, "rollout.slots", f"must be >= 0 (0 = the whole rollout batch), got {c.rollout.slots}")
  _check(c.rollout.val_max_new_tokens >= 0, "rollout.val_max_new_tokens",
         f"must be >= 0 (0 = max_new_tokens), got {c.rollout.val_max_new_tokens}")
  _check_enum(c.rollout.kv_cache, ("paged", "dense"), "rollout.kv_cache")
  _check(c.rollout.page_size >= 1, "rollout.page_size", f"must be >= 1, got {c.rollout.page_size}")
  _check(c.rollout.kv_pages >= 0, "rollout.kv_pages", f"must be >= 0 (0 = enough for every slot), got {c.rollout.kv_pages}")
  _check(c.data.val_max_examples >= 0, "data.val_max_examples", f"must be >= 0 (0 = all), got {c.data.val_max_examples}")
  _check(c.data.synthetic_train_size > 0, "data.synthetic_train_size", "must be positive")
  _check(c.data.synthetic_val_size > 0, "data.synthetic_val_size", "must be positive")
  _check(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
  _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
  _check(math.isfinite(p.beta), "pacs.beta", f"must be finite, got {p.beta}")
  for field in ("model.hf_path", "tokenizer"):
    spec = c.model.hf_path if field == "model.hf_path" else c.tokenizer
    if check_paths and spec and spec != "synthetic" and paths.looks_local(spec) and not os.path.isdir(spec):
      _check(False, field, f"{spec!r} is not a directory (relative to {os.getcwd()}); give a local Hugging Face "
                           "model directory or a hub id such as Qwen/Qwen2.5-3B")
  sizes = {"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": c.mesh.tensor}
  for axis, size in sizes.items():
    _check(size == -1 or size >= 1, f"mesh.{axis}", f"must be >= 1 or -1, got {size}")
  _check(sum(v == -1 for v in sizes.values()) <= 1, "mesh", "at most one of data/fsdp/tensor may be -1")
  if num_devices is not None:
    field = next((f"mesh.{a}" for a, v in sizes.items() if v != -1 and v > 1), "mesh")
    try:
      resolved = sharding.mesh_sizes(**sizes, num_devices=num_devices)
    except ValueError as e:
      raise ConfigError(f"config.{field}: {e}") from None
    batch_shards = resolved["data"] * resolved["fsdp"]
    micro_rows = micro * c.rollout.n
    _check(micro_rows % batch_shards == 0, "train.micro_batch_prompts",
           f"micro-batch rows ({micro} prompts x n={c.rollout.n} = {micro_rows}) must be divisible by data*fsdp = {batch_shards}")
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


def _check_sampling(c: ml_collections.ConfigDict) -> None:
  """The fields training and evaluation share: sampling, lengths, dtype, seed, reward workers."""
  from pacs_jax.models import hf
  _check(0 < c.rollout.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {c.rollout.top_p}")
  _check(c.rollout.max_new_tokens > 0, "rollout.max_new_tokens", "must be positive")
  _check(c.rollout.top_k >= 0, "rollout.top_k", f"must be >= 0 (0 = off), got {c.rollout.top_k}")
  _check(hf.parse_stop_tokens(c.rollout.stop_tokens) is not None, "rollout.stop_tokens",
         f'"released" | "chat" | comma-separated token ids, got {c.rollout.stop_tokens!r}')
  _check_enum(c.model.dtype, DTYPE_NAMES, "model.dtype")
  _check(c.data.max_prompt_length > 0, "data.max_prompt_length", "must be positive")
  _check(isinstance(c.seed, int) and 0 <= c.seed < 2**31, "seed", f"must be an integer in [0, 2**31), got {c.seed!r}")
  _check(c.reward_workers >= 1, "reward_workers", f"must be >= 1 (math-verify worker processes), got {c.reward_workers}")
  _check(c.reward_timeout_s > 0, "reward_timeout_s", f"must be positive (seconds), got {c.reward_timeout_s}")


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
  if c.model.hf_path:
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
  """Checks evaluation's config (`eval.settings.eval_config()`, the training config's field names for what the two
  share); raises ConfigError naming the field."""
  _check(c.rollout.n >= 1, "rollout.n", f"must be >= 1, got {c.rollout.n}")
  _check(c.rollout.temperature >= 0, "rollout.temperature", f"must be >= 0 (0 = greedy), got {c.rollout.temperature}")
  _check(c.rollout.slots >= 1, "rollout.slots", f"must be >= 1, got {c.rollout.slots}")
  _check(c.mesh.tensor >= 1, "mesh.tensor", f"must be >= 1, got {c.mesh.tensor}")
  _check_sampling(c)


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


# ----------------------------------------------------------------------------------------------
# Run config -> model config


def dtype(name: str):
  """A dtype name of the config (one of DTYPE_NAMES) -> the jnp scalar type."""
  import jax.numpy as jnp  # jax only when a model is built
  if name not in DTYPE_NAMES:
    raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
  return getattr(jnp, name)


def model_overrides(c: ml_collections.ConfigDict) -> dict:
  """The `ModelConfig` fields a run config sets on top of a preset or a checkpoint's config.json."""
  return dict(param_dtype=dtype(c.model.param_dtype), dtype=dtype(c.model.dtype), remat=c.model.remat,
              attention_chunk=c.model.attention_chunk, attention_impl=c.model.attention_impl,
              remat_policy=c.model.remat_policy)


def preset_model_config(c: ml_collections.ConfigDict):
  """The policy's `ModelConfig` from `model.preset` alone (shapes for dry runs; never reads a checkpoint)."""
  from pacs_jax.models import registry as model_registry
  overrides = model_overrides(c)
  if c.model.vocab_size:
    overrides["vocab_size"] = c.model.vocab_size
  return model_registry.preset(c.model.preset, **overrides)


def model_config(c: ml_collections.ConfigDict):
  """The policy's `ModelConfig`: `model.hf_path`'s config.json when set, else the preset's."""
  from pacs_jax.models import hf
  if c.model.hf_path:
    try:
      return hf.load_config(c.model.hf_path, **model_overrides(c))
    except ValueError as e:  # a model_type no family reads, or a part of the family its model lacks
      raise ConfigError(f"config.model.hf_path: {e}") from None
  return preset_model_config(c)
