"""`--compile_only` for GPUs: the tiny model's programs compiled for 8 abstract H100s (jax's CUDA plugin on this CPU
host, no GPU) by the same code as for TPU slices, with the released settings (bf16, remat, micro-batches); memory
and FLOPs positive and consistent, never a time (nothing is autotuned); the bf16 train step attends with cuDNN; a
config that does not fit returns 1 naming the program and its size per GPU."""

import os
import re

import jax
import pytest

from pacs_jax import config as config_lib
from pacs_jax import gpu_targets
from pacs_jax.compile import aot
from pacs_jax.trainer import programs as programs_lib
from tests.compile_report import assert_every_program_compiled, by_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDNN_ATTENTION = "__cudnn$fmha"  # XLA's custom-call targets of cuDNN flash attention (forward, ...Backward)


def tiny_gpu_config(**overrides):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  h = cfg.hardware
  h.gpu_target, h.gpu_topology = "h100-sxm-80gb", "1x1x8"  # one 8-GPU node
  h.num_devices, h.num_processes, h.hbm_gb = 8, 1, 80.0
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 4, 2
  cfg.model.dtype, cfg.model.remat, cfg.model.attention_chunk = "bfloat16", True, 16  # the released settings
  cfg.data.max_prompt_length, cfg.rollout.max_new_tokens = 32, 64
  cfg.train.batch_prompts, cfg.train.mini_batch_prompts, cfg.train.micro_batch_prompts = 8, 4, 2
  cfg.rollout.slots = 32
  cfg.eval_every = 0
  cfg.compile.length_profile = ""  # (the update at length profiles: tests/train/test_compile_only.py)
  for field, value in overrides.items():
    config_lib.set_field(cfg, field, value)
  return cfg


@pytest.fixture(scope="module")
def report():
  cfg = tiny_gpu_config()
  with jax.default_matmul_precision("default"):  # the trainer's
    return aot.compile_run(cfg), cfg


def test_the_target_is_eight_abstract_h100s():
  devices = gpu_targets.devices("h100-sxm-80gb", "1x1x8")
  assert len(devices) == 8 and {d.platform for d in devices} == {"gpu"}
  assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"} and {d.process_index for d in devices} == {0}
  assert [d.process_index for d in gpu_targets.devices("h100-sxm-80gb", "1x2x4")] == [0] * 4 + [1] * 4
  assert gpu_targets.topology_shape("2x1x8") == (2, 1, 8) and gpu_targets.topology_hosts("2x1x8") == 2
  with pytest.raises(ValueError, match="<slices>x<hosts>x<gpus per host>"):
    gpu_targets.topology_shape("8")


def test_every_program_compiles_with_positive_consistent_figures_and_no_time(report):
  report, cfg = report
  assert report.target.unit == "GPU" and len(report.target.devices) == 8
  assert_every_program_compiled(report)
  for p in report.programs:
    assert p.optimal_s is None and p.raw_optimal_s is None, p  # no autotuning without a GPU: never a time
  # Loops applied: never below the compiler's count-once figure; at least the model's weight-matmul FLOPs (cuDNN
  # attention is a custom call, counted as none, and the model's 2N / 6N per token leaves attention out too).
  for p in by_name(report, "prefill") + by_name(report, "decode") + by_name(report, "train_step"):
    assert p.flops >= p.raw_flops > 0 and p.flops >= p.model_flops > 0, p
  # The log-prob pass runs the LM head on the response positions only: 2 V D per prompt token less than 2N.
  logprobs, mc = by_name(report, "logprobs")[0], config_lib.preset_model_config(cfg)
  prompt_tokens = cfg.train.mini_batch_prompts * cfg.rollout.n * cfg.data.max_prompt_length / 8  # per GPU
  assert logprobs.flops >= logprobs.raw_flops > 0, logprobs
  assert logprobs.model_flops >= logprobs.flops >= logprobs.model_flops - 2 * mc.vocab_size * mc.hidden_size * \
      prompt_tokens > 0, logprobs
  decode = by_name(report, "decode")[0]
  assert decode.alias >= report.resident["rollout"]["decode state (KV cache)"] * 0.99  # updated in place
  # The GPU compiler fuses the decode loop's condition and counter: their trip counts are still read.
  assert 16 in [loop.trip_count for loop in decode.loops]  # steps_per_call
  assert decode.flops >= 16 * decode.raw_flops * 0.9
  train = by_name(report, "train_step")[0]
  trips = [loop.trip_count for loop in train.loops]
  assert None not in trips and programs_lib.micro_batches(cfg) in trips and 2 in trips  # micro-batches, layers


