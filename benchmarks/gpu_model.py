"""One phase of a config's run measured on this machine's first device, with random weights of the real shapes:
the figures `gpu_check.py` reports for the 1.5B recipe. Prints one JSON line (last line of stdout).

  python benchmarks/gpu_model.py --phase update --attention cudnn       # train step + log-prob pass
  python benchmarks/gpu_model.py --phase rollout                        # prefill + decode
  python benchmarks/gpu_model.py --phase update --tiny                  # CPU dry mode: the same steps, tiny shapes

update: the train state (fp32 weights, Adam moments) and a step's mini-batches on the device, the log-prob pass and
the train step compiled and timed; MFU = 6 N tokens / time / the device's bf16 dense peak (N: the matmul weights).
rollout: the same train state resident (as in a run's rollout phase), the rollout weights, the decode state, the
largest prefill (every slot at the longest prompt) and decode until every slot holds `--new_tokens` more tokens;
tokens/s against the HBM roofline (weights plus the live KV rows each step reads, over the measured copy bandwidth).
Each phase runs in its own process so that the device's peak memory is the phase's own.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pacs_jax import config as config_lib  # noqa: E402
from pacs_jax import sharding  # noqa: E402
from pacs_jax.compile import aot  # noqa: E402
from pacs_jax.compile import aot_measure  # noqa: E402
from pacs_jax.compile.aot_measure import per_chip_bytes  # noqa: E402
from pacs_jax.config import files as config_files  # noqa: E402
from pacs_jax.rollout import sampling as sampling_lib  # noqa: E402
from pacs_jax.rollout import scheduler  # noqa: E402
from pacs_jax.trainer import programs as programs_lib  # noqa: E402
from pacs_jax.trainer.adapters import NO_BASE  # noqa: E402  (a full run's frozen part: the programs' last argument)
from pacs_jax.trainer import train_state as state_lib  # noqa: E402

GB = 1e9
# Dense bf16 matrix peak of one device (datasheet, FLOP/s): MFU's denominator. H100 and H200 SXM share the H100's
# tensor cores; a device not listed reports no MFU.
BF16_PEAK = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA H100": 989e12}


def load_config(path: str, attention: str, tiny: bool, mini_batch_prompts: int = 0, prompt_len: int = 0):
  """The config at `path` for this machine's first device; `tiny`: the dry mode's shapes (tiny model, short rows, a
  few slots); `mini_batch_prompts` > 0: fewer micro-batches a train step call (the same micro-batch, so the same
  temporaries and FLOPs per token: a shorter call to time)."""
  cfg = config_files.load_config_file(path)
  if mini_batch_prompts:
    cfg.train.mini_batch_prompts = mini_batch_prompts
    cfg.train.batch_prompts = 4 * mini_batch_prompts
  if prompt_len:
    cfg.data.max_prompt_length = prompt_len
  cfg.hardware.gpu_target = cfg.hardware.gpu_topology = cfg.hardware.tpu_topology = ""
  cfg.hardware.hbm_gb = 0.0
  cfg.hardware.num_devices = 1
  cfg.model.attention_impl = attention
  if tiny:
    cfg.model.preset, cfg.model.hf_path = "tiny", ""
    cfg.train.batch_prompts, cfg.train.mini_batch_prompts, cfg.train.micro_batch_prompts = 4, 2, 1
    cfg.data.max_prompt_length, cfg.rollout.max_new_tokens, cfg.rollout.slots = 32, 32, 8
  return cfg


def materialize(tree, key, random: bool):
  """Arrays for a tree of ShapeDtypeStructs, made on their devices in one program: floats N(0, 0.02) if `random`
  (weights), else zeros (optimizer moments, counts)."""
  leaves, treedef = jax.tree.flatten(tree)

  def make():
    out = []
    for i, s in enumerate(leaves):
      if random and jnp.issubdtype(s.dtype, jnp.floating):
        out.append((0.02 * jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32)).astype(s.dtype))
      else:
        out.append(jnp.zeros(s.shape, s.dtype))
    return out

  values = jax.jit(make, out_shardings=[s.sharding for s in leaves])()
  return jax.tree.unflatten(treedef, values)


def random_minibatch(shapes: dict, vocab: int, seed: int) -> dict:
  """A mini-batch of the layout's fields: random token ids, every mask 1, rewards 0/1, other floats small."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, s in shapes.items():
    if name == "input_ids":
      value = rng.integers(0, vocab, s.shape)
    elif "mask" in name:
      value = np.ones(s.shape)
    elif name == "rewards":
      value = rng.integers(0, 2, s.shape)
    elif jnp.issubdtype(s.dtype, jnp.floating):
      value = -np.abs(rng.normal(0, 1, s.shape))  # log-probs
    else:
      value = np.zeros(s.shape)
    out[name] = jax.device_put(np.asarray(value, s.dtype), s.sharding)
  return out


def timed(fn, repeats: int) -> list[float]:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times


def peak_bytes() -> float | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def temp_bytes(compiled) -> float:
  m = compiled.memory_analysis()
  return float(m.temp_size_in_bytes) if m is not None else 0.0


