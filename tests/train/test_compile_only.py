"""`--compile_only`: the tiny model's programs compiled ahead of time for a small TPU topology (libtpu, no TPU),
with the released settings (bf16, remat, attention chunks, micro-batches); figures positive and consistent;
the same programs the trainer runs; a config that does not fit exits non-zero before any weights load."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.compile import aot, aot_report
from pacs_jax.compile.aot_report import step_seconds
from pacs_jax.trainer import loop, packing as batching
from pacs_jax.trainer import programs as programs_lib
from tests.compile_report import assert_every_program_compiled, by_name
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY_TPU = """
import sys
sys.path.insert(0, {configs!r})
from tiny_cpu import get_config as tiny


def get_config():
  c = tiny()
  c.hardware.tpu_topology = "v5p:2x2x1"  # one v5p host: 4 chips
  c.hardware.num_devices, c.hardware.num_processes, c.hardware.hbm_gb = 4, 1, 95.0
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 2, 2
  c.model.dtype, c.model.remat, c.model.attention_chunk = "bfloat16", True, 16  # the released settings
  c.data.max_prompt_length, c.rollout.max_new_tokens = 32, 64
  c.train.batch_prompts, c.train.mini_batch_prompts, c.train.micro_batch_prompts = 8, 4, 2
  c.rollout.slots = 32
  c.eval_every = 0
  c.compile.length_profile = ""  # the update at length profiles: compiled by the `report` fixture alone
  return c
"""


@pytest.fixture(scope="module")
def tiny_tpu_config(tmp_path_factory):
  path = tmp_path_factory.mktemp("configs") / "tiny_tpu.py"
  path.write_text(TINY_TPU.format(configs=os.path.join(ROOT, "configs")))
  return str(path)


@pytest.fixture(scope="module")
def report(tiny_tpu_config):
  cfg = config_lib.load_config_file(tiny_tpu_config, {"compile.length_profile": "rlvr"})
  with jax.default_matmul_precision("default"):  # the trainer's: Mosaic (splash attention) takes bf16 only so
    return aot.compile_run(cfg), cfg


def test_every_program_compiles_with_positive_consistent_figures(report):
  report, cfg = report
  assert_every_program_compiled(report)
  for p in report.programs:
    assert 0 <= p.resident <= p.peak + 1e6, p  # resident arguments/outputs are part of what it holds
    assert p.optimal_s > 0, p
  for p in by_name(report, "prefill") + by_name(report, "decode") + by_name(report, "logprobs") + \
      by_name(report, "train_step"):
    # Loops applied: never below the compiler's count-once figure; at least the model's matmul FLOPs.
    assert p.flops >= p.raw_flops > 0 and p.flops >= p.model_flops > 0, p
  # Donation: the decode state is updated in place (aliased), not copied.
  decode = by_name(report, "decode")[0]
  assert decode.alias >= report.resident["rollout"]["decode state (KV cache)"] * 0.99


def test_the_update_is_costed_padded_and_packed_at_max_and_rlvr(report):
  """Issue 42: the update phase per step (estimated cycles, loops applied) padded and packed at both profiles, the
  run's own programs one of them; at `rlvr` packed rows take fewer rows and cost less than the padded ones."""
  report, cfg = report
  got = {(p["layout"], p["profile"]): p for p in report.profiles}
  assert set(got) == {("padded", "any"), ("packed", "max"), ("packed", "rlvr")}
  padded, at_max, rlvr = got["padded", "any"], got["packed", "max"], got["packed", "rlvr"]
  assert padded["cycles"] == pytest.approx(aot.update_cycles(report.programs))  # the run (padded) is one of them
  assert at_max["rows"] == padded["rows"] == 16 and at_max["real_share"] == 1.0
  assert rlvr["rows"] < 16 and rlvr["real_share"] < 0.6 and rlvr["cycles"] < padded["cycles"]
  assert 0.9 * padded["cycles"] < at_max["cycles"] < 1.1 * padded["cycles"]
  text = aot.format_report(report)
  assert "update phase per step by length profile" in text and "packed at rlvr" in text
  # The whole RL step at each profile (the run is padded: its update the padded one's time at both).
  assert padded["run"] and not rlvr["run"] and padded["seconds"] == pytest.approx(step_seconds(report, "update"))
  steps = {e["profile"]: e for e in aot_report.rl_step_estimates(report)}
  assert set(steps) == {"max", "rlvr"} and steps["rlvr"]["rollout_s"] < steps["max"]["rollout_s"]
  for e in steps.values():
    assert e["update_s"] == pytest.approx(padded["seconds"]) and e["sync_s"] == pytest.approx(e["update_s"] + e["rollout_s"])
    assert e["overlapped_s"] is None
  assert "whole RL step by length profile" in text


