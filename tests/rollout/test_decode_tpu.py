"""The decode call compiled ahead of time for a small TPU slice (libtpu compiles for a topology on a CPU host):
it reads and writes the KV cache (dense or paged) in place, never re-lays it out or copies it whole, and writes
every slot's new row without a serial loop over slots."""


import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import registry
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


def make_engine(mesh, steps: int, kv_cache: str):
  model = nnx.eval_shape(lambda: registry.causal_lm(CONFIG, rngs=nnx.Rngs(0)))
  return engine_lib.Engine(model, max_concurrent_decodes=SLOTS, max_prefill_length=PREFILL, max_decode_length=DECODE,
                           mesh=mesh, steps_per_call=steps, kv_cache=kv_cache, page_size=PAGE)


def compile_decode(mesh, steps: int, window: int | None, kv_cache: str = "dense"):
  engine = make_engine(mesh, steps, kv_cache)
  state = engine.abstract_decode_state()
  cache_bytes = aot_measure.per_chip_bytes(state.cache.pages if engine.paged else (state.cache.k, state.cache.v))
  compiled = engine.lower_decode(engine.abstract_params(), state, window, sampling.Temperature(1.0)).compile()
  cost = compiled.cost_analysis()
  return compiled, (cost[0] if isinstance(cost, list) else cost), cache_bytes


@pytest.mark.parametrize("kv_cache,window", [("dense", None), ("dense", 128), ("paged", 16), ("paged", 64)],
                         ids=["dense_full_window", "dense_window_128", "paged_16_pages", "paged_64_pages"])
def test_decode_updates_the_cache_in_place(tpu_mesh, kv_cache, window):
  one, one_cost, cache_bytes = compile_decode(tpu_mesh, 1, window, kv_cache)
  many, many_cost, _ = compile_decode(tpu_mesh, 16, window, kv_cache)
  rows = (SLOTS // 2) * (PREFILL + DECODE) if kv_cache == "dense" else (SLOTS // 2 * (PREFILL + DECODE) // PAGE + 1) * PAGE
  assert cache_bytes == 2 * CONFIG.num_hidden_layers * rows * 1 * CONFIG.head_size * 2
  # No per-slot serial loop (a while of SLOTS / 2 or SLOTS trips per step) writes the cache: the only loops are
  # the chunk's steps and the layer scan.
  for compiled in (one, many):
    trips = {loop.trip_count for loop in hlo_cost.analyse(compiled.as_text()).loops}
    assert not trips & {SLOTS // 2, SLOTS}, trips
  one, many = one.memory_analysis(), many.memory_analysis()
  # The paged step gathers its live pages (`window` a shard, [ps, 2K / tensor, H] each) into a temporary.
  gathered = 0 if kv_cache == "dense" else window * PAGE * 1 * 2 * CONFIG.head_size * 2
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
  engine = make_engine(tpu_mesh, 16, "paged")
  state = engine.abstract_decode_state()
  pages_bytes = aot_measure.per_chip_bytes(state.cache.pages)
  params = engine.abstract_params()
  B = 8
  cache, logits = aot_measure.outputs_of(engine.lower_prefill(params, B, PREFILL).compile())
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  with jax.set_mesh(tpu_mesh):
    compiled = engine._insert_requests_jit.lower(
        state, cache, logits, i32(B), i32(B), i32(B), jax.ShapeDtypeStruct((), jnp.uint32), i32(B), i32(B), i32(B),
        i32(4), sampling=sampling.Temperature(1.0)).compile()
  mem = compiled.memory_analysis()
  assert mem.alias_size_in_bytes >= pages_bytes
  assert mem.temp_size_in_bytes < pages_bytes / 4, (mem.temp_size_in_bytes, pages_bytes)
