"""The decode call compiled ahead of time for a small TPU slice (libtpu compiles for a topology on a CPU host):
it reads and writes the KV cache in place, never re-lays it out or copies it whole."""


import jax.numpy as jnp
import pytest
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import qwen2
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import sampling
from pacs_jax.train import aot_measure

# The tiny model with Qwen2.5's head_dim of 128 (the TPU lane width) and one kv head per chip (K = 2 over
# tensor = 2), as the 3B model on its v5p slice: the case where a cache laid out [slots, rows, kv_heads,
# head_dim] was converted whole on entry to every decode call.
CONFIG = qwen2.get_preset("tiny", head_dim=128, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
SLOTS, PREFILL, DECODE = 64, 64, 448


@pytest.fixture(scope="module")
def tpu_mesh():
  # Programs compiled for a topology without a TPU client cannot be read back from the persistent cache.
  with aot_measure.persistent_cache_off():
    yield sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=sharding.tpu_topology_devices("v5p:2x2x1"))


def compile_decode(mesh, steps: int, window: int | None):
  model = nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(CONFIG, rngs=nnx.Rngs(0)))
  engine = engine_lib.Engine(model, max_concurrent_decodes=SLOTS, max_prefill_length=PREFILL,
                             max_decode_length=DECODE, mesh=mesh, steps_per_call=steps)
  state = engine.abstract_decode_state()
  cache_bytes = aot_measure.per_chip_bytes((state.cache.k, state.cache.v))
  compiled = engine.lower_decode(engine.abstract_params(), state, window, sampling.Temperature(1.0)).compile()
  cost = compiled.cost_analysis()
  return compiled.memory_analysis(), (cost[0] if isinstance(cost, list) else cost), cache_bytes


@pytest.mark.parametrize("window", [None, 128], ids=["full_window", "window_128"])
def test_decode_updates_the_cache_in_place(tpu_mesh, window):
  one, one_cost, cache_bytes = compile_decode(tpu_mesh, 1, window)
  many, many_cost, _ = compile_decode(tpu_mesh, 16, window)
  assert cache_bytes == 2 * CONFIG.num_hidden_layers * (SLOTS // 2) * 1 * (PREFILL + DECODE) * CONFIG.head_size * 2
  for mem in (one, many):
    # The cache is donated and aliased to the output, and no temporary holds a copy of its k or v.
    assert mem.alias_size_in_bytes >= cache_bytes
    assert mem.temp_size_in_bytes < cache_bytes / 4, (mem.temp_size_in_bytes, cache_bytes)
  # The compiler counts a while body once: a 16-step call accesses about the bytes of one step unless
  # work outside the loop (a whole-cache layout conversion on entry and exit) grows with the cache. (At
  # these tiny shapes its time estimate, optimal_seconds, is not positive; bytes accessed is the same test.)
  assert many_cost["bytes accessed"] <= 1.5 * one_cost["bytes accessed"]
  assert many_cost["bytes accessed"] < one_cost["bytes accessed"] + cache_bytes
