"""Loop trip counts and loop-aware costs read from compiled HLO (TPU programs compiled on this host, and CPU ones)."""

import gzip
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pacs_jax import sharding
from pacs_jax.compile import aot, aot_measure, hlo_cost

D = 512
REFERENCE = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "reference"


def compile_for(target: str, fn, *shapes):
  devices = sharding.tpu_topology_devices("v5p:2x2x1")[:1] if target == "tpu" else jax.devices()[:1]
  where = NamedSharding(Mesh(np.array(devices), ("x",)), P())
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=where) for s in shapes]
  with aot.persistent_cache_off():
    compiled = jax.jit(fn).lower(*args).compile()
  cost = compiled.cost_analysis()
  return hlo_cost.analyse(compiled.as_text()), (cost[0] if isinstance(cost, list) else cost)


def matmul_flops(rows: int) -> float:
  return 2.0 * rows * D * D


@pytest.mark.parametrize("target", ["tpu", "cpu"])
def test_scan_trip_count_multiplies_the_body(target):
  layers = lambda x, ws: jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]
  loops, cost = compile_for(target, layers, (64, D), (12, D, D))
  assert [loop.trip_count for loop in loops.loops] == [12]
  # XLA counts the body once; with the trip count applied the dots are 12 matmuls.
  assert matmul_flops(64) <= cost["flops"] < 1.2 * matmul_flops(64)  # one matmul (+ tanh and converts)
  assert loops.total("flops") == pytest.approx(12 * matmul_flops(64), rel=1e-6)
  assert loops.total("flops", weighted=False) == pytest.approx(matmul_flops(64), rel=1e-6)


def test_nested_loops_multiply_and_a_data_dependent_loop_is_bounded_by_its_counter():
  def fn(x, w):
    def outer(x, _):
      x = jnp.tanh(x @ w)  # 3 times
      x = jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w), x)  # 15 times
      return x, None
    x = jax.lax.scan(outer, x, None, length=3)[0]
    # At most 7 iterations: the counter bounds a loop that may stop earlier.
    return jax.lax.while_loop(lambda c: (c[0] < 7) & (c[1][0, 0] < 100), lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                              (0, x))[1]
  loops, _ = compile_for("tpu", fn, (64, D), (D, D))
  assert sorted(loop.multiplier for loop in loops.loops) == [3, 7, 15]
  assert loops.total("flops") == pytest.approx((3 + 15 + 7) * matmul_flops(64), rel=1e-6)
  assert loops.unknown_trip_counts == 0


def test_a_dynamic_slice_in_a_loop_reads_its_slice_not_the_array():
  def fn(x, table):  # table [32, 1024, D]: each step reads one [1024, D] slice
    return jax.lax.fori_loop(0, 32, lambda i, acc: acc + jax.lax.dynamic_index_in_dim(table, i, keepdims=False), x)
  loops, cost = compile_for("tpu", fn, (1024, D), (32, 1024, D))
  slice_bytes = 1024 * D * 2
  table_bytes = 32 * slice_bytes
  # Per call: 32 slices read (the whole table once), the accumulator read and written each step.
  assert table_bytes < loops.total("bytes") < table_bytes + 32 * 4 * slice_bytes
  # Counted once, as XLA counts, the table is one slice (the two counts differ in details such as on-chip copies).
  assert 0.5 < loops.total("bytes", weighted=False) / cost["bytes accessed"] < 1.5


def test_batched_matmuls_written_as_convolutions_count_their_real_flops():
  # XLA:TPU writes a batched matmul as a convolution whose batch dim is a window over a dilated input; only
  # one tap per output lands on an input element.
  attention = lambda q, k: jnp.einsum("BQNH,BKNH->BNQK", q, k)
  loops, cost = compile_for("tpu", attention, (32, 256, 8, 128), (32, 256, 8, 128))
  expected = 2.0 * 32 * 8 * 256 * 256 * 128
  assert loops.total("flops") == pytest.approx(expected, rel=1e-6)
  assert cost["flops"] == pytest.approx(expected, rel=0.01)


