"""Weight matmuls under FSDP compiled for a TPU v5p slice (libtpu, no TPU): each fsdp-sharded weight is gathered
whole, in 16 bits, before a plain dot, as MaxText's programs do. XLA's partitioner, left to choose, computed the
3B train step's layer and LM-head matmuls as windowed-einsum loops that stream one weight shard per iteration
and re-read the whole partial result each time (a third of the step's estimated cycles, 44 TB per chip per
mini-batch instead of 14); `sharding.matmul_weight` is what prevents it. Qwen2.5-3B's layer and head widths,
one layer and 1,024-token rows, so the same partitioning decisions compile in seconds."""

import os
import re

import jax
import pytest

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.models import qwen2
from pacs_jax.compile import aot
from pacs_jax.compile import aot_measure
from pacs_jax.trainer import programs as programs_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOWED = re.compile(r"^%?\S*windowed_dot_general_body\S* ", re.M)  # the loops' body computations


@pytest.fixture(scope="module")
def compiled():
  preset = "qwen2.5-3b-one-layer"
  qwen2.PRESETS[preset] = qwen2.PRESETS["qwen2.5-3b"].replace(num_hidden_layers=1)
  try:
    c = config_lib.load_config_file(os.path.join(ROOT, "configs", "qwen3b_v5p.py"))
    c.algorithm = "ppo"  # PACS's programs plus PPO's critic: its value pass runs the same backbone
    c.model.preset = preset
    # 16 chips, fsdp 8 x tensor 2 (on 4 chips, fsdp 2 or 4, XLA gathers whole even without the constraint).
    c.hardware.tpu_topology, c.hardware.num_devices, c.hardware.num_processes = "v5p:2x2x4", 16, 4
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 8, 2
    c.data.max_prompt_length, c.rollout.max_new_tokens = 64, 960  # 1,024-token rows
    c.train.batch_prompts, c.train.mini_batch_prompts, c.train.micro_batch_prompts = 4, 4, 4  # 4 rows per chip
    c.rollout.slots = 16
    devices = sharding.tpu_topology_devices(c.hardware.tpu_topology)
    mesh = sharding.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, devices=devices)
    state, _, _, progs = aot.abstract_run(c, mesh)
    _, base = aot.lora_run_base(c, mesh)  # the frozen part every program takes: empty in a full run
    batch = programs_lib.minibatch_shapes(c, mesh)
    ends_step = programs_lib.ends_step_shape(mesh)
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"), aot_measure.persistent_cache_off():
      yield {"train_step": progs.train_step.lower(state, batch, ends_step, base).compile().as_text(),
             "logprobs": progs.logprob_fn.lower(state.params, batch, base).compile().as_text(),
             "values": progs.value_fn.lower(state.critic_params, batch, base).compile().as_text()}
  finally:
    del qwen2.PRESETS[preset]


@pytest.mark.parametrize("program", ["train_step", "logprobs", "values"])
def test_fsdp_weights_are_gathered_whole_not_streamed_through_windowed_einsum_loops(compiled, program):
  hlo = compiled[program]
  loops = WINDOWED.findall(hlo)
  assert not loops, f"{program}: XLA streams fsdp weight shards through {len(loops)} windowed-einsum loops"
  # The gathers are there instead: the layer weights (q, k, v, o, gate, up, down) and the LM head.
  gathered = {m for m in re.findall(r"= bf16\[([\d,]+)\][^ ]* all-gather", hlo)}
  assert gathered, f"{program}: no bf16 all-gather of weights"
