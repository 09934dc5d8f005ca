"""The outer training loop: prompts -> rollouts -> rewards -> reference log-probs -> mini-batch updates -> logs, checkpoints.

Rows of one prompt's group are contiguous (row = prompt * n + sample). Each process feeds an equal share
of the prompts; mini- and micro-batches take whole groups from every process's share.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from pacs_jax import config as config_lib
from pacs_jax import paths
from pacs_jax.algos import algorithms
from pacs_jax.data import sources, tokenizers
from pacs_jax.models import hf
from pacs_jax.rewards import pool as reward_pool
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout import stop_tokens
from pacs_jax.services import collapse, console, health, multihost, teardown, tracking
from pacs_jax.services import metrics as metrics_lib
from pacs_jax.services import preemption as preemption_lib
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.storage import lock as workdir_lock
from pacs_jax.storage import resume as resume_lib
from pacs_jax.storage.workdir import CHECKPOINT_DIR
from pacs_jax.trainer import build, dynamic_sampling, overlap, packing, split, stages, warm_base
from pacs_jax.trainer import equal_rewards as signal_lib
from pacs_jax.trainer import programs as programs_lib
from pacs_jax.trainer import tool_rollout
from pacs_jax.trainer import train_state as state_lib


_TREE_NORM = jax.jit(state_lib.tree_norm)

# ----------------------------------------------------------------------------------------------
# The loop


class Trainer:
  """One training run: built from a config and a workdir (every input read, the state on its mesh); `run()` trains."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str, devices=None):
    """`devices`: the mesh's devices (default: all of them)."""
    devices = jax.devices() if devices is None else list(devices)
    config_lib.validate(cfg, num_processes=jax.process_count(), devices=devices)
    self.cfg, self.workdir = cfg, paths.normalize(workdir)
    warm_base.resolve(cfg, self.workdir)  # model.warmup: the base is built once, then loaded as model.hf_path
    # Every input is read before anything is created: a missing or malformed file leaves no workdir behind.
    self._read_inputs(cfg)
    created = not paths.exists(self.workdir)
    # Before anything is written to the workdir: a second trainer must not touch the first one's files
    # (Orbax deletes unfinished saves it finds, which may be the other trainer's save in flight).
    self.lock = multihost.lock_workdir(self.workdir, cfg.checkpoint.lock_stale_after_s)
    try:
      self._build(cfg, workdir, devices)
    except BaseException:
      self.lock.release()
      if created and jax.process_index() == 0:
        paths.remove_empty_dirs(self.workdir)  # what this failed start created, and nothing else
      raise

  def _read_inputs(self, cfg: ml_collections.ConfigDict) -> None:
    """The tokenizer, the training prompts and the validation set: everything the run reads."""
    self.tokenizer = build.load_tokenizer(cfg)
    model_config = config_lib.model_config(cfg)
    config_lib.check_tokenizer_fits_model(cfg, len(self.tokenizer), model_config.vocab_size)
    config_lib.check_lora_fits_model(cfg, model_config)
    for warning in config_lib.advisories(cfg):
      logging.warning("%s", warning)
    # Ids that stop a response, and those whose first occurrence ends its mask (config.rollout.stop_tokens).
    self.eos_ids, self.mask_eos_ids = stop_tokens.stop_and_mask_ids(
        self.tokenizer, cfg.model.hf_path and hf.resolve_path(cfg.model.hf_path), cfg.rollout.stop_tokens)
    self.pad_id = tokenizers.pad_token_id(self.tokenizer)
    self.P, self.R = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens

    instruction = cfg.data.instruction or None
    train_records, self.skipped_rows = sources.load_split(cfg.data.train, cfg.data.skip_bad_rows, cfg.data.synthetic_train_size, cfg.seed)
    self.source_names = sorted({r["data_source"] for r in train_records})
    self.pipeline = build.prompt_pipeline(cfg, self.tokenizer, train_records, instruction)
    self.data_iter = self.pipeline.iterator()
    self.val_records, self.val_prompts = build.validation_set(cfg, self.tokenizer, instruction, self.P)
    self.descriptions = {"model": console.describe_model(cfg, model_config),
                         "tokenizer": console.describe_tokenizer(cfg, self.tokenizer),
                         "data": console.describe_data(cfg, len(train_records), len(self.val_records))}

  def _build(self, cfg: ml_collections.ConfigDict, workdir: str, devices) -> None:
    self.objective = algorithms.bind(cfg)  # the run's objective, bound once: what the per-step hooks take
    self._stepped = False  # no step has run in this process yet (the first one compiles)
    self.mesh, self.rollout_mesh = split.meshes(cfg, devices)  # rollout_mesh: None unless rollout.devices
    with jax.set_mesh(self.mesh):
      policy = build.build_policy(cfg, self.mesh)
    self.policy_config = policy.config  # the model card (model/) is written once a resume is known to be this run's
    self.record = resume_lib.make_record(cfg, policy.config.to_hf_dict(), self.tokenizer)
    run = build.run_params(cfg, policy, self.mesh)
    self.graphdef, self.critic_graphdef = run.graphdef, run.critic_graphdef
    # A frozen reference (or None: the policy that sampled), and the run's frozen part (empty in a full run).
    self.ref_params, self.base, self.frozen = run.ref_params, run.base, run.frozen
    self.optimizer, self.critic_optimizer = programs_lib.make_optimizers(cfg)
    self.state = state_lib.initial_state(run.params, self.optimizer, run.critic_params, self.critic_optimizer,
                                         self.mesh, cfg.seed)
    # The shardings `--compile_only` compiles for (a no-op move for arrays already in place).
    self.state_shardings = programs_lib.train_state_shardings(self.state, self.mesh, self.optimizer,
                                                              self.critic_optimizer)
    self.state = jax.device_put(self.state, self.state_shardings)

    # The rollout (`rollout.interface.Rollout`): the in-process engine, on the trainer's mesh or its own (split).
    self.sampler = split.make_rollout(cfg, run.decode_model, self.mesh, self.rollout_mesh, self.eos_ids)
    self.sampling = sampling_lib.from_config(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
    # env.name "python_tool": each response a conversation with the tool (trainer/tool_rollout.py; its sandbox is
    # the run's: opened and closed by `run`). None: the single-turn path, as before.
    self.tools = None if cfg.env.name == "single_turn" else tool_rollout.ToolRollout(cfg.env, self.tokenizer,
                                                                                     self.eos_ids)
    # rollout.mode "one_step_off" / "async": the next steps' rollouts in the background, by a worker with weights of
    # its own (trainer/overlap.py), its generate calls timed (trainer/split.py).
    self.rollout_worker = self.next_rollout = None
    if cfg.rollout.mode != "sync":
      self.data_iter = overlap.Lookahead(self.data_iter)  # its rollouts' prompts: the pipeline's next elements
      self.rollout_worker = split.make_worker(self.sampler)
      self.next_rollout = overlap.Overlapped(
          self.rollout_worker, cfg.rollout.max_staleness, inline=jax.process_count() > 1, mesh=self.mesh,
          last_step=cfg.steps, prompts=lambda i: self.data_iter.peek(i), weights=self.sample_params,
          generate=lambda worker, prompt_ids, seed: stages.rollout(
              worker, prompt_ids, P=self.P, n=cfg.rollout.n, max_new_tokens=self.R, sampling=self.sampling, seed=seed))
    self.programs = programs_lib.make_programs(cfg, self.graphdef, self.critic_graphdef, self.optimizer,
                                               self.critic_optimizer, self.state_shardings,
                                               self.sampler.weight_shardings, run.frozen)
    self.batch_layout = programs_lib.batch_layout(cfg, self.mesh)
    self.checkpointer = checkpoint_lib.Checkpointer(paths.join(workdir, CHECKPOINT_DIR), cfg.checkpoint.keep,
                                                    cfg.checkpoint.async_save)
    self.collapses = collapse.Watch()  # the run's collapses (services/collapse.py): warned at once, and at its end
    self.empty_steps = dynamic_sampling.EmptySteps()  # dynamic sampling's steps that kept no group: said once

  def banner(self, config_name: str) -> str:
    """The start banner: config, algorithm, workdir, model, tokenizer, data, devices."""
    return console.start_banner(self.cfg, config_name, self.workdir, devices=list(self.mesh.devices.flat),
                                mesh_shape=dict(self.mesh.shape), **self.descriptions)

  # -- one step --------------------------------------------------------------------------------

  def train_one_step(self, prompts: dict[str, Any], scorer) -> dict[str, Any]:
    """One step on this process's share of the pipeline's element `prompts` (lists per field): the stages of
    trainer/stages.py in order (rollout, score, pack, update, record); returns the step's metrics row."""
    clock = stages.Clock()
    version = int(self.state.step)  # the policy the rollout samples and the update starts from
    seed = state_lib.rollout_seed(self.state.rng)  # the train step's last update moves the RNG on
    prompt_ids = [ids.tolist() for ids in prompts["prompt_ids"]]
    first = " (the first step compiles its programs)" if not self._stepped else ""
    sampled, episodes = {}, None  # dynamic sampling's metrics; a tool run's episodes
    with console.StepProgress(len(prompt_ids) * jax.process_count() * self.cfg.rollout.n,
                              lambda: f"step {int(self.state.step) + 1}: rollout{first}") as progress:
      if self.tools is not None:  # conversations, scored by their episodes (no overlap, no refills: config checks)
        with self.current_policy() as sampler:
          completions, scored, episodes = self.tools.rollout(sampler, scorer, prompts, prompt_ids, n=self.cfg.rollout.n,
                                                             max_new_tokens=self.R, sampling=self.sampling, seed=seed,
                                                             on_finish=progress.on_finish)
        clock.lap("rollout")
        progress.stage("reward")
      elif self.objective.sampling_rounds == 1:
        completions = None
        if self.next_rollout:  # started by an earlier step (stale responses drawn again now)
          completions = self.next_rollout.take(prompts, version, lambda: self.rollout(prompt_ids, seed))
        if completions is None:
          completions = self.rollout(prompt_ids, seed, on_finish=progress.on_finish)
        if self.next_rollout:
          self.next_rollout.before_update(self.state.rng, version)
        clock.lap("rollout")
        progress.stage("reward")
        scored = stages.score(scorer, self.tokenizer, prompts, completions)
      else:  # the kept groups of rollouts drawn until the batch is full (trainer/dynamic_sampling.py)
        prompt_ids, completions, scored, sampled = self.sample(prompts, seed, scorer, progress.on_finish)
        clock.lap("rollout")
        progress.stage("update")
      clock.lap("score")
      progress.stage("update")
      packed = stages.pack(prompt_ids, completions, scored, P=self.P, R=self.R, n=self.cfg.rollout.n,
                           pad_id=self.pad_id, mask_eos_ids=self.mask_eos_ids,
                           host_inputs=lambda ids, mask: self.objective.host_inputs(ids, mask, self.R),
                           shape_rewards=self.objective.shape_rewards if self.objective.shapes_rewards else None,
                           version=version if self.next_rollout else None, whole_responses=self.tools is not None)
      metrics = self.update(packed)
      if self.next_rollout:
        self.next_rollout.after_update(self.state.rng, int(self.state.step))
      clock.lap("update")
      self._stepped = True
    if self.cfg.rollout_data_dir:  # the step just done: its number is the state's step now
      stages.dump(self.cfg.rollout_data_dir, int(self.state.step), self.tokenizer, prompt_ids, completions, scored,
                  extra=episodes and tool_rollout.dump_fields(episodes))
    row = stages.record(metrics, packed, scored, clock, self.source_names, self.cfg.rollout.n)
    if episodes is not None:
      row.update(tool_rollout.metrics(episodes, completions))
    row.update(sampled)  # (its timings split the rounds' rollouts from their scoring)
    row.update(stages.staleness_metrics(completions, version))
    if self.next_rollout:
      row["rollout/dropped"] = float(self.next_rollout.dropped)
    row.update(split.phase_metrics(self, clock))  # wall times, overlap, weight pushes
    return row

  def sample(self, prompts: dict[str, Any], seed: int, scorer, on_finish=None):
    """The step's dynamically sampled rollout (`dynamic_sampling.sample`): refills are the pipeline's next elements."""
    def generate(global_prompts, round_seed):
      with self.current_policy() as sampler:
        return stages.generate(sampler, global_prompts, n=self.cfg.rollout.n, max_new_tokens=self.R,
                               sampling=self.sampling, seed=round_seed, on_finish=on_finish)
    return dynamic_sampling.sample(
        prompts, lambda: next(self.data_iter), generate,
        lambda element, completions: stages.score(scorer, self.tokenizer, element, completions),
        self.objective.keep_groups,
        lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=True),
        n=self.cfg.rollout.n, P=self.P, max_rounds=self.objective.sampling_rounds, seed=seed,
        step=int(self.state.step) + 1, empty=self.empty_steps)

  def sample_params(self):
    """The current policy's rollout weights (a LoRA run's: the base with the adapters merged in). Under the mesh."""
    return self.programs.to_sample_params(self.state.params, self.base)

  @contextlib.contextmanager
  def current_policy(self):
    """Under the mesh: the sampler holding the current policy's rollout weights as version `state.step` (updates
    done), which it lets go of afterwards (the update needs the memory)."""
    with jax.set_mesh(self.mesh):
      self.sampler.set_weights(self.sample_params(), int(self.state.step))
      try:
        yield self.sampler
      finally:
        self.sampler.release()

  @property
  def frozen_args(self) -> tuple:
    """The programs' trailing argument: the run's frozen part (a LoRA run's base weights; empty in a full run)."""
    return (self.base,)

  def rollout(self, prompt_ids: list[list[int]], seed: int, on_finish=None) -> list:
    """This process's completions of the step's rollout (n samples per prompt) by the current policy."""
    with self.current_policy() as sampler:
      return stages.rollout(sampler, prompt_ids, P=self.P, n=self.cfg.rollout.n, max_new_tokens=self.R,
                            sampling=self.sampling, seed=seed, on_finish=on_finish)

  def update(self, packed: packing.PackedRollout) -> dict[str, Any]:
    """The update stage on the trainer's state; keeps each mini-batch's own metrics in `minibatch_metrics`."""
    self.state, per_minibatch = stages.update(self.programs, self.state, self.ref_params, packed, self.batch_layout,
                                              self.mesh, programs_lib.updates_per_step(self.cfg), self.base)
    # Each mini-batch's own metrics, for inspection (e.g. r̂ = 0 on the first one with the rollout reference).
    self.minibatch_metrics = [{k: float(np.asarray(v)) for k, v in m.items()} for m in per_minibatch]
    return {**stages.step_metrics(per_minibatch), "param_norm": self.param_norm()}

  def param_norm(self) -> float:
    """|θ| of the trained params (a LoRA run's adapters), for the health check: a program of its own, so the train
    step keeps no update tree alive for it (reading the params once costs milliseconds a step)."""
    with jax.set_mesh(self.mesh):
      return float(_TREE_NORM(self.state.params))

  def start_norm(self) -> float:
    """`param_norm` at the start, NaN where a LoRA run's frozen base is non-finite (no update of its adapters helps)."""
    with jax.set_mesh(self.mesh):
      base_finite = bool(jnp.isfinite(_TREE_NORM(self.base)))  # 0 for a full run's empty frozen part
    return self.param_norm() if base_finite else float("nan")

  # -- validation ------------------------------------------------------------------------------

  def validate(self, scorer) -> dict[str, float]:
    """The current policy's greedy responses to the validation prompts, scored: accuracy per data source."""
    if not self.val_records:
      return {}
    max_new_tokens = min(self.cfg.rollout.val_max_new_tokens or self.R, self.R)
    if self.tools is not None:  # greedy conversations with the tool, scored by their episodes
      with self.current_policy() as sampler:
        return self.tools.validate(sampler, scorer, self.val_records, self.val_prompts, max_new_tokens=max_new_tokens,
                                   sampling=sampling_lib.Greedy())
    with self.current_policy() as sampler:
      completions = sampler.generate(self.val_prompts, n=1, sampling=sampling_lib.Greedy(), seed=0,
                                     max_new_tokens=max_new_tokens)
    return stages.validation_metrics(scorer, self.tokenizer, self.val_records, self.val_prompts, completions,
                                     dump_dir=self.cfg.validation_data_dir, step=int(self.state.step))

  # -- checkpoints -----------------------------------------------------------------------------

  def save(self, step: int):
    self.checkpointer.save(step, self.state, self.data_iter.get_state(), self.cfg, record=self.record,
                           in_flight=self.next_rollout.in_flight() if self.next_rollout else None)

  def maybe_restore(self) -> int | None:
    """The step of the checkpoint restored (the newest that restores), or None for a fresh start."""
    if self.cfg.checkpoint.restore == "never":
      moved = self.checkpointer.set_aside_all()
      if moved:
        logging.warning("checkpoint.restore=never: starting from scratch; moved checkpoints of steps %s to %s/",
                        moved, checkpoint_lib.SET_ASIDE_DIR)
      return None
    restored = self.checkpointer.restore_newest(self._restore)
    if restored is None:
      return None
    step, (self.state, self.data_iter, *in_flight) = restored
    if in_flight and in_flight[0]:  # the rollouts in flight at the save, on the same pipeline elements
      self.next_rollout.restart(*in_flight[0])
    logging.info("resumed from %s at step %d", self.checkpointer.directory, step)
    print(f"resumed from step {step}", flush=True)
    return step

  def _restore(self, step: int):
    """One attempt: raises if anything of the checkpoint (config, state, data position) is unreadable, and
    CheckpointMismatch if it is another run's (algorithm, model shape, tokenizer, objective)."""
    saved_config = self.checkpointer.restore_config(step)
    resume_lib.check(step, self.checkpointer.directory, saved_config, self.checkpointer.read_record(step),
                     self.record, self.cfg)
    state, data_state = self.checkpointer.restore(step, checkpoint_lib.abstract_like(self.state))
    iterator = self.pipeline.iterator(data_state)
    if not self.next_rollout:
      return state, iterator
    with jax.set_mesh(self.mesh):  # the overlapped modes' rollouts in flight at the save, started again below
      in_flight = self.checkpointer.restore_in_flight(step, checkpoint_lib.abstract_like(self.sample_params()))
    return state, overlap.Lookahead(iterator), in_flight

  # -- the loop --------------------------------------------------------------------------------

  def run(self) -> dict[str, Any]:
    """Trains from the newest checkpoint (or from scratch) to `cfg.steps`; returns the last step's metrics. Whatever
    happens, it lets go of the checkpointer, metrics writer and workdir lock (services/teardown.py)."""
    held = teardown.Held(self.workdir, self.checkpointer, self.lock)
    with teardown.closing(held), contextlib.ExitStack() as run_services:
      if self.tools is not None:  # the run's sandbox, closed whatever happens (programs still running are killed)
        self.tools.open()
        run_services.callback(self.tools.close)
      restored = self.maybe_restore()
      # After the resume check: a refused resume must not leave another model's card beside the checkpoints.
      export_lib.write_model_card(self.workdir, self.policy_config, self.tokenizer,
                                  source_dir=self.cfg.model.hf_path and hf.resolve_path(self.cfg.model.hf_path))
      held.writer = metrics_lib.MetricsWriter(self.workdir, resume_step=restored,
                                              tracker=tracking.start(self.cfg, self.workdir))
      start = restored or 0
      if start >= self.cfg.steps:
        print(console.already_done(start, self.cfg.steps), flush=True)
      held.preemption = preemption_lib.Preemption()
      held.step_in_progress = start  # from here on, a failure may be a storage outage
      try:
        return self._steps(held, restored)
      finally:
        if self.next_rollout:  # rollouts still in flight (a stop, a failure) are dropped: a resume draws them again
          self.next_rollout.close()

  def _steps(self, held: teardown.Held, restored: int | None) -> dict[str, Any]:
    """The steps after `held.step_in_progress` (each number held there as it runs), with validation, metrics rows,
    checkpoints and a stop on SIGTERM or Ctrl-C, a lost lock, or a dead or diverged run (services/health.py)."""
    cfg, writer, preemption = self.cfg, held.writer, held.preemption
    skipped_before = int(state_lib.skipped_updates(self.state.opt_state))
    updates_per_step = programs_lib.updates_per_step(cfg)
    monitor = health.Monitor(cfg, self.policy_config.vocab_size, updates_per_step, self.start_norm(), restored)
    save_due = False  # a periodic save put off while the run looked dead
    no_signal = signal_lib.EqualRewardsWatch(cfg.algorithm)
    last = {}
    with reward_pool.RewardScorer(cfg.reward_workers, cfg.reward_timeout_s, score_fn=cfg.reward.fn) as scorer:
      if restored is None and cfg.eval_every and self.val_records:  # no empty step-0 row without validation
        writer.write(0, self.validate(scorer))
      for step in range(held.step_in_progress + 1, cfg.steps + 1):
        held.step_in_progress = step
        # A failed async save stops the run (every process) before it trains further.
        failed = self.checkpointer.poll_failure()
        if multihost.any_process([failed is not None])[0]:
          raise paths.StorageError(failed or "a checkpoint save failed on another process")
        prompts = next(self.data_iter)
        last = self.train_one_step(prompts, scorer)
        last["data/dropped_prompts"] = float(self.pipeline.num_dropped)
        last["data/skipped_rows"] = float(self.skipped_rows)
        last["data/epoch"] = float(prompts["epoch"])
        skipped = int(last["skipped_updates"]) - skipped_before
        skipped_before = metrics_lib.warn_skipped_updates(step, last["skipped_updates"], skipped_before, updates_per_step)
        no_signal.observe(step, last)
        if cfg.eval_every and step % cfg.eval_every == 0:
          last.update(self.validate(scorer))
        if step % cfg.log_every == 0 or step == cfg.steps:
          writer.write(step, last)
        self.collapses.observe(step, last, monitor.last_saved)  # a reward or accuracy that fell: one line at once
        monitor.check(step, last, skipped)  # a dead or diverged run stops here, before it saves (every process)
        stop, lost_lock = preemption.agreed(self.lock.lost is not None)
        if lost_lock:  # its files are another trainer's now: stop without saving over them
          raise workdir_lock.WorkdirLocked(f"another trainer took over {self.workdir} "
                                           f"({self.lock.lost or 'seen by process 0'}); stopping without saving")
        save_due = save_due or step % cfg.checkpoint.every == 0
        if save_due and monitor.saving_is_healthy or step == cfg.steps or stop:
          self.save(step)
          monitor.saved(step)
          save_due = False
        if stop:
          logging.warning("%s: saved step %d, exiting", preemption.describe(), step)
          break
    return last


def train(cfg: ml_collections.ConfigDict, workdir: str, devices=None) -> dict[str, Any]:
  """Trains until `cfg.steps` (resuming from `workdir`'s newest checkpoint); returns the last step's metrics.
  `devices`: the mesh's devices (default: all of them)."""
  return Trainer(cfg, workdir, devices).run()
