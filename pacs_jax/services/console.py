"""What a run tells its terminal besides the per-step line: the start banner, the closing line, and a progress
bar over a step's rollout tokens named by its phase (tqdm; on processes other than 0 nothing), and the first step's
phases with their times as plain lines (that step compiles the run's programs)."""

from __future__ import annotations

import sys
import time

import ml_collections

from pacs_jax import paths
from pacs_jax.rollout import interface
from pacs_jax.storage import workdir as workdir_lib


def describe_model(cfg: ml_collections.ConfigDict, model_config) -> str:
  """`preset tiny: qwen2 (2 layers, width 64, vocabulary 64, float32)`, or the checkpoint directory: its family
  (config.json's model_type) and the same figures."""
  source = cfg.model.hf_path or f"preset {cfg.model.preset}"
  return (f"{source}: {model_config.model_type} ({model_config.num_hidden_layers} layers, "
          f"width {model_config.hidden_size}, vocabulary {model_config.vocab_size}, {cfg.model.dtype})")


def describe_tokenizer(cfg: ml_collections.ConfigDict, tokenizer) -> str:
  if cfg.tokenizer == "synthetic" or not (cfg.tokenizer or cfg.model.hf_path):
    where = "synthetic (built in)"
  elif cfg.tokenizer:
    where = cfg.tokenizer
  else:
    where = f"the model's ({cfg.model.hf_path})"
  return f"{where}, {len(tokenizer)} tokens"


def describe_data(cfg: ml_collections.ConfigDict, num_train: int, num_val: int) -> str:
  train = f"train {cfg.data.train} ({num_train} problems)"
  val_spec = f"{cfg.data.val_dir} (released sets)" if cfg.data.val_dir else cfg.data.val
  if not (val_spec and cfg.eval_every and num_val):
    return f"{train}; no validation"
  return f"{train}; validate on {val_spec} ({num_val} problems) every {cfg.eval_every} steps"


def start_banner(cfg: ml_collections.ConfigDict, config_name: str, workdir: str, *, model: str, tokenizer: str,
                 data: str, devices: list, mesh_shape: dict) -> str:
  """Which config, algorithm, workdir, model, tokenizer, data and devices this run uses, one line each."""
  kinds = sorted({d.device_kind for d in devices})
  mesh = " ".join(f"{axis}={size}" for axis, size in mesh_shape.items())
  instruction = repr(cfg.data.instruction[:40] + ("..." if len(cfg.data.instruction) > 40 else "")) \
      if cfg.data.instruction else "none"
  lines = [f"pacs_jax.train: {config_name}, algorithm {cfg.algorithm}, {cfg.steps} steps",
           f"  workdir    {paths.normalize(workdir)}",
           f"  model      {model}",
           f"  tokenizer  {tokenizer}",
           f"  data       {data}",
           f"  prompts    {cfg.train.batch_prompts} x n={cfg.rollout.n} per step, <= {cfg.data.max_prompt_length} "
           f"prompt and {cfg.rollout.max_new_tokens} new tokens; instruction {instruction}",
           f"  devices    {len(devices)} x {', '.join(kinds)} (mesh {mesh})",
           f"  training   {training_line(cfg)}",
           f"  rollout    {rollout_line(cfg, len(devices))}"]
  return "\n".join(lines)


def training_line(cfg: ml_collections.ConfigDict) -> str:
  """What the update trains: every parameter, or LoRA adapters (rank, scale, targets)."""
  lora = cfg.lora
  if not lora.rank:
    return "every parameter (full fine-tuning)"
  scale = f"alpha {lora.alpha:g}" + (", rsLoRA" if lora.use_rslora else "")
  return f"LoRA rank {lora.rank} ({scale}) on {lora.targets.replace(',', ', ')}, the base frozen"