def test_the_rollout_estimate_counts_the_paged_kernels_reads(report):
  """Issue 42: the rollout per step at `max` and `rlvr` is the compiler's decode time outside the paged kernel plus the
  live KV rows the kernel reads (which the compiler gives no time) at the HBM rate, beside its roofline."""
  from pacs_jax.compile import length_profile, rollout_cost
  report, cfg = report
  costs = {c.profile: c for c in report.rollout_costs}
  assert set(costs) == {"max", "rlvr"}
  top = by_name(report, "decode")[-1]
  for name, c in costs.items():
    prompts, responses = length_profile.sample(length_profile.resolve(name), cfg.train.batch_prompts, cfg.rollout.n,
                                               cfg.data.max_prompt_length, cfg.rollout.max_new_tokens, cfg.seed)
    live, busy = rollout_cost.schedule(prompts, responses, cfg.rollout.slots)
    assert c.steps == len(live) and c.tokens == responses.sum() and c.kernel_bytes > 0 and c.kernel_s > 0
    assert c.outside_s == pytest.approx(c.steps * top.optimal_s / 16)  # 16 steps a call
    assert c.estimate_s == c.outside_s + c.kernel_s and c.roofline_s < c.estimate_s
    # The live rows' K and V, every layer, in the compute dtype (bf16), split over the 4 chips.
    mc = config_lib.model_config(cfg)
    assert c.kernel_bytes == pytest.approx(live.sum() * mc.num_hidden_layers * 2 * mc.num_key_value_heads *
                                           mc.head_size * 2 / 4)
  # Every slot busy at max (all responses as long), fewer at rlvr's mixed lengths; fewer steps.
  assert costs["max"].mean_busy == cfg.rollout.slots and costs["rlvr"].steps < costs["max"].steps
  text = aot.format_report(report)
  line = next(l for l in text.splitlines() if l.strip().startswith("rlvr:") and "decode steps" in l)
  assert "in it (" in line and "GB of live KV rows" in line and "roofline" in line


def _compiler() -> dict:
  from importlib import metadata
  return {name: metadata.version(name) for name in ("jaxlib", "libtpu")}


def test_the_programs_are_the_ones_compiled_before_the_issue_30_refactor(report):
  """Every program's memory and cost figures equal those recorded when they were first compiled (c79c4a7): a
  change meant to keep behaviour (a refactor, a rename) keeps the compiled programs identical. A change that means
  to alter a program updates tests/fixtures/compiled_tiny_tpu_pacs.json with the new figures, saying why.

  Exact on the compiler that recorded them (the fixture's `compiler`); under another jaxlib or libtpu, whose
  fusion and layout choices move temporaries and byte counts, the programs' structure: the same programs, the same
  argument, output and donated bytes (shapes and shardings), FLOPs within 5% and temporaries and bytes within 2x."""
  report, _ = report
  with open(os.path.join(ROOT, "tests", "fixtures", "compiled_tiny_tpu_pacs.json")) as f:
    fixture = json.load(f)
  recorded = fixture["programs"]
  got = {p.name: {"arg": p.argument, "out": p.output, "alias": p.alias, "temp": p.temp, "flops": p.flops,
                  "bytes": p.bytes_accessed} for p in report.programs}
  if _compiler() == fixture["compiler"]:
    assert got == recorded
    return
  assert got.keys() == recorded.keys()
  for name, want in recorded.items():
    have = got[name]
    assert {k: have[k] for k in ("arg", "out", "alias")} == {k: want[k] for k in ("arg", "out", "alias")}, name
    assert have["flops"] == pytest.approx(want["flops"], rel=0.05), name
    for key in ("temp", "bytes"):
      assert want[key] / 2 <= have[key] <= 2 * want[key] + 1e6, (name, key, have[key], want[key])


