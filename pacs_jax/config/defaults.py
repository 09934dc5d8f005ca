"""`default_config()`: every field of the training config with its default and its one-line documentation (one
place per field); each algorithm's block comes from its settings class (`algos/settings.py`). Its checks are
`checks.py`'s, which reads the defaults from here (so neither imports the package's `__init__`)."""

from __future__ import annotations

import ml_collections

from pacs_jax.algos import algorithms
from pacs_jax.data import prompts
from pacs_jax.rewards import named as reward_named


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.algorithm = "pacs"  # any registered objective (algos/algorithms.py: pacs, grpo, ppo, ...) on the same loop
  c.steps = 300  # training steps (one rollout batch each)

  # Model: a preset (random init; "tiny" for tests and the CPU demo) or a Hugging Face checkpoint dir.
  c.model = ml_collections.ConfigDict()
  c.model.preset = "tiny"  # used when hf_path is empty
  c.model.hf_path = ""  # a local transformers checkpoint directory (Qwen2.5, Qwen3, Llama 3: models/families.py)
  # A built-in supervised warm-up of the preset before RL (trainer/warm_base.py; "mul53_tools": the tool demo's base),
  # built once into <workdir>/base_model, which the run then loads as its model.hf_path.
  c.model.warmup = ""
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"  # compute dtype; bfloat16 on GPU/TPU
  c.model.remat = False  # rematerialise decoder layers in the backward pass
  c.model.attention_chunk = 0  # >0: attention over blocks of this many queries (memory of long sequences)
  # Training / log-prob attention: "auto" (TPU: splash, GPU: cudnn, else xla) | "xla" | "splash" | "cudnn".
  c.model.attention_impl = "auto"
  c.model.remat_policy = "nothing"  # with remat: "nothing" (keep layer inputs) | "matmuls" (no matmul re-run)
  c.model.vocab_size = 0  # >0 overrides the preset's vocab (the synthetic task's tokenizer is small)

  # Tokenizer: "synthetic" (built in, for the synthetic task), "synthetic_tools" (the same 64 ids and the words of a
  # tool call, for the tool task synthetic/mul53) or a path (defaults to model.hf_path).
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
  # amc23, as in tests/fixtures/data); every file found there is validated on, beside data.val.
  c.data.val_dir = ""

  c.rollout = ml_collections.ConfigDict()
  c.rollout.n = 8  # responses per prompt (group size)
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0  # 0 = off
  c.rollout.max_new_tokens = 4096
  c.rollout.slots = 0  # concurrent decode slots; 0 = the whole rollout batch
  c.rollout.val_max_new_tokens = 0  # 0 = max_new_tokens
  # The decode KV cache is paged: pages of page_size rows, taken as rows grow and returned when they finish;
  # decode reads each slot's live pages.
  # Rollout correction (verl's TIS): each token's policy loss weighted by min(π_old / π_rollout, cap), π_rollout the
  # engine's log-probs as sampled; > 0 turns it on (GRPO, PPO, PACS), <= 0 (the default) leaves the loss as released.
  c.rollout.tis_imp_ratio_cap = -1.0
  # The correction's level: "token" (a weight per token, GRPO's and PPO's default) or "sequence" (a weight per response,
  # the product of its tokens' ratios, PACS's); "" = the objective's own (algos/correction.py).
  c.rollout.tis_level = ""
  # "sync": each step samples, then updates; "one_step_off": the next step's rollout runs on a background thread
  # while this step updates (trainer/overlap.py), its responses up to `max_staleness` (0 or 1) policy versions old;
  # "async": the next `max_staleness` steps' rollouts run ahead (responses older than that are dropped, counted).
  c.rollout.mode = "sync"
  # Which implementation of the rollout interface (rollout/interface.py) samples: "local", the in-process engine, or
  # "package.module:factory", called with the keyword arguments trainer/programs.py's make_rollout gives the local
  # one, returning an `interface.Rollout` (docs/design.md, "Adding a rollout engine").
  c.rollout.engine = "local"
  c.rollout.max_staleness = 1
  # Split devices: > 0 runs the rollout on the last `devices` devices (its own mesh: slots over them, weights split
  # over mesh.tensor as the trainer's) and the trainer on the rest; each weight push is a device-to-device copy,
  # timed and counted (weights/push_*). 0 = shared: the rollout runs on the trainer's mesh. One process only.
  c.rollout.devices = 0
  c.rollout.page_size = 64
  c.rollout.kv_pages = 0  # KV memory in pages, all batch shards together; 0 = enough for every slot at full length
  # The slot ladder (rollout/slot_rungs.py): decode programs over slots, slots/2, ... (this many rungs); once no
  # request waits, the tail's few busy slots decode in the smallest rung that holds them instead of paying every
  # slot's matmuls. 1 = every call over all slots.
  c.rollout.slot_rungs = 1
  # Which tokens end a response, and how far the response mask runs (docs/algorithm.md "Padding and stopping"):
  #   "released": the tokenizer's EOS plus generation_config.json's eos_token_id (config.json's when there is
  #     none), as verl's vLLM rollout; the mask runs up to and including the first generation-config EOS
  #     (verl's get_response_mask), the rest is padded with the pad token.
  #   "chat": the released set plus Qwen's chat stop tokens <|im_end|> and <|endoftext|>; the mask runs up
  #     to and including the token that stopped the response.
  #   "151643,151645": exactly these ids, as "chat" otherwise.
  c.rollout.stop_tokens = "released"

  # The environment a response is a conversation with (envs/env.py, docs/tools.md): "single_turn" (today's task: one
  # response, scored by reward.fn) or "python_tool" (tool-integrated reasoning: a turn's last ```python block runs in
  # a sandbox, its output returns as the chat template's tool turn, and the model goes on; a turn without one is the
  # answer, scored by reward.fn). A conversation's model turns and observations share rollout.max_new_tokens; the
  # observations are in the context but out of every loss (loss mask 0). python_tool runs with rollout.mode "sync"
  # on one process, the in-process rollout, on shared devices.
  c.env = ml_collections.ConfigDict()
  c.env.name = "single_turn"
  c.env.max_turns = 4  # the model's turns per conversation; a code block in the last one ends it unrun
  # The sandbox's limits on one program (envs/sandbox.py), and the processes running programs at once.
  c.env.cpu_seconds = 2.0
  c.env.wall_seconds = 4.0
  c.env.memory_mb = 512
  c.env.output_bytes = 4096  # of its output that comes back; a program printing more is stopped
  c.env.workers = 4

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
  # mean (before the clip); PACS's exact padding replication packs rows in groups of this many.
  c.train.verl_micro_batch_rows = 8
  # Packed rows (docs/training.md, "Packing"): the log-prob passes and the update run each micro-batch's sequences
  # end to end in rows of packing_row_tokens tokens (0: P + R, the longest sequence), never the padding, as the
  # released runs' verl actor (use_remove_padding). The rows a micro-batch takes are a rung of a ladder of
  # packing_rungs sizes (m / rungs ... m rows), so at most that many shapes compile. Exact: the same log-probs,
  # losses and gradients as the padded rows (to float rounding).
  # packing_rows: the rows one packed micro-batch may take (0: a padded micro-batch's, so packing never holds more
  # than padding); where sequences are short one packed micro-batch takes several padded ones (a token budget).
  c.train.packing = False
  c.train.packing_row_tokens = 0
  c.train.packing_rows = 0
  c.train.packing_rungs = 8

  # Each registered algorithm's own settings block (`c.<algorithm>`), built from its settings class (its module in
  # pacs_jax/algos/, with each field's default, documentation and checks): this file names no algorithm's fields.
  for name, block in algorithms.settings_blocks().items():
    c[name] = block

  # LoRA (docs/lora.md): train low-rank adapters beside the decoder layers' projections; the base weights
  # (model.hf_path or the seeded preset) stay frozen and are never checkpointed. Off while rank is 0.
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0  # the adapters' rank I; 0 = off (full fine-tuning)
  c.lora.alpha = 32.0  # the update's scale is alpha / rank (alpha / sqrt(rank) with use_rslora), as peft
  # Comma-separated projections (q, k, v, o, gate, up, down or q_proj...) or regexes fullmatched against each
  # layer's Hugging Face module names ("model.layers.3.self_attn.q_proj"), as peft's target_modules.
  c.lora.targets = "q,k,v,o,gate,up,down"
  c.lora.use_rslora = False
  # Comma-separated norms and embeddings trained in full beside the adapters (peft's modules_to_save: an entry
  # names every module whose Hugging Face name ends with it: "norm" every norm, "model.norm" the final one,
  # "embed_tokens", "lm_head"), checkpointed with them and merged into the export. None by default: a plain
  # LoRA folder, which vLLM serves.
  c.lora.modules_to_save = ""
  # A LoRA run's learning rates (the policy's train.lr and a critic's rate) are times this, so a config's full
  # fine-tuning rate carries over when LoRA is turned on. 0 = the rule (`LoraSpec.lr_multiplier`): LoRA's best
  # rate is about 10x full fine-tuning's (Thinking Machines, "LoRA Without Regret", 2025, at widths of thousands),
  # capped at hidden_size / (2 alpha) for narrow models (1 for the width-64 demo; 10 from a width of 640 up).
  # 1 = use train.lr as it is.
  c.lora.lr_multiplier = 0.0

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
  # A resume refuses a checkpoint trained with another algorithm, tokenizer or objective settings, other data (data
  # order, validation set, instruction) or other rollout programs (n, max_new_tokens, sampling) (storage/resume.py);
  # a comma-separated list of those it may change anyway ("algorithm,tokenizer,objective,data,rollout").
  c.checkpoint.allow_changes = ""
  # One trainer per workdir: a lock whose holder runs on another host is taken over after this long
  # without a heartbeat (on the same host: as soon as its process is gone).
  c.checkpoint.lock_stale_after_s = 300.0

  # Training health (services/health.py): a dead or diverged run stops at the step boundary, before it saves, in
  # one line (exit status 8). Dead: for `patience` consecutive steps no update applied, a gradient norm of 0 while
  # the rewards within some group differ, or the entropy within `entropy_tolerance` nats of the uniform ln V
  # (0 = no such check). Diverged, at once: the policy's parameter norm over `max_param_growth` times its norm at
  # the start, or moved by over `max_update_ratio` times itself in one step (0 = off); a non-finite norm. (The
  # demo's norm moves 0.003x a step and 1.1x in 60 steps, LoRA's on the demo 0.3x at its first step (B starts at 0)
  # and 5x in 60; lr 1e3 multiplies it by 2e4 at once.)
  c.health = ml_collections.ConfigDict()
  c.health.patience = 3
  c.health.entropy_tolerance = 1e-3
  c.health.max_param_growth = 1000.0
  c.health.max_update_ratio = 10.0

  c.eval_every = 5  # validation (greedy, per-source accuracy); 0 = off
  # Per-step JSONL dumps of the generations, as the released trainer.rollout_data_dir / validation_data_dir
  # ("" = off): one line per response {input, output, score, step, data_source, ground_truth}, file <step>.jsonl.
  c.rollout_data_dir = ""
  c.validation_data_dir = ""
  c.log_every = 1
  c.reward_workers = 2
  c.reward_timeout_s = 10.0
  # The reward, named "package.module:function": fn(data_source, response, answer) -> a score, or (score, error or
  # None), run in `reward_workers` processes (docs/design.md, "Adding a reward"). The built-in is math-verify, with
  # the synthetic tasks' verifier for theirs (rewards/math.py:checked_score_for).
  c.reward = ml_collections.ConfigDict()
  c.reward.fn = reward_named.BUILTIN

  # Weights & Biases logging beside TensorBoard and metrics.jsonl (pip install wandb), process 0 only: the same rows
  # and the config. The run id is kept in the workdir (wandb_run_id), so a resumed run continues the same wandb
  # run. A service that cannot be reached costs one warning line, never the run.
  c.wandb = ml_collections.ConfigDict()
  c.wandb.enabled = False
  c.wandb.project = "pacs-jax"
  c.wandb.entity = ""  # "" = the account's default entity
  c.wandb.name = ""  # the run's display name; "" = the workdir's name
  c.wandb.tags = ""  # comma-separated
  c.wandb.mode = "online"  # online | offline (files under <workdir>/wandb, `wandb sync` later) | disabled
  c.wandb.init_timeout_s = 60.0  # how long to wait for the service before going on without it

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

  # `--compile_only`: the update phase is also costed at these response and prompt lengths, packed and padded
  # (compile/length_profile.py): "rlvr" (a stand-in RLVR profile: responses of mean 0.3 x max_new_tokens, 5% at
  # the cap, prompts of mean 150 tokens), "max" (every response at max: the worst case) or a past run's
  # metrics.jsonl; "" = the run's own programs only.
  c.compile = ml_collections.ConfigDict()
  c.compile.length_profile = "rlvr"

  # Multi-host: empty = auto-detect on TPU VMs (or single process elsewhere).
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""
  c.distributed.num_processes = 0
  c.distributed.process_id = -1
  return c


# ----------------------------------------------------------------------------------------------
# Run config -> model config