def setup(cfg):
  """The run's abstract state and programs on this machine's first device, the state made concrete: random weights,
  the optimizer's own initial state (its hyperparameters, moments at 0), step 0."""
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  state, policy, engine, progs = aot.abstract_run(cfg, mesh)
  optimizer, critic_optimizer = programs_lib.make_optimizers(cfg)
  key = jax.random.key(0)
  with jax.set_mesh(mesh):
    params = materialize(state.params, key, random=True)
    rest = materialize(state.replace(params=None, opt_state=None, critic_opt_state=None), key, random=False)
    opt_state = state_lib.init_opt_state(optimizer, params, mesh)
    critic_opt = (state_lib.init_opt_state(critic_optimizer, rest.critic_params, mesh)
                  if rest.critic_params is not None else None)
  state = rest.replace(params=params, opt_state=opt_state, critic_opt_state=critic_opt)
  return mesh, state, policy, engine, progs


def model_figures(policy, cfg) -> dict:
  n = aot.matmul_params(policy)
  return {"matmul_params": n, "preset": cfg.model.preset, "param_dtype": cfg.model.param_dtype,
          "dtype": cfg.model.dtype}


def update_phase(cfg, repeats: int) -> dict:
  # Every row full (random tokens, every mask 1): the padded rows, the worst case the MFU figures are for (packed rows
  # at every response's max length cost 1.01x these: docs/tpu.md, "Length profiles").
  cfg = copy.deepcopy(cfg)
  cfg.train.packing = False
  mesh, state, policy, _, progs = setup(cfg)
  n_params = aot.matmul_params(policy)
  shapes = programs_lib.minibatch_shapes(cfg, mesh)
  updates = programs_lib.updates_per_step(cfg)
  batches = [random_minibatch(shapes, policy.config.vocab_size, i) for i in range(updates)]
  ends = programs_lib.ends_step(mesh, True)
  resident = per_chip_bytes(state) + updates * per_chip_bytes(shapes)
  k, m = shapes["input_ids"].shape[:2]
  tokens = k * m * shapes["input_ids"].shape[2]
  out = {"phase": "update", "attention": cfg.model.attention_impl, "rows_per_call": k * m,
         "tokens_per_call": tokens, "micro_batches": k, "updates_per_step": updates, **model_figures(policy, cfg),
         "resident_gb": resident / GB}
  with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    logprob = progs.logprob_fn.lower(state.params, batches[0], NO_BASE).compile()
    out["logprobs_compile_s"] = time.perf_counter() - t0
    times = timed(lambda: logprob(state.params, batches[0], NO_BASE), repeats + 1)
    out["logprobs_s"] = min(times[1:])
    out["logprobs_temp_gb"] = temp_bytes(logprob) / GB
    t0 = time.perf_counter()
    step = progs.train_step.lower(state, batches[0], ends, NO_BASE).compile()
    out["train_step_compile_s"] = time.perf_counter() - t0
    out["train_step_temp_gb"] = temp_bytes(step) / GB
    times = []
    for i in range(repeats + 1):
      start = time.perf_counter()
      state, metrics = step(state, batches[i % updates], ends, NO_BASE)
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - start)
    out["train_step_s"] = min(times[1:])
    out["train_step_times_s"] = times
    loss = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0 and k in ("loss", "grad_norm")}
    out["metrics"] = loss
  out["train_step_tflops"] = 6.0 * n_params * tokens / out["train_step_s"] / 1e12
  out["logprobs_tflops"] = 2.0 * n_params * tokens / out["logprobs_s"] / 1e12
  peak = BF16_PEAK.get(jax.devices()[0].device_kind)
  if peak:
    out["train_step_mfu"] = out["train_step_tflops"] * 1e12 / peak
    out["logprobs_mfu"] = out["logprobs_tflops"] * 1e12 / peak
  out["planned_peak_gb"] = (resident + max(out["train_step_temp_gb"], out["logprobs_temp_gb"]) * GB) / GB
  out["measured_peak_gb"] = (peak_bytes() or 0) / GB
  return out