def test_the_roofline_tracks_xla_optimal_seconds_and_scales_with_the_trip_count():
  """The per-instruction roofline, at the rates behind XLA's `optimal_seconds` (read from the compiler), sums
  close to XLA's own figure for the program (each loop body once); with the trip count applied, a 12-layer
  scan costs most of 12 bodies (the rest is outside the loop)."""
  devices = sharding.tpu_topology_devices("v5p:2x2x1")[:1]
  flops_rate, bytes_rate = aot_measure.device_rates(devices[0])
  assert 300e12 < flops_rate < 500e12 and 2e12 < bytes_rate < 3e12, (flops_rate, bytes_rate)  # v5p's
  layer = lambda x, w: jnp.tanh(x @ w) * jax.nn.sigmoid(jnp.sum(x, axis=-1, keepdims=True))
  layers = lambda x, ws: jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]
  where = NamedSharding(Mesh(np.array(devices), ("x",)), P())
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=where) for s in ((8192, 1024), (12, 1024, 1024))]
  with aot.persistent_cache_off():
    compiled = jax.jit(layers).lower(*args).compile()
  cost = compiled.cost_analysis()
  raw = (cost[0] if isinstance(cost, list) else cost)["optimal_seconds"]
  loops = hlo_cost.analyse(compiled.as_text(), aot_measure.compiler_rates(compiled))
  assert loops.total("roofline", weighted=False) == pytest.approx(raw, rel=0.15)
  assert 6 * raw < aot_measure.loops_applied_seconds(loops, raw) < 12 * raw


def test_maxtexts_reference_train_step_figures():
  """The peer program the train-step benchmark compares against (benchmarks/reference): read with the same
  trip counts and rates, MaxText's 3B train step is 18.6 s (roofline) / 14.40 s (cycles), 38.7 G cycles."""
  path = REFERENCE / "maxtext-0.2.5_qwen2.5-3b_v5p-2x4x4.hlo.gz"
  with gzip.open(path, "rt") as f:
    loops = hlo_cost.analyse(f.read(), aot_measure.device_rates(sharding.tpu_topology_devices("v5p:2x2x1")[0]))
  raw = json.loads(path.with_name(path.name.replace(".hlo.gz", ".json")).read_text())["optimal_seconds"]
  assert sorted({loop.trip_count for loop in loops.loops}) == [4, 32, 36]
  assert loops.total("cycles") == pytest.approx(3.8685e10, rel=1e-3)
  assert aot_measure.loops_applied_seconds(loops, raw, "cycles") == pytest.approx(14.40, abs=0.01)
  assert aot_measure.loops_applied_seconds(loops, raw) == pytest.approx(18.58, abs=0.05)


def test_the_memo_reuses_a_program_compiled_again_and_only_the_same_program(monkeypatch):
  """PACS_JAX_AOT_MEMO=1: the same program (text, devices, target) compiled again is the first executable with its
  first compile time; on other devices, or for the TPU target, it is compiled anew; off, nothing is kept."""
  monkeypatch.setattr(aot_measure, "_MEMO", type(aot_measure._MEMO)())
  monkeypatch.setenv(aot_measure.MEMO_ENV, "1")

  def lower(devices):
    where = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    arg = jax.ShapeDtypeStruct((8, D), jnp.float32, sharding=where)
    return lambda: jax.jit(lambda a: jnp.tanh(a) * 2).lower(arg)

  def measured(lower_fn):
    report = aot_measure.ProgramReport("p", "update", 1, 0.0)
    return aot_measure.measure(report, lower_fn, lambda c: 0.0), report

  first, a = measured(lower(jax.devices()[:2]))
  again, b = measured(lower(jax.devices()[:2]))
  assert again is first and b.compile_s == a.compile_s and b.flops == a.flops
  elsewhere, _ = measured(lower(jax.devices()[2:4]))
  tpu, _ = measured(lower(sharding.tpu_topology_devices("v5p:2x2x1")[:2]))
  assert elsewhere is not first and tpu is not first and len(aot_measure._MEMO) == 3
  monkeypatch.setenv(aot_measure.MEMO_ENV, "0")
  assert measured(lower(jax.devices()[:2]))[0] is not first and len(aot_measure._MEMO) == 3