def test_the_bf16_train_step_and_log_prob_pass_attend_with_cudnn(report):
  report, _ = report
  train, logprobs = by_name(report, "train_step")[0], by_name(report, "logprobs")[0]
  cudnn = lambda p: [c for c in p.custom_calls if c.startswith(CUDNN_ATTENTION)]
  assert len(cudnn(train)) == 2 and any(c.endswith("Backward") for c in cudnn(train)), train.custom_calls
  assert cudnn(logprobs) and not any(c.endswith("Backward") for c in cudnn(logprobs)), logprobs.custom_calls
  assert not cudnn(by_name(report, "decode")[0])  # the KV-cache passes attend with XLA


def test_the_report_is_per_gpu_with_a_verdict_and_no_time(report):
  report, _ = report
  assert report.fits
  text = aot.format_report(report)
  assert "fits in 80 GB per GPU" in text and "resident per GPU (GB)" in text and "nothing is autotuned" in text
  assert "optimal time" not in text


def test_a_lora_run_compiles_for_the_gpus_and_holds_less_in_its_update(report):
  """LoRA (rank 8) for the same 8 GPUs: every program compiles, the frozen base counted apart from the adapters and
  their Adam moments, no reference copy, and less resident in the update phase than the full run (the tiny model's
  activations, a larger share than a real model's, are not compared)."""
  full, _ = report
  cfg = tiny_gpu_config(**{"lora.rank": 8, "lora.modules_to_save": ""})
  with jax.default_matmul_precision("default"):
    lora = aot.compile_run(cfg)
  assert_every_program_compiled(lora)
  assert {p.name for p in lora.programs} == {p.name for p in full.programs} | {"ref_logprobs"}
  update = lora.resident["update"]
  assert {"base weights (frozen)", "adapters", "adapter optimizer state"} <= set(update)
  assert "frozen reference" in full.resident["update"] and "frozen reference" not in update
  assert sum(update.values()) < sum(full.resident["update"].values())
  assert by_name(lora, "train_step")[0].resident < by_name(full, "train_step")[0].resident
  assert lora.fits


def test_a_config_that_does_not_fit_returns_1_naming_the_program_and_its_size_per_gpu():
  # 2^25 decode slots: the KV cache alone is ~140 GB per GPU. Nothing is loaded (the weights path does not exist).
  cfg = tiny_gpu_config(**{"rollout.slots": 2 ** 25, "model.hf_path": "/nonexistent/weights"})
  lines = []
  with jax.default_matmul_precision("default"):
    assert aot.main(cfg, "tiny_gpu", log=lines.append) == 1
  text = "\n".join(lines)
  verdict = text[text.index("DOES NOT FIT in 80 GB per GPU"):]
  assert re.search(r"init_decode_state needs \d+\.\d+ GB per GPU by itself \(> 80 GB\)", verdict), verdict
  assert re.search(r"decode\[pages=\d+\] needs \d+\.\d+ GB per GPU by itself", verdict), verdict
  assert re.search(r"rollout phase needs \d+\.\d+ GB per GPU > 80 GB", verdict), verdict


def test_without_the_cuda_plugin_compile_only_says_what_to_install(monkeypatch):
  monkeypatch.setattr(gpu_targets, "_installed", lambda module: False)
  monkeypatch.setattr(gpu_targets.shutil, "which", lambda name: None)
  cfg = tiny_gpu_config(**{"hardware.gpu_topology": "1x1x2", "hardware.num_devices": 2})  # not cached yet
  lines = []
  assert aot.main(cfg, "tiny_gpu", log=lines.append) == 2
  assert lines == ["compile only: compiling for a GPU target needs jax's CUDA plugin and ptxas: "
                   'pip install -e ".[gpu-compile]"'], lines
