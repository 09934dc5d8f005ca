"""Ahead-of-time TPU compile of the rollout's decode call at a config's real shapes, from abstract weights
(nothing allocated, no TPU needed: libtpu compiles for a topology on a CPU host). Prints per-chip memory
and the compiler's bytes accessed and time estimate, as it reports them (each loop body once: a call of many
steps costs about one step's layer when the cache is read and written in place) and with loop trip counts
applied (`hlo_cost`: every layer of every step). The Pallas decode kernel's own reads are not in the
compiler's figures (a custom call it cannot see into).

  JAX_PLATFORMS=cpu python benchmarks/decode_cache_tpu.py --config configs/qwen3b_v5p.py --topology v5p:2x4x4
  JAX_PLATFORMS=cpu python benchmarks/decode_cache_tpu.py --config configs/qwen7b_v5p.py --attention xla,auto \
      --steps 1 --page_budgets full,half   # the XLA gather vs the Pallas kernel, all or half of the pages read
"""

from __future__ import annotations

import argparse

from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.models import families
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.compile import aot_measure

GB = 1e9


def decode_figures(engine: engine_lib.Engine, params, page_budget: int | None, sampling) -> dict[str, float]:
  """Compiles one decode call from abstract params and state: per-chip memory, and the compiler's cost both
  as it reports it (each loop body once: one layer of one step) and with loop trip counts applied."""
  report = aot_measure.ProgramReport("decode", "rollout", calls=1, model_flops=0.0)
  aot_measure.measure(report, lambda: engine.lower_decode(params, engine.abstract_decode_state(), page_budget, sampling),
                      resident=lambda compiled: 0.0)
  if report.error:
    raise RuntimeError(report.error)
  return {"compile_s": report.compile_s, "argument_gb": report.argument / GB, "output_gb": report.output / GB,
          "alias_gb": report.alias / GB, "temp_gb": report.temp / GB,
          "optimal_ms": (report.raw_optimal_s or float("nan")) * 1e3,
          "bytes_accessed_gb": (report.raw_bytes or float("nan")) / GB,
          "optimal_ms_loops": (report.optimal_s or float("nan")) * 1e3,
          "bytes_accessed_gb_loops": (report.bytes_accessed or float("nan")) / GB,
          "gflops_loops": (report.flops or 0.0) / 1e9}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/qwen3b_v5p.py")
  parser.add_argument("--topology", default="v5p:2x4x4", help="TPU topology of the config's slice (v5p:2x4x4 = v5p-64)")
  parser.add_argument("--steps", default="1,16", help="decode steps per call to compare")
  parser.add_argument("--page_budgets", default="full", help="comma-separated page budgets (live (slot, page) pairs "
                      "a batch shard reads per step), or full / half (of the largest)")
  parser.add_argument("--attention", default="auto", help="comma-separated decode attentions to compile: auto (as "
                      "model.attention_impl picks: the Pallas kernel on TPU), xla (the XLA gather over live pages)")
  args = parser.parse_args()

  cfg = config_lib.load_config_file(args.config)
  mc = config_lib.preset_model_config(cfg)
  devices = sharding.tpu_topology_devices(args.topology)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
  models = {impl: nnx.eval_shape(lambda impl=impl: families.causal_lm(mc.replace(attention_impl=impl),
                                                                    rngs=nnx.Rngs(0)))
            for impl in {mc.attention_impl, "xla"}}
  slots = cfg.rollout.slots or cfg.train.batch_prompts * cfg.rollout.n
  method = sampling_lib.from_config(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
  print(f"{args.config}: {cfg.model.preset} on {args.topology} ({len(devices)} chips), mesh {dict(mesh.shape)}, "
        f"{slots} slots x {cfg.data.max_prompt_length + cfg.rollout.max_new_tokens} cache rows")
  header = ("attention", "steps", "page_budget", "compile_s", "argument_gb", "output_gb", "alias_gb", "temp_gb", "optimal_ms",
            "bytes_accessed_gb", "optimal_ms_loops", "bytes_accessed_gb_loops", "gflops_loops")
  print(" ".join(f"{h:>17}" for h in header))
  results = {}
  for attention in args.attention.split(","):
    model = models["xla" if attention == "xla" else mc.attention_impl]
    for steps in (int(s) for s in args.steps.split(",")):
      engine = engine_lib.Engine(model, max_concurrent_decodes=slots, max_prefill_length=cfg.data.max_prompt_length,
                                 max_decode_length=cfg.rollout.max_new_tokens, mesh=mesh, steps_per_call=steps,
                                 page_size=cfg.rollout.page_size, kv_pages=cfg.rollout.kv_pages)
      params = engine.abstract_params(mc.dtype)  # the rollout weights: compute dtype, sample layout
      if steps == int(args.steps.split(",")[0]):
        cache = engine.abstract_decode_state().cache
        per_chip = aot_measure.per_chip_bytes(cache)
        print(f"{attention}: KV cache per chip {per_chip / GB:.2f} GB (page budgets {engine.page_budgets}"
              f"{', Pallas kernel' if engine.decode_kernel else ''})")
      top = engine.page_budgets[-1]
      for b in args.page_budgets.split(","):
        page_budget = {"full": top, "half": top // 2}.get(b) or int(b)
        figures = decode_figures(engine, params, page_budget, method)
        results[(attention, steps, b)] = figures
        print(" ".join(f"{v:>17}" for v in (attention, steps, page_budget)) + " "
              + " ".join(f"{figures[h]:>17.3f}" for h in header[3:]), flush=True)
  first, last = (int(s) for s in (args.steps.split(",")[0], args.steps.split(",")[-1]))
  if first != last:
    for attention, steps, b in results:
      if steps == first:
        ratio = results[(attention, last, b)]["optimal_ms"] / results[(attention, first, b)]["optimal_ms"]
        print(f"{attention} page budget {b}: optimal time of a {last}-step call / a {first}-step call = {ratio:.2f}")


if __name__ == "__main__":
  main()
