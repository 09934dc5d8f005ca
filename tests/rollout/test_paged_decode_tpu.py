"""The paged decode call compiled ahead of time for a small TPU v5p slice (libtpu, no TPU): attention runs in
the Pallas ragged paged attention kernel per shard, and the pages are written and read in place."""

import math
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import families as registry
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import sampling
from pacs_jax.compile import aot_measure, hlo_cost

# Qwen2.5's head_dim of 128 and one kv head per chip (K = 2 over tensor = 2), as the 3B model on its slice.
CONFIG = registry.preset("tiny", head_dim=128, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, attention_impl="auto")
SLOTS, PREFILL, DECODE, PAGE = 64, 64, 448, 16


@pytest.fixture(scope="module")
def compiled():
  with aot_measure.persistent_cache_off():
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=sharding.tpu_topology_devices("v5p:2x2x1"))
    model = nnx.eval_shape(lambda: registry.causal_lm(CONFIG, rngs=nnx.Rngs(0)))
    engine = engine_lib.Engine(model, max_concurrent_decodes=SLOTS, max_prefill_length=PREFILL,
                               max_decode_length=DECODE, mesh=mesh, steps_per_call=4, page_size=PAGE)
    state = engine.abstract_decode_state()
    program = engine.lower_decode(engine.abstract_params(), state, None, sampling.Temperature(1.0)).compile()
  assert engine.decode_kernel and engine.page_budgets == (SLOTS // 2 * engine.pages_per_slot,)  # one program
  return program, aot_measure.per_chip_bytes(state.cache.pages)


def gathered_elements(hlo_text: str) -> list[int]:
  """Result sizes (elements) of the program's all-gathers."""
  shapes = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo_text)
  return [math.prod(int(d) for d in dims.split(",") if d) for dims in shapes]


def test_decode_attends_in_the_pallas_kernel_per_shard(compiled):
  program, pool_bytes = compiled
  text = program.as_text()
  assert "tpu_custom_call" in text and "ragged_paged_attention" in text  # the kernel
  # Each shard reads its own pool: what is gathered is per-slot bookkeeping (sampling over the tensor-split
  # vocab, the host's outputs), never pages: less than one page of one layer.
  page_elements = PAGE * 2 * CONFIG.num_key_value_heads * CONFIG.head_size
  assert max(gathered_elements(text), default=0) < page_elements


def test_pages_are_written_in_place_without_per_slot_loops(compiled):
  program, pool_bytes = compiled
  mem = program.memory_analysis()
  # The pages are donated and aliased to the output; no temporary holds a copy of them.
  assert mem.alias_size_in_bytes >= pool_bytes
  assert mem.temp_size_in_bytes < pool_bytes / 4, (mem.temp_size_in_bytes, pool_bytes)
  # Loops: the decode steps and the layers only; the KV write is one scatter, not a loop over slots.
  trips = sorted(loop.trip_count for loop in hlo_cost.analyse(program.as_text()).loops)
  assert SLOTS not in trips and SLOTS // 2 not in trips, trips
