"""The decode call compiled ahead of time for a small TPU slice (libtpu compiles for a topology on a CPU host):
it reads and writes the paged KV cache in place at any page budget, never re-lays it out or copies it whole, and
writes every slot's new row without a serial loop over slots."""


import jax.numpy as jnp
import pytest
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import families as registry
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import sampling
from pacs_jax.compile import aot_measure, hlo_cost

# The tiny model with Qwen2.5's head_dim of 128 (the TPU lane width) and one kv head per chip (K = 2 over
# tensor = 2), as the 3B model on its v5p slice: the case where a cache laid out [slots, rows, kv_heads,
# head_dim] was converted whole on entry to every decode call.
CONFIG = registry.preset("tiny", head_dim=128, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
SLOTS, PREFILL, DECODE, PAGE = 64, 64, 448, 64


@pytest.fixture(scope="module")
def tpu_mesh():
  # Programs compiled for a topology without a TPU client cannot be read back from the persistent cache.
  with aot_measure.persistent_cache_off():
    yield sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=sharding.tpu_topology_devices("v5p:2x2x1"))


def make_engine(mesh, steps: int, slot_rungs: int = 1):
  model = nnx.eval_shape(lambda: registry.causal_lm(CONFIG, rngs=nnx.Rngs(0)))
  return engine_lib.Engine(model, max_concurrent_decodes=SLOTS, max_prefill_length=PREFILL, max_decode_length=DECODE,
                           mesh=mesh, steps_per_call=steps, page_size=PAGE, slot_rungs=slot_rungs)


def compile_decode(mesh, steps: int, page_budget: int | None):
  engine = make_engine(mesh, steps)
  state = engine.abstract_decode_state()
  cache_bytes = aot_measure.per_chip_bytes(state.cache.pages)
  compiled = engine.lower_decode(engine.abstract_params(), state, page_budget, sampling.Temperature(1.0)).compile()
  cost = compiled.cost_analysis()
  return compiled, (cost[0] if isinstance(cost, list) else cost), cache_bytes, engine.policy.clamp(page_budget)


@pytest.mark.parametrize("page_budget", [None, 128, 16, 64],
                         ids=["every_page", "128_pages", "16_pages", "64_pages"])
def test_decode_updates_the_cache_in_place(tpu_mesh, page_budget):
  one, one_cost, cache_bytes, page_budget = compile_decode(tpu_mesh, 1, page_budget)
  many, many_cost, _, _ = compile_decode(tpu_mesh, 16, page_budget)
  rows = (SLOTS // 2 * (PREFILL + DECODE) // PAGE + 1) * PAGE  # a shard's pool: every slot's pages and a null page
  assert cache_bytes == 2 * CONFIG.num_hidden_layers * rows * 1 * CONFIG.head_size * 2
  # No per-slot serial loop (a while of SLOTS / 2 or SLOTS trips per step) writes the cache, and the layers run
  # unrolled on the kernel (models/layers.py's decode_unroll): the only loop is the chunk's steps.
  for compiled, steps in ((one, 1), (many, 16)):
    trips = [loop.trip_count for loop in hlo_cost.analyse(compiled.as_text()).loops]
    assert trips == [steps], trips
  one, many = one.memory_analysis(), many.memory_analysis()
  # The step gathers its live pages (`page_budget` a shard, [ps, 2K / tensor, H] each) into a temporary.
  gathered = page_budget * PAGE * 1 * 2 * CONFIG.head_size * 2
  for mem in (one, many):
    # The cache is donated and aliased to the output, and no temporary holds a copy of its k or v.
    assert mem.alias_size_in_bytes >= cache_bytes
    assert mem.temp_size_in_bytes < cache_bytes / 4 + 2 * gathered, (mem.temp_size_in_bytes, cache_bytes)
  # The compiler counts a while body once: a 16-step call accesses about the bytes of one step unless
  # work outside the loop (a whole-cache layout conversion on entry and exit) grows with the cache. (At
  # these tiny shapes its time estimate, optimal_seconds, is not positive; bytes accessed is the same test.)
  assert many_cost["bytes accessed"] <= 1.5 * one_cost["bytes accessed"]
  assert many_cost["bytes accessed"] < one_cost["bytes accessed"] + cache_bytes


def test_insert_writes_prompt_pages_in_place(tpu_mesh):
  """Inserting prefilled prompts scatters their rows into the donated pages: no copy of the page pool."""
  engine = make_engine(tpu_mesh, 16)
  state = engine.abstract_decode_state()
  pages_bytes = aot_measure.per_chip_bytes(state.cache.pages)
  params = engine.abstract_params()
  B = 8
  cache, logits = aot_measure.outputs_of(engine.lower_prefill(params, B, PREFILL).compile())
  compiled = engine.lower_insert_requests(state, cache, logits, B, sampling.Temperature(1.0)).compile()
  mem = compiled.memory_analysis()
  assert mem.alias_size_in_bytes >= pages_bytes
  assert mem.temp_size_in_bytes < pages_bytes / 4, (mem.temp_size_in_bytes, pages_bytes)


def test_a_slot_rung_decodes_fewer_slots_in_place(tpu_mesh):
  """The slot ladder's rung of 16 slots (8 a shard) gathers them from the 64 and scatters them back: the page pool
  stays donated and aliased (no copy of it), and the step's matmuls and bytes shrink with the slots."""
  engine = make_engine(tpu_mesh, 16, slot_rungs=3)
  assert engine.slot_rungs == (16, 32, 64)
  state = engine.abstract_decode_state()
  cache_bytes = aot_measure.per_chip_bytes(state.cache.pages)
  lower = lambda rung: engine.lower_decode(engine.abstract_params(), state, None, sampling.Temperature(1.0),
                                           rung=rung).compile()
  full, rung = lower(None), lower(16)
  mem = rung.memory_analysis()
  assert mem.alias_size_in_bytes >= cache_bytes
  assert mem.temp_size_in_bytes < cache_bytes / 4, (mem.temp_size_in_bytes, cache_bytes)
  cost = lambda c: (lambda x: x[0] if isinstance(x, list) else x)(c.cost_analysis())
  assert cost(rung)["flops"] < 0.5 * cost(full)["flops"]
  with pytest.raises(ValueError, match="slot ladder"):
    lower(8)
