"""`--compile_only`: every program of a training run compiled ahead of time for the config's target, from
abstract weights; per-program memory and cost per chip, the resident total per phase, a fits verdict.

Nothing is materialised and no checkpoint or tokenizer is read (shapes come from `model.preset`). The
programs are the trainer's own (`programs.make_programs`, the rollout engine's `lower_*` hooks), lowered
with the shardings the trainer uses on `hardware.tpu_topology`'s abstract devices (libtpu compiles TPU
programs on any machine) or `hardware.gpu_target` x `gpu_topology`'s (jax's CUDA plugin compiles GPU programs
on a CPU host; nothing is autotuned there, so GPU reports give memory, FLOPs and bytes, never a time). Loop
trip counts are applied to the compiler's cost figures (see `hlo_cost`).
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import jax
import ml_collections
import numpy as np
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.algos import batch as batch_lib
from pacs_jax.models import decoder, lora
from pacs_jax.rollout import budget as budget_lib
from pacs_jax.rollout import interface
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.compile import aot_measure, aot_rollout, aot_tools, length_profile
from pacs_jax.compile.aot_measure import ProgramReport, measure, outputs_of, per_chip_bytes, persistent_cache_off
from pacs_jax.compile.aot_report import Report, format_report
from pacs_jax.compile.target import Target, TargetUnavailable, target
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import programs as programs_lib


# ----------------------------------------------------------------------------------------------
# Sizes the loop runs at


def matmul_params(model: decoder.CausalLM) -> int:
  """Parameters that take part in a matmul per token: all but the input embedding table (a lookup),
  which counts once as the output head when tied."""
  total = decoder.count_params(model)
  if model.config.tie_word_embeddings:
    return total
  return total - math.prod(model.model.embed_tokens.shape)


def prefill_rows(requests_at_once: int, n: int, prompts: int) -> int:
  """Most distinct prompts one prefill call can hold: `requests_at_once` consecutive requests of groups of
  n span up to (requests - 1) // n + 2 prompts; the engine pads the count to a power of two."""
  distinct = requests_at_once if n == 1 else min(requests_at_once, (requests_at_once - 1) // n + 2)
  return budget_lib.next_pow2(max(1, min(distinct, prompts)))


def decode_calls(engine: interface.AheadOfTime, prompt_length: int, new_tokens: int) -> dict[int, int]:
  """Decode calls per page budget for one wave of slots that start at `prompt_length` rows and all run to
  `new_tokens` (the scheduler's choice: `budget.PagePolicy.page_budget` of the busy rows)."""
  calls: dict[int, int] = {}
  rows, steps = prompt_length, engine.steps_per_call
  B = engine.max_concurrent_decodes
  for _ in range(-(-new_tokens // steps)):
    page_budget = engine.policy.page_budget(np.full(B, rows), np.ones(B, bool))
    calls[page_budget] = calls.get(page_budget, 0) + 1
    rows += steps
  return calls


def decode_name(page_budget: int) -> str:
  """A decode program's name: its page budget (live (slot, page) pairs a batch shard reads per step)."""
  return f"decode[pages={page_budget}]"


# ----------------------------------------------------------------------------------------------
# Compiling a run's programs


def abstract_run(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, lora_base=None):
  """The run's train state (abstract, in its shardings), the abstract policy, its rollout's ahead-of-time view
  (`interface.AheadOfTime`) and the jitted programs the trainer runs, built on `mesh` with nothing allocated:
  (state, policy, engine, progs). A LoRA run's state holds its adapters, and its programs take the frozen base
  (`programs.abstract_base`, or `lora_base` when the caller has it; a full run's is empty); its policy here is the
  model without adapters the engine runs (on merged weights)."""
  graphdef, critic_graphdef, state = programs_lib.abstract_train_state(cfg, mesh)
  optimizer, critic_optimizer = programs_lib.make_optimizers(cfg)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  frozen, base = lora_base or lora_run_base(cfg, mesh)
  # The weights without adapters have the shapes of the trained params merged into the frozen part.
  policy = nnx.merge(frozen.ref_graphdef, jax.eval_shape(lambda p, b: lora.merge_into(b, p, frozen.spec),
                                                         state.params, base))
  sampler = programs_lib.make_rollout(cfg, policy, mesh, eos_ids=(0,))
  progs = programs_lib.make_programs(cfg, graphdef, critic_graphdef, optimizer, critic_optimizer, state_shardings,
                                     sampler.weight_shardings, frozen)
  engine = sampler.ahead_of_time()
  return state, policy, engine, progs


def lora_run_base(cfg: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
  """A run's (Frozen, abstract frozen part in its shardings) (`programs.abstract_base`): a LoRA run's base, empty for
  a full run."""
  return programs_lib.abstract_base(cfg, mesh)


def weights_resident(cfg: ml_collections.ConfigDict, state, base_bytes: float) -> dict[str, float]:
  """The weights a run holds through both phases, per chip: a full run's policy and its Adam moments (and the
  frozen reference, a copy); a LoRA run's frozen base (no optimizer state, and the reference itself) apart from its
  adapters and their Adam moments."""
  params, opt = per_chip_bytes(state.params), per_chip_bytes(state.opt_state)
  if base_bytes:
    out = {"base weights (frozen)": base_bytes, "adapters": params, "adapter optimizer state": opt}
  else:
    out = {"policy params": params, "optimizer state": opt}
    if programs_lib.needs_frozen_ref(cfg):
      out["frozen reference"] = params
  if state.critic_params is not None:
    out["critic params + optimizer"] = per_chip_bytes(state.critic_params) + per_chip_bytes(state.critic_opt_state)
  return out


def compile_run(cfg: ml_collections.ConfigDict, tgt: Target | None = None, validation: bool = True,
                one_step_decode: bool = False, log: Callable[[str], None] = lambda s: None,
                group: str = "all") -> Report:
  """Compiles every program of a training run of `cfg` for its target; see the module docstring.

  `group` (split devices, `compile/aot_split.py`): "all" (shared devices), "trainer" (the update programs and
  `to_sample_params`, whose output is staged for the push, on `tgt`'s devices: one phase, "update") or "rollout"
  (the rollout's programs on `tgt`'s devices, from the rollout weights alone).

  Rollout programs are compiled at the largest shapes a step uses: each prefill bucket at the most
  prompts one call can hold, the insert program at the longest bucket, the decode chunk at every
  page budget; validation's greedy programs at its longest bucket and the top page budget (`validation`).
  `one_step_decode` adds a decode call of one step, to compare with the chunk's figures.
  """
  tgt = tgt or target(cfg)
  config_lib.validate(cfg, num_processes=tgt.num_processes, devices=tgt.devices, check_paths=False)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=tgt.devices)
  lora_base = lora_run_base(cfg, mesh)
  state, policy, engine, progs = abstract_run(cfg, mesh, lora_base)
  # Every program takes the run's frozen part as its last argument: a LoRA run's base, empty (no leaves) in a full run.
  base = (lora_base[1],)
  base_bytes = per_chip_bytes(base)
  has_base = bool(jax.tree.leaves(base))
  n_params = matmul_params(policy) / len(tgt.devices)  # per chip: the model FLOPs split evenly over the chips
  n, P, R = cfg.rollout.n, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
  B = engine.max_concurrent_decodes
  updates = programs_lib.updates_per_step(cfg)
  logprob_passes = int(programs_lib.needs_old_logprobs(cfg)) + int(programs_lib.needs_frozen_ref(cfg))
  minibatch = programs_lib.minibatch_shapes(cfg, mesh)
  mb_rows = cfg.train.mini_batch_prompts * n
  reports: list[ProgramReport] = []
  notes: list[str] = []

  def run(report: ProgramReport, lower, resident=lambda c: 0.0):
    log(f"compiling {report.name} ...")
    with jax.set_mesh(mesh), persistent_cache_off():
      compiled = measure(report, lower, resident)
    reports.append(report)
    log(f"  {report.compile_s:.1f} s" + (f"  FAILED: {report.error.splitlines()[0][:300]}" if report.error else ""))
    return compiled

  params_bytes = per_chip_bytes(state.params)
  # -- rollout phase ---------------------------------------------------------------------------
  compiled = None
  rollout_costs = []
  if group != "rollout":
    compiled = run(ProgramReport("to_sample_params", "update" if group == "trainer" else "rollout", 1, 0.0),
                   lambda: progs.to_sample_params.lower(state.params, *base),
                   lambda c: params_bytes + base_bytes + per_chip_bytes(outputs_of(c)))
  sample_params = outputs_of(compiled) if compiled is not None else engine.abstract_params(
      config_lib.dtype(cfg.model.dtype))
  rollout_weights = per_chip_bytes(sample_params)
  state_bytes = 0.0
  if group != "trainer":
    compiled = run(ProgramReport("init_decode_state", "rollout", 1, 0.0), engine.lower_init,
                   lambda c: per_chip_bytes(outputs_of(c)))
    decode_state = outputs_of(compiled) if compiled is not None else engine.abstract_decode_state()
    state_bytes = per_chip_bytes(decode_state)
    waves = -(-(cfg.train.batch_prompts * n) // B)
    pauses = aot_tools.pause_count(cfg)  # a tool run's decodes pause at its turn end (aot_tools)

    def rollout_programs(tag: str, sampling, rows: int, requests: int, calls_scale: float, prompts: int,
                         largest_only: bool = False):
      prefill_out = None
      for T in engine.prefill_buckets[-1:] if largest_only else engine.prefill_buckets:
        longest = T == engine.prefill_buckets[-1]
        calls = calls_scale * -(-prompts // rows) if longest else 0.0  # bound: every prompt at the longest bucket
        compiled = run(ProgramReport(f"{tag}prefill[B={rows},T={T}]", "rollout", calls, 2.0 * n_params * rows * T),
                       lambda T=T: engine.lower_prefill(sample_params, rows, T),
                       lambda c: rollout_weights)
        if longest and compiled is not None:
          prefill_out = outputs_of(compiled)
      if prefill_out is not None:
        cache, logits = prefill_out
        # Requests into slots, the state donated.
        run(ProgramReport(f"{tag}insert[Q={requests},T={engine.prefill_buckets[-1]}]", "rollout",
                          calls_scale * -(-prompts // rows), 0.0),
            lambda: engine.lower_insert_requests(decode_state, cache, logits, requests, sampling, pauses),
            lambda c: state_bytes)
      calls_at = decode_calls(engine, P, R)  # the bound's calls: slots starting at P rows (shorter prompts: fewer rows)
      budgets = [(b, calls_at.get(b, 0)) for b in engine.page_budgets]
      for page_budget, calls in budgets[-1:] if largest_only else budgets:
        run(ProgramReport(f"{tag}{decode_name(page_budget)}", "rollout", calls_scale * calls,
                          2.0 * n_params * B * engine.steps_per_call),
            lambda b=page_budget: engine.lower_decode(sample_params, decode_state, b, sampling, pauses=pauses),
            lambda c: rollout_weights + state_bytes)

    train_sampling = sampling_lib.from_config(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
    rows = prefill_rows(B, n, cfg.train.batch_prompts)
    requests = budget_lib.next_pow2(min(B, cfg.train.batch_prompts * n))
    rollout_programs("", train_sampling, rows, requests, waves, cfg.train.batch_prompts)
    aot_tools.continue_programs(cfg, engine, run, ProgramReport, sample_params, decode_state, train_sampling, waves,
                                2.0 * n_params, rollout_weights + state_bytes)
    aot_rollout.rung_programs(engine, run, ProgramReport, sample_params, decode_state, train_sampling, 2.0 * n_params,
                              rollout_weights + state_bytes, aot_tools.pause_count(cfg))
    rollout_costs = aot_rollout.rollout_at_profiles(cfg, tgt, reports, decode_state, rollout_weights, engine)
    if one_step_decode:  # for comparison: a call of one step at the top page budget (no program of the run)
      run(ProgramReport("decode_1_step", "rollout", 0, 2.0 * n_params * B),
          lambda: engine.lower_decode(sample_params, decode_state, None, train_sampling, num_steps=1),
          lambda c: rollout_weights + state_bytes)
    if validation and cfg.data.val and cfg.eval_every:
      val_prompts = cfg.data.val_max_examples or B
      if not cfg.data.val_max_examples:
        notes.append(f"validation programs are compiled for {B} prompts at once (the slots; set "
                     "data.val_max_examples for the real count)")
      # Validation runs the same prefill and decode functions with more prompts at once and greedy sampling:
      # its largest shapes are compiled (the other buckets and page budgets differ from them only in size).
      rollout_programs("val_", sampling_lib.Greedy(), prefill_rows(min(B, val_prompts), 1, val_prompts),
                       budget_lib.next_pow2(min(B, val_prompts)), 0.0, val_prompts, largest_only=True)

  # -- update phase ----------------------------------------------------------------------------
  batch_bytes = updates * per_chip_bytes(minibatch)
  if group != "rollout":
    mb_tokens = mb_rows * (P + R)
    logprob_in = {k: minibatch[k] for k in ("input_ids", "attention_mask", "loss_mask")
                  + tuple(f.name for f in batch_lib.PACKED_FIELDS) if k in minibatch}
    passes = logprob_passes if not has_base else int(programs_lib.needs_old_logprobs(cfg))
    run(ProgramReport("logprobs", "update", updates * passes, 2.0 * n_params * mb_tokens),
        lambda: progs.logprob_fn.lower(state.params, minibatch, *base),
        lambda c: params_bytes + base_bytes + per_chip_bytes(logprob_in) + per_chip_bytes(outputs_of(c)))
    if has_base and programs_lib.needs_frozen_ref(cfg):  # the reference is the base without adapters: its own program
      run(ProgramReport("ref_logprobs", "update", updates, 2.0 * n_params * mb_tokens),
          lambda: progs.ref_logprob_fn.lower(base[0], minibatch, adapters_lib.NO_BASE),
          lambda c: base_bytes + per_chip_bytes(logprob_in) + per_chip_bytes(outputs_of(c)))
    if progs.value_fn is not None:
      critic_bytes = per_chip_bytes(state.critic_params) + base_bytes
      run(ProgramReport("values", "update", updates, 2.0 * n_params * mb_tokens),
          lambda: progs.value_fn.lower(state.critic_params, minibatch, *base),
          lambda c: critic_bytes + per_chip_bytes(logprob_in) + per_chip_bytes(outputs_of(c)))
    if progs.step_inputs is not None:
      step_batch = [minibatch] * updates
      run(ProgramReport("step_inputs", "update", 1, 0.0), lambda: progs.step_inputs.lower(step_batch),
          lambda c: per_chip_bytes(step_batch) + per_chip_bytes(outputs_of(c)))
    critic_factor = 2.0 if progs.value_fn is not None else 1.0
    ends_step = programs_lib.ends_step_shape(mesh)
    # The model's FLOPs per token: 6N with weight gradients, 4N for a LoRA run's frozen base (forward and the
    # activations' gradient; the adapters' own are a rank-I sliver).
    flops_per_token = (4.0 if has_base else 6.0) * n_params
    run(ProgramReport("train_step", "update", updates, flops_per_token * mb_tokens * critic_factor),
        lambda: progs.train_step.lower(state, minibatch, ends_step, *base),
        lambda c: per_chip_bytes(state) + per_chip_bytes(minibatch) + base_bytes)

  resident = {"rollout": {**weights_resident(cfg, state, base_bytes), "rollout weights": rollout_weights,
                          "decode state (KV cache)": state_bytes},
              "update": {**weights_resident(cfg, state, base_bytes), "step batch (mini-batches)": batch_bytes}}
  if group == "trainer":  # it holds the rollout weights it pushes (staged in the sample layout) beside its state
    resident = {"update": {**weights_resident(cfg, state, base_bytes), "rollout weights (staged for the push)":
                           rollout_weights, "step batch (mini-batches)": batch_bytes}}
  elif group == "rollout":  # the rollout's own devices: the pushed weights and the KV cache
    resident = {"rollout": {"rollout weights": rollout_weights, "decode state (KV cache)": state_bytes}}
  if has_base:
    notes.append("LoRA: the base weights are frozen (no optimizer state) and are the frozen reference (no copy); the "
                 "rollout weights are the merged W + scale·AB (to_sample_params)")
  if tgt.unit == "GPU":
    notes.append("compiled for GPUs on a host without one: nothing is autotuned (default kernel tiles), so no times; "
                 "cuDNN attention's matmuls (custom calls) are not in the compiled FLOPs")
  uncosted = [p.name for p in reports if p.uncosted]
  if uncosted:
    notes.append(f"the compiler gave no time for a few small instructions of {', '.join(uncosted)} (left out)")
  unknown = sum(loop.trip_count is None for p in reports for loop in p.loops)
  if unknown:
    notes.append(f"{unknown} loops without a readable trip count are counted once")
  profiles = []
  if group != "rollout" and cfg.compile.length_profile:
    profiles = update_at_profiles(cfg, mesh, lora_base, reports, log)
  return Report(config_name="", target=tgt, mesh_shape=dict(mesh.shape), programs=reports, resident=resident,
                notes=notes, profiles=profiles, rollout_costs=rollout_costs, packed=bool(cfg.train.packing))


# ----------------------------------------------------------------------------------------------
# The update phase at length profiles (`compile.length_profile`)


def update_cycles(reports: list[ProgramReport]) -> float:
  """Estimated cycles per chip of one step's update phase (loops applied): each update program's cycles x its calls
  per step (log-prob and value passes, step inputs, optimizer updates)."""
  return sum(p.calls * p.cycles for p in reports if p.phase == "update" and not p.error)


def update_programs(cfg: ml_collections.ConfigDict, mesh, lora_base, packed_rows: int,
                    log: Callable[[str], None], merge: int = 1) -> list[ProgramReport]:
  """The update phase's programs of `cfg` compiled at `packed_rows` packed rows (0: the config's own layout's top;
  padded when `cfg.train.packing` is off), `merge` micro-batches in each packed one: their reports (not part of the
  run's memory report)."""
  state, _, _, progs = abstract_run(cfg, mesh, lora_base)
  base = (lora_base[1],)
  has_base = bool(jax.tree.leaves(base))
  minibatch = programs_lib.minibatch_shapes(cfg, mesh, packed_rows, merge)
  updates = programs_lib.updates_per_step(cfg)
  passes = (int(programs_lib.needs_old_logprobs(cfg)) + int(programs_lib.needs_frozen_ref(cfg)) if not has_base
            else int(programs_lib.needs_old_logprobs(cfg)))
  todo = [("logprobs", updates * passes, lambda: progs.logprob_fn.lower(state.params, minibatch, *base))]
  if has_base and programs_lib.needs_frozen_ref(cfg):
    todo.append(("ref_logprobs", updates,
                 lambda: progs.ref_logprob_fn.lower(base[0], minibatch, adapters_lib.NO_BASE)))
  if progs.value_fn is not None:
    todo.append(("values", updates, lambda: progs.value_fn.lower(state.critic_params, minibatch, *base)))
  ends_step = programs_lib.ends_step_shape(mesh)
  todo.append(("train_step", updates, lambda: progs.train_step.lower(state, minibatch, ends_step, *base)))
  out = []
  for name, calls, lower in todo:
    if not calls:
      continue
    report = ProgramReport(name, "update", calls, 0.0)
    how = f"packed, {merge} micro-batches in {packed_rows} rows" if cfg.train.packing else "padded"
    log(f"compiling {name} ({how}) ...")
    with jax.set_mesh(mesh), persistent_cache_off():
      measure(report, lower, lambda c: 0.0)
    out.append(report)
  return out


def update_at_profiles(cfg: ml_collections.ConfigDict, mesh, lora_base, reports: list[ProgramReport],
                       log: Callable[[str], None]) -> list[dict]:
  """The update phase per step (estimated cycles per chip) padded, and packed at `max` and at the config's
  `compile.length_profile`: [{profile, layout, rows, real_share, packed_share, cycles, mean_prompt,
  mean_response, seconds, run}]: `seconds` the run's update phase's compiler time scaled by the cycles, `run` the
  entries of the run's own layout (padded, or packed at each profile). The run's own programs (`reports`) are one
  of them."""
  padded_cfg, packed_cfg = copy.deepcopy(cfg), copy.deepcopy(cfg)
  padded_cfg.train.packing, packed_cfg.train.packing = False, True
  layout = programs_lib.batch_layout(packed_cfg, mesh)
  batch_rows = cfg.train.batch_prompts * cfg.rollout.n  # the step's rows: its micro-batches share one rung
  own = update_cycles(reports)
  out = [{"profile": "any", "layout": "padded", "rows": layout.m, "real_share": None, "packed_share": 1.0,
          "cycles": own if not cfg.train.packing else update_cycles(
              update_programs(padded_cfg, mesh, lora_base, 0, log))}]
  for profile in dict.fromkeys([length_profile.MAX, length_profile.resolve(cfg.compile.length_profile)]):
    rows = length_profile.step_rows(profile, layout, batch_rows, cfg.rollout.n, seed=cfg.seed)
    top = rows.rows == layout.row_ladder[-1] and rows.merge == 1
    cycles = own if (cfg.train.packing and top) else \
        update_cycles(update_programs(packed_cfg, mesh, lora_base, rows.rows, log, rows.merge))
    out.append({"profile": profile.name, "layout": "packed", "rows": rows.rows, "merge": rows.merge,
                "real_share": rows.real_share,
                "packed_share": rows.packed_share, "cycles": cycles, "mean_prompt": rows.mean_prompt,
                "mean_response": rows.mean_response})
  seconds = sum(p.calls * (p.optimal_s or 0.0) for p in reports if p.phase == "update")  # the run's update phase
  for entry in out:
    entry["seconds"] = seconds * entry["cycles"] / own if own else None
    entry["run"] = (entry["layout"] == "packed") == bool(cfg.train.packing)
  return out


def main(cfg: ml_collections.ConfigDict, config_name: str = "", log=print) -> int:
  """The `--compile_only` CLI: prints the report; exit status 0 if the run fits, 1 if not, 2 if the target
  cannot be compiled for here."""
  try:
    tgt = target(cfg)
  except (TargetUnavailable, RuntimeError, ValueError) as e:
    log(f"compile only: {e}")
    return 2
  report = compile_run(cfg, tgt, log=lambda s: log(s))
  report.config_name = config_name
  log(format_report(report))
  return 0 if report.fits else 1