def rollout_phase(cfg, repeats: int, new_tokens: int, bandwidth_gbps: float | None) -> dict:
  mesh, state, policy, _, progs = setup(cfg)
  sampler = programs_lib.make_rollout(cfg, policy, mesh, eos_ids=(0,))
  engine = sampler._engine  # noqa: SLF001: the measurement drives the engine as scheduler.generate does
  resident = per_chip_bytes(state)
  with jax.set_mesh(mesh):
    sample = progs.to_sample_params(state.params, NO_BASE)
    params = engine.load_params(sample)
  B, P = engine.max_concurrent_decodes, cfg.data.max_prompt_length
  R = min(new_tokens, cfg.rollout.max_new_tokens)
  vocab = policy.config.vocab_size
  prompts = np.random.default_rng(0).integers(0, vocab, size=(B, P)).astype(np.int32)
  lengths = np.full((B,), P, np.int32)
  out = {"phase": "rollout", "slots": B, "prompt_len": P, "new_tokens": R, "cache_rows": engine.cache_length,
         **model_figures(policy, cfg)}
  times = timed(lambda: engine.prefill_batch(params, prompts, lengths), repeats + 1)
  out["prefill_s"] = min(times[1:])
  out["prefill_tokens_per_s"] = B * P / out["prefill_s"]
  method, no_eos = sampling_lib.from_config(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p), ()

  def fill():
    decode_state = engine.init_decode_state()
    decode_state, _ = scheduler.prefill_insert(engine, params, decode_state, prompts.tolist(), list(range(B)),
                                               list(range(B)), list(range(B)), [0] * B, [R + 1] * B, 0, method,
                                               no_eos)
    return jax.block_until_ready(decode_state)

  def decode(decode_state):
    steps, rows_read, rows, active = 0, 0, np.full(B, P), np.ones(B, bool)
    while active.any():
      page_budget = engine.policy.page_budget(rows, active)
      decode_state, res = engine.decode(params, decode_state, B + 1, method, no_eos, page_budget)
      emitted, active, rows = res.emitted, np.asarray(res.active), np.asarray(res.lengths)
      done = int(np.asarray(emitted).any(axis=0).sum())
      steps, rows_read = steps + done, rows_read + done * engine.policy.rows_read(page_budget)
    return jax.block_until_ready(decode_state), steps, rows_read

  shard_bytes = lambda x: x.addressable_shards[0].data.nbytes
  weight_bytes = sum(shard_bytes(x) for x in jax.tree.leaves(params))
  decode_state = fill()
  kv_bytes = shard_bytes(decode_state.cache.pages)
  kv_rows = decode_state.cache.pages.shape[1] * decode_state.cache.pages.shape[2]
  decode(decode_state)  # compiles every page budget
  del decode_state  # donated; each pass below holds one decode state at a time, as a run does
  best, steps, rows_read = math.inf, 1, 0
  for _ in range(repeats):
    decode_state = None
    decode_state = fill()
    start = time.perf_counter()
    decode_state, steps, rows_read = decode(decode_state)
    best = min(best, (time.perf_counter() - start) / steps)
  kv_step = kv_bytes * rows_read / steps / kv_rows
  del decode_state
  out["measured_peak_gb"] = (peak_bytes() or 0) / GB
  # What the compiled decode call moves (loops applied) at the top page budget, against the roofline's bytes there.
  top = engine.page_budgets[-1]
  report = aot_measure.ProgramReport(f"decode[pages={top}]", "rollout", 1, 0.0)
  abstract_state = engine.abstract_decode_state()
  with jax.set_mesh(mesh):
    aot_measure.measure(report, lambda: engine.lower_decode(params, abstract_state, top, method), lambda c: 0.0)
  if report.bytes_accessed:
    top_kv = kv_bytes * engine.policy.rows_read(top) / kv_rows
    out.update(top_page_budget=top, compiled_gb_per_step_at_top=report.bytes_accessed / engine.steps_per_call / GB,
               roofline_gb_per_step_at_top=(weight_bytes + top_kv) / GB)
  out.update(decode_step_ms=best * 1e3, decode_tokens_per_s=B / best, weights_gb=weight_bytes / GB,
             kv_cache_gb=kv_bytes / GB, kv_read_per_step_gb=kv_step / GB, decode_steps=steps,
             resident_gb=(resident + weight_bytes + kv_bytes) / GB)
  if bandwidth_gbps:
    roofline_s = (weight_bytes + kv_step) / (bandwidth_gbps * 1e9)
    out.update(bandwidth_gbps=bandwidth_gbps, roofline_step_ms=roofline_s * 1e3,
               roofline_tokens_per_s=B / roofline_s, decode_of_roofline=roofline_s / best)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/qwen1p5b_1gpu.py")
  parser.add_argument("--phase", choices=("update", "rollout"), required=True)
  parser.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"))
  parser.add_argument("--tiny", action="store_true", help="dry mode: tiny model and shapes (any backend)")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--mini_batch_prompts", type=int, default=0, help="update: prompts a train step call takes "
                      "(0: the config's)")
  parser.add_argument("--new_tokens", type=int, default=1024, help="rollout: tokens each slot decodes (timed)")
  parser.add_argument("--prompt_len", type=int, default=0, help="rollout: prompt length (0: the config's maximum)")
  parser.add_argument("--bandwidth_gbps", type=float, default=None, help="rollout: the roofline's HBM bandwidth")
  args = parser.parse_args()
  cfg = load_config(args.config, args.attention, args.tiny, args.mini_batch_prompts, args.prompt_len)
  config_lib.validate(cfg, num_processes=1, devices=jax.devices()[:1], check_paths=False)
  if args.phase == "update":
    out = update_phase(cfg, args.repeats)
  else:
    out = rollout_phase(cfg, args.repeats, args.new_tokens, args.bandwidth_gbps)
  out.update(device=jax.devices()[0].device_kind, backend=jax.default_backend(), config=args.config)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
