"""The trainer's train step compiled ahead of time for a TPU v5p topology (libtpu, no TPU) with splash attention
(`model.attention_impl="auto"` on TPU): the Pallas kernels are in the program, their FLOPs are counted, and
the released remat policy ("matmuls") runs no weight matmul or attention kernel twice."""

import importlib.util
import os
import re

import jax
import pytest

from pacs_jax import config as config_lib
from pacs_jax.compile import hlo_cost

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def benchmark():
  spec = importlib.util.spec_from_file_location("train_step_compile_tpu",
                                                os.path.join(ROOT, "benchmarks", "train_step_compile_tpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def tiny_tpu_config(remat_policy: str):
  c = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  c.hardware.tpu_topology, c.hardware.num_devices, c.hardware.hbm_gb = "v5p:2x2x1", 4, 95.0
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 2, 2
  c.model.dtype, c.model.remat, c.model.remat_policy = "bfloat16", True, remat_policy
  c.data.max_prompt_length, c.rollout.max_new_tokens = 64, 192  # 256-token rows: 2 x 2 splash blocks of 128
  c.train.batch_prompts, c.train.mini_batch_prompts, c.train.micro_batch_prompts = 2, 2, 1
  return c


@pytest.fixture(scope="module")
def compiled_steps():
  bench = benchmark()
  out = {}
  for policy in ("matmuls", "nothing"):
    with jax.default_matmul_precision("default"):  # the trainer's (conftest sets "highest" for CPU equality tests)
      report, compiled, _, _ = bench.compile_train_step(tiny_tpu_config(policy))
    assert compiled is not None, report.error
    out[policy] = report, compiled.as_text()
  return out


def kernel_calls(hlo: str, kind: str) -> int:
  """Splash kernel instructions of a kind ("fwd", "dq", "dkv") in the compiled program (each in the layer scan's body)."""
  return len(re.findall(rf"%splash_mha_{kind}_\w*(?:\.\d+)? = .*custom_call_target=\"tpu_custom_call\"", hlo))


def test_train_step_compiles_with_splash_kernels_counted(compiled_steps):
  report, hlo = compiled_steps["matmuls"]
  # The forward kernel once (its residuals are saved, not recomputed) and each backward kernel (dq, dkv) once.
  assert kernel_calls(hlo, "fwd") == 1 and kernel_calls(hlo, "dq") == 1 and kernel_calls(hlo, "dkv") == 1
  costs = hlo_cost.analyse(hlo)
  # Per chip and micro-batch: 4 rows (8 responses over fsdp = 2) of 256 tokens, 2 of the 4 heads (tensor = 2),
  # head dim 16, 3 of the 4 (128 x 128) blocks causal; 2 layers x 2 micro-batches; forward 2 matmuls per
  # block, backward 3 (dq kernel) + 4 (dkv kernel).
  per_call = 2.0 * 128 * 128 * 16 * 3 * 2 * 4  # one matmul over the causal blocks
  assert costs.total("kernel_flops") == pytest.approx((2 + 3 + 4) * per_call * 2 * 2)
  assert report.flops > report.raw_flops + costs.total("kernel_flops") * 0.99
  assert report.peak < 95e9


def test_matmuls_remat_policy_runs_no_matmul_twice(compiled_steps):
  # Weight-matmul FLOPs (XLA's dots; attention is in the kernels) per 6 N per token: 1.01 with the "matmuls"
  # policy (the log-prob head's chunked logits are recomputed), 1.25 with "nothing", which re-runs the layers'
  # forward matmuls and the forward kernel.
  dots = {p: hlo_cost.analyse(hlo).total("flops") / report.model_flops for p, (report, hlo) in compiled_steps.items()}
  assert dots["matmuls"] < 1.05 and dots["nothing"] > dots["matmuls"] + 0.2, dots
  assert kernel_calls(compiled_steps["nothing"][1], "fwd") == 2