def rollout_line(cfg: ml_collections.ConfigDict, trainer_devices: int) -> str:
  """How the rollout runs beside the update (mode, staleness) and where (the trainer's devices or its own)."""
  r = cfg.rollout
  mode = {"sync": "sync (each step samples with its own weights, then updates)",
          "one_step_off": f"one_step_off (the next step samples during this update; up to {r.max_staleness} "
                          f"version{'s' if r.max_staleness != 1 else ''} stale)",
          "async": f"async ({r.max_staleness} steps sampled ahead; up to {r.max_staleness} versions stale)"}.get(
              r.mode, r.mode)
  where = (f"on its own {r.devices} devices (the trainer's {trainer_devices} above)" if r.devices
           else "on the trainer's devices")
  return f"{mode}, {where}"


def already_done(step: int, steps: int) -> str:
  return (f"already at step {step} of config.steps={steps}: nothing to train (raise --config.steps to go on, or "
          "give another --workdir)")


def closing_line(workdir: str, step: int) -> str:
  """Where the results of a run that reached `step` went, and the next commands."""
  w = paths.normalize(workdir)
  return (f"done at step {step}: metrics {paths.join(w, 'metrics.jsonl')}, TensorBoard {paths.join(w, 'tensorboard')}, "
          f"checkpoints {workdir_lib.checkpoint_dir(w)}\n"
          f"  export:   python -m pacs_jax.export --workdir {w} --out {paths.join(w, 'export')}\n"
          f"  compare:  python -m pacs_jax.compare {w} OTHER_RUN ...")


def watched() -> bool:
  """Process 0 writing to a terminal: where progress bars are drawn."""
  return _process_zero() and sys.stderr.isatty()


_announced = False  # the first step (compiling makes its phases long) has been announced in this process


class StepProgress:
  """A context manager over a step's phases (rollout, reward, update). Where someone watches (`watched()`): a bar
  over the rollout's token budget, named by the phase, its clock kept running. On process 0 the first step in the
  process (the one that compiles) also tells each phase's time as it ends, one line on stdout, in a terminal (above
  the bar) or not: `step 1: rollout took 21.4 s`; without a terminal its phases are announced as they start
  (`step 1: rollout (the first step compiles its programs) ...`). `description()` ("step N: rollout") is asked once
  (the step number waits for the previous update)."""

  def __init__(self, total: int, description):
    del total  # the bar's total is the rollout's token budget, told by the rollout itself
    global _announced
    self.progress, self.desc, self.began = None, None, None
    self.phase = "rollout"
    if watched():
      self.progress = interface.BarProgress(interface.token_bar(description()))
    if not _announced and _process_zero():  # the first step: its phases timed (`began`: when this one began)
      _announced = True
      self.desc, self.began = description(), time.monotonic()
      if self.progress is None:
        print(f"{self.desc} ...", flush=True)  # stdout, as the step lines: stderr keeps to warnings and faults

  def __enter__(self) -> "StepProgress":
    return self

  def __exit__(self, *exc) -> None:
    if self.progress is not None:
      self.progress.close()
    if self.began is not None and exc[0] is None:
      interface.phase_line(self._took())

  @property
  def on_finish(self):
    """What the rollout is given as `on_finish` (an `interface.Progress`; None without a bar)."""
    return self.progress

  def stage(self, next_stage: str) -> None:
    """The step goes on to phase `next_stage` (a no-op if it is there already)."""
    if next_stage == self.phase:
      return
    if self.progress is not None:
      bar = self.progress.bar
      bar.set_description(bar.desc.split(": ")[0] + f": {next_stage}")
    if self.began is not None:
      took = self._took()
      self.began = time.monotonic()
      interface.phase_line(took if self.progress is not None else f"{took}; {next_stage} ...")
    self.phase = next_stage

  def _took(self) -> str:
    return f"{self.desc.split(': ')[0]}: {self.phase} took {time.monotonic() - self.began:.1f} s"


def _process_zero() -> bool:
  import jax
  return jax.process_index() == 0