def test_loop_trip_counts_come_from_the_compiled_programs(report):
  report, cfg = report
  layers = 2  # the tiny preset
  train = by_name(report, "train_step")[0]
  trips = [loop.trip_count for loop in train.loops]
  assert None not in trips
  micro = programs_lib.micro_batches(cfg)
  # The micro-batch scan runs the layer scan (forward, and the backward's recompute) inside it.
  assert micro in trips and layers in trips
  assert max(loop.multiplier for loop in train.loops) >= micro * layers
  decode = by_name(report, "decode")[0]
  assert 16 in [loop.trip_count for loop in decode.loops]  # steps_per_call
  assert decode.flops >= 16 * decode.raw_flops * 0.9  # 16 steps, each counted once by the compiler


def test_resident_totals_and_verdict(report):
  report, cfg = report
  for phase in ("rollout", "update"):
    total, largest = report.phase_total(phase)
    assert total >= sum(report.resident[phase].values()) > 0 and largest is not None
  assert report.resident["update"]["frozen reference"] == report.resident["update"]["policy params"]
  assert report.fits
  text = aot.format_report(report)
  assert "fits in 95 GB per chip" in text and "train step compile:" in text


def test_compile_only_builds_the_programs_the_trainer_runs(report, tmp_path):
  """The trainer on 4 CPU devices: its mini-batches and state shardings are the ones compile_only compiles for,
  and its train step lowers to the same program from real arrays as from compile_only's abstract ones."""
  _, cfg = report
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  cfg.mesh.fsdp, cfg.mesh.tensor = 2, 2
  cfg.model.remat, cfg.model.attention_chunk = True, 4
  cfg.train.micro_batch_prompts = 2
  trainer = loop.Trainer(cfg, str(tmp_path), devices=jax.devices()[:4])
  seen, flags = {}, []

  def record(state, minibatch, ends_step, base):  # base: the run's frozen part, empty in a full run
    seen.update(minibatch)
    flags.append(bool(ends_step))
    return state, {"loss": 0.0, "skipped_updates": 0.0}

  programs = trainer.programs
  trainer.programs = dataclasses.replace(programs, train_step=record)
  rows = cfg.train.batch_prompts * cfg.rollout.n
  P, R = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
  rb = batching.PackedRollout(np.ones((rows, P + R), np.int32), np.ones((rows, P + R), np.int32),
                              np.ones((rows, R), np.float32), np.zeros((rows,), np.float32), ["s"] * rows,
                              ["eos"] * rows)
  trainer.update(rb)
  expected = programs_lib.minibatch_shapes(cfg, trainer.mesh)
  assert sorted(seen) == sorted(expected)
  assert flags == [False] * (len(flags) - 1) + [True]  # the step's last update ends it
  for name, spec in expected.items():
    got = seen[name]
    assert (got.shape, got.dtype) == (spec.shape, spec.dtype), name
    assert got.sharding.is_equivalent_to(spec.sharding, got.ndim), name
  _, _, abstract = programs_lib.abstract_train_state(cfg, trainer.mesh)
  for got, spec in zip(jax.tree.leaves(trainer.state), jax.tree.leaves(abstract), strict=True):
    assert (got.shape, got.dtype) == (spec.shape, spec.dtype)
    assert got.sharding.is_equivalent_to(spec.sharding, got.ndim)
  flag = programs_lib.ends_step(trainer.mesh, True)
  real = programs.train_step.lower(trainer.state, seen, flag, trainer.base).as_text()
  flag_shape = programs_lib.ends_step_shape(trainer.mesh)
  _, abstract_base = programs_lib.abstract_base(cfg, trainer.mesh)  # the frozen part: empty in a full run
  assert programs.train_step.lower(abstract, expected, flag_shape, abstract_base).as_text() == real


@pytest.fixture(scope="module")
def lora_report(tiny_tpu_config):
  cfg = config_lib.load_config_file(tiny_tpu_config, {"lora.rank": 8, "lora.modules_to_save": ""})
  with jax.default_matmul_precision("default"):
    return aot.compile_run(cfg), cfg


def test_a_lora_run_compiles_every_program_and_holds_less_in_its_update(report, lora_report):
  """LoRA (rank 8, all seven projections): the same programs plus the frozen reference's own log-prob pass, the base
  counted apart from the adapters (only these have Adam moments), no reference copy; less resident in the update
  phase than the full run, and the train step costed at 4N per token (no weight gradient)."""
  full, _ = report
  lora, cfg = lora_report
  assert_every_program_compiled(lora)
  assert [p.name for p in lora.programs] == [p.name if p.name != "train_step" else "ref_logprobs" for p in
                                             full.programs] + ["train_step"]
  update = lora.resident["update"]
  assert set(update) == {"base weights (frozen)", "adapters", "adapter optimizer state", "step batch (mini-batches)"}
  assert 0 < update["adapters"] < update["base weights (frozen)"]
  assert update["adapter optimizer state"] == pytest.approx(2 * update["adapters"], rel=0.01)  # Adam's two moments
  assert sum(update.values()) < sum(full.resident["update"].values())
  # The train step's own resident bytes: the state (adapters + moments), the mini-batch and the base, far below the
  # full run's state (all parameters + moments); the reference pass takes the base alone.
  train, full_train = by_name(lora, "train_step")[0], by_name(full, "train_step")[0]
  assert train.resident < full_train.resident
  assert train.model_flops == pytest.approx(full_train.model_flops * 4 / 6)
  ref = by_name(lora, "ref_logprobs")[0]
  assert ref.argument < by_name(lora, "logprobs")[0].argument
  assert lora.fits and "LoRA: the base weights are frozen" in aot.format_report(lora)


def run_cli(*args, env=None):
  return subprocess.run([sys.executable, "-m", "pacs_jax.train", *args], capture_output=True, text=True, timeout=900,
                        env={**os.environ, "XLA_FLAGS": child_env.xla_flags(), **(env or {})})


def test_a_config_that_does_not_fit_exits_nonzero_naming_the_program_and_its_size(tiny_tpu_config, tmp_path):
  # 16M decode slots: the KV cache alone is ~100 GB per chip, more than a v5p's 95 GB. Nothing is loaded (the
  # weights path does not exist), no workdir is made.
  proc = run_cli("--config", tiny_tpu_config, "--compile_only", "--config.rollout.slots=16777216",
                 "--config.model.hf_path=/nonexistent/weights", "--workdir", str(tmp_path / "never"))
  assert proc.returncode == 1, proc.stdout + proc.stderr
  verdict = proc.stdout[proc.stdout.index("DOES NOT FIT in 95 GB per chip"):]
  assert re.search(r"init_decode_state \(rollout\) needs \d+\.\d+ GB per chip", verdict), verdict
  assert re.search(r"decode\[pages=\d+\] \(rollout\) needs \d+\.\d+ GB per chip", verdict), verdict
  assert not (tmp_path / "never").exists()


def test_a_target_that_is_not_here_is_said_plainly():
  # 8 GPUs named by count only (no hardware.gpu_target to compile for): only the GPU machine itself can compile.
  proc = run_cli("--config", os.path.join(ROOT, "configs", "qwen3b_gpu.py"), "--compile_only",
                 "--config.hardware.gpu_target=", "--config.hardware.gpu_topology=")
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "compiles for the target's own backend" in proc.stdout and "--dry_run" in proc.stdout
