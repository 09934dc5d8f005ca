"""Every released config with a TPU topology compiled ahead of time for its pod (`--compile_only`), and the
figures written to the table in docs/tpu.md: per-chip memory per phase, compile time on this host, and the
compiler's optimal time per step next to the model FLOPs. Needs libtpu, no TPU. Minutes per config.
With --gpu, the configs with a GPU target (hardware.gpu_target; jax's CUDA plugin, no GPU) and the table in
docs/gpu.md: memory per GPU, FLOPs and bytes, no times (nothing is autotuned without a GPU). A LoRA config (lora.rank
> 0) is compiled a second time as full fine-tuning on the same target (lora off, fp32 master weights, the rest as it
is), and the two go side by side in a second table of the same page.

  python benchmarks/compile_configs.py                     # all TPU configs; rewrites docs/tpu.md's table
  python benchmarks/compile_configs.py --configs configs/qwen3b_v5p.py --no_docs
  python benchmarks/compile_configs.py --configs configs/qwen7b_lora_v5p8.py   # its columns only; the rest stay
  python benchmarks/compile_configs.py --gpu               # all GPU configs; rewrites docs/gpu.md's table
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKERS = {"tpu": ("<!-- compile_configs: begin -->", "<!-- compile_configs: end -->"),
           "gpu": ("<!-- compile_configs_gpu: begin -->", "<!-- compile_configs_gpu: end -->"),
           "tpu_lora": ("<!-- compile_configs_lora: begin -->", "<!-- compile_configs_lora: end -->"),
           "gpu_lora": ("<!-- compile_configs_gpu_lora: begin -->", "<!-- compile_configs_gpu_lora: end -->")}
DOCS = {"tpu": os.path.join(ROOT, "docs", "tpu.md"), "gpu": os.path.join(ROOT, "docs", "gpu.md")}  # hold the tables
DOCS.update({f"{kind}_lora": doc for kind, doc in DOCS.items()})  # the full vs LoRA tables: the same pages


def target_configs(kind: str) -> list[str]:
  """The config files whose target is a TPU topology ("tpu") or a GPU target ("gpu")."""
  from pacs_jax import config as config_lib
  paths = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if not os.path.basename(p).startswith("_"))
  field = {"tpu": "tpu_topology", "gpu": "gpu_target"}[kind]
  return [p for p in paths if config_lib.load_config_file(p).hardware[field]]


WEIGHTS = ("policy params", "optimizer state", "frozen reference",  # a full run's
           "base weights (frozen)", "adapters", "adapter optimizer state")  # a LoRA run's


def memory_rows(report, cfg, slots_in_row: bool = True) -> dict[str, str]:
  """Resident parts and phase peaks per chip / GPU (the slot count in the KV cache's row name, or in its value)."""
  from pacs_jax.compile.aot_measure import GB
  gb = lambda x: f"{x / GB:.1f}"
  out = {}
  for part in WEIGHTS:
    if part in report.resident["update"]:
      out[part] = gb(report.resident["update"][part])
  out["rollout weights (compute dtype, sample layout)"] = gb(report.resident["rollout"]["rollout weights"])
  kv = gb(report.resident["rollout"]["decode state (KV cache)"])
  if slots_in_row:
    out[f"decode state: KV cache of {cfg.rollout.slots} slots"] = kv
  else:
    out["decode state: KV cache (slots)"] = f"{kv} ({cfg.rollout.slots})"
  out["step batch (token ids, masks, log-probs)"] = gb(report.resident["update"]["step batch (mini-batches)"])
  for phase in ("rollout", "update"):
    total, largest = report.phase_total(phase)
    out[f"+ largest {phase} program (its temporaries etc.)"] = f"{gb(largest.extra)} ({largest.name})"
    out[f"**{phase} phase peak** (of {report.target.hbm_bytes / GB:g} GB)"] = f"**{gb(total)}**"
  return out


def gpu_summary(report, cfg) -> dict[str, str]:
  """One column of the GPU table (docs/gpu.md): memory, FLOPs and bytes per GPU (no times: nothing is autotuned)."""
  from pacs_jax.compile.aot_measure import GB
  out = memory_rows(report, cfg, slots_in_row=False)
  progs = {p.name: p for p in report.programs}
  train, logprobs = progs["train_step"], progs["logprobs"]
  out["train step compile time (this 2-core host)"] = f"{train.compile_s:.0f} s"
  out["train step TFLOP per GPU: compiled / model (6N per token; LoRA 4N)"] = (
      f"{train.flops / 1e12:.0f} / {train.model_flops / 1e12:.0f}")
  out["log-prob pass TFLOP per GPU: compiled / model (2N per token)"] = (
      f"{logprobs.flops / 1e12:.0f} / {logprobs.model_flops / 1e12:.0f}")
  out["train step GB read + written per GPU (loops applied)"] = f"{train.bytes_accessed / GB:.0f}"
  decode = [p for p in report.programs if p.name.startswith("decode[")]
  full = max(decode, key=lambda p: int(re.search(r"pages=(\d+)", p.name).group(1)))
  out["decode call (16 steps) at the full budget: temporaries / GB read + written"] = (
      f"{full.temp / GB:.2f} / {full.bytes_accessed / GB:.0f}")
  cudnn = [c for c in train.custom_calls if c.startswith("__cudnn$fmha")]
  out["train step attention"] = "cuDNN (" + ", ".join(c.removeprefix("__cudnn$") for c in cudnn) + ")" if cudnn else "XLA"
  return out


def summary(report, cfg) -> dict[str, str]:
  """One column of the TPU table (docs/tpu.md): the figures a user needs before renting the pod."""
  from pacs_jax.compile.aot_measure import GB
  from pacs_jax.trainer import programs as programs_lib
  gb = lambda x: f"{x / GB:.1f}"
  out = memory_rows(report, cfg, slots_in_row=False)
  progs = {p.name: p for p in report.programs}
  train, logprobs = progs["train_step"], progs["logprobs"]
  out["train step compile time (this 2-core host)"] = f"{train.compile_s:.0f} s"
  updates = programs_lib.updates_per_step(cfg)
  out[f"train step: compiler's optimal time x {updates} updates"] = (
      f"{train.optimal_s:.2f} s x {updates} = {train.optimal_s * updates:.1f} s")
  out["train step TFLOP per chip: compiled / model (6N per token; LoRA 4N)"] = (
      f"{train.flops / 1e12:.0f} / {train.model_flops / 1e12:.0f}")
  out[f"log-prob passes: optimal time x {logprobs.calls:.0f}"] = (
      f"{logprobs.optimal_s:.2f} s x {logprobs.calls:.0f} = {logprobs.optimal_s * logprobs.calls:.1f} s")
  decode = [p for p in report.programs if p.name.startswith("decode[")]
  full = max(decode, key=lambda p: int(re.search(r"pages=(\d+)", p.name).group(1)))
  one = progs.get("decode_1_step")
  out["decode call at the top page budget: temporaries"] = gb(full.temp)
  if one is not None:
    out["decode at the top page budget, compiler's estimate (loop body once): 16-step call / 1 step"] = (
        f"{full.raw_optimal_s * 1e3:.1f} / {one.raw_optimal_s * 1e3:.1f} ms")
  out["decode call (16 steps) at the top page budget: optimal time, loops applied"] = f"{full.optimal_s * 1e3:.0f} ms"
  rollout_s = sum(p.calls * p.optimal_s for p in report.programs if p.phase == "rollout" and p.calls)
  out["rollout, every response at max length: optimal time"] = f"{rollout_s:.0f} s"
  return out


def full_twin(cfg):
  """A LoRA config as full fine-tuning on the same target: lora off (its defaults), fp32 master weights as the
  released recipe's; batch, lengths, mesh, slots and remat as the config has them."""
  from pacs_jax import config as config_lib
  twin = config_lib.default_config().lora
  full = cfg.copy_and_resolve_references()
  full.lora = twin
  full.model.param_dtype = "float32"
  return full


def comparison(report, cfg, kind: str) -> dict[str, str]:
  """One column of the full vs LoRA table: resident weights, phase peaks with the share of memory left free, and
  the train step's cost (the compiler's optimal time on TPU; FLOPs and bytes on GPU, where nothing is timed)."""
  from pacs_jax.compile.aot_measure import GB
  gb = lambda x: f"{x / GB:.1f}"
  hbm = report.target.hbm_bytes
  out = {part: gb(report.resident["update"][part]) for part in WEIGHTS if part in report.resident["update"]}
  out["rollout weights (compute dtype, sample layout)"] = gb(report.resident["rollout"]["rollout weights"])
  out["decode state: KV cache (slots)"] = f"{gb(report.resident['rollout']['decode state (KV cache)'])} " \
                                          f"({cfg.rollout.slots})"
  for phase in ("rollout", "update"):
    total, largest = report.phase_total(phase)
    out[f"+ largest {phase} program (its temporaries etc.)"] = f"{gb(largest.extra)} ({largest.name})" if largest else "-"
    free = f"{100 * (1 - total / hbm):.0f}% free" if total <= hbm else "does not fit"
    out[f"**{phase} phase peak** (of {hbm / GB:g} GB)"] = f"**{gb(total)}** ({free})"
  train = next((p for p in report.programs if p.name == "train_step"), None)
  if train is None or train.error:
    out["train step TFLOP per update: compiled / model (6N; LoRA 4N per token)"] = "does not compile"
  else:
    out["train step TFLOP per update: compiled / model (6N; LoRA 4N per token)"] = (
        f"{train.flops / 1e12:.0f} / {train.model_flops / 1e12:.0f}")
    if kind == "tpu":
      out["train step: compiler's optimal time per update"] = f"{train.optimal_s:.1f} s"
    out["train step GB read + written per update (loops applied)"] = f"{train.bytes_accessed / GB:.0f}"
  problems = report.problems()
  out["verdict"] = "fits" if not problems else f"DOES NOT FIT: {problems[0]}"
  return out


def read_table(text: str, begin: str, end: str) -> dict[str, dict[str, str]]:
  """The columns of the table between the markers: {column: {row: value}} ({} without a table)."""
  lines = [line for line in text[text.index(begin):text.index(end)].splitlines() if line.startswith("|")]
  if len(lines) < 2:
    return {}
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split(" | ")]
  names = cells(lines[0])[1:]
  columns = {name: {} for name in names}
  for line in lines[2:]:
    row, *values = cells(line)
    for name, value in zip(names, values):
      if value != "-":
        columns[name][row] = value
  return columns


def write_table(columns: dict[str, dict[str, str]], doc: str, kind: str = "tpu") -> None:
  """The table between `kind`'s markers in `doc`: its columns now, the compiled ones replaced or added (a column
  of a config not compiled this time stays as it was)."""
  BEGIN, END = MARKERS[kind]
  text = open(doc).read()
  if BEGIN not in text or END not in text:
    raise SystemExit(f"{doc} has no {BEGIN} ... {END} markers")
  columns = {**read_table(text, BEGIN, END), **columns}
  rows = []
  for col in columns.values():  # every column's rows in its order: a new row goes before the next one placed
    order = list(col)
    for i, row in enumerate(order):
      if row not in rows:
        placed = [r for r in order[i + 1:] if r in rows]
        rows.insert(rows.index(placed[0]) if placed else len(rows), row)
  names = list(columns)
  unit = {"tpu": "chip", "gpu": "GPU"}[kind.removesuffix("_lora")]
  lines = [BEGIN, "", f"| per {unit}, compiled for the target (GB unless stated) | " + " | ".join(names) + " |",
           "|---|" + "---|" * len(names)]
  lines += [f"| {row} | " + " | ".join(columns[n].get(row, "-") for n in names) + " |" for row in rows]
  lines += ["", END]
  start, end = text.index(BEGIN), text.index(END) + len(END)
  with open(doc, "w") as f:
    f.write(text[:start] + "\n".join(lines) + text[end:])


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--configs", nargs="*", default=None,
                      help="config files (default: every one with a TPU topology, or with --gpu a GPU target)")
  parser.add_argument("--gpu", action="store_true", help="the GPU configs and docs/gpu.md's table")
  parser.add_argument("--no_docs", "--no_readme", dest="no_docs", action="store_true",
                      help="print only; leave docs/tpu.md and docs/gpu.md as they are")
  parser.add_argument("--no_validation", action="store_true", help="skip the validation (greedy) programs")
  args = parser.parse_args()
  from pacs_jax import config as config_lib
  from pacs_jax.compile import aot
  columns, lora_columns, status = {}, {}, 0
  kind = "gpu" if args.gpu else "tpu"

  def compile_one(cfg, name):
    start = time.perf_counter()
    report = aot.compile_run(cfg, validation=not args.no_validation, one_step_decode=not args.gpu,
                             log=lambda s: print(s, flush=True))
    report.config_name = name
    print(aot.format_report(report))
    print(f"{name}: {len(report.programs)} programs compiled in {time.perf_counter() - start:.0f} s", flush=True)
    return report

  for path in args.configs or target_configs(kind):
    cfg = config_lib.load_config_file(path)
    name = os.path.splitext(os.path.basename(path))[0]
    where = f"{cfg.hardware.gpu_target} {cfg.hardware.gpu_topology}" if args.gpu else cfg.hardware.tpu_topology
    report = compile_one(cfg, path)
    if config_lib.lora_spec(cfg):
      full = compile_one(full_twin(cfg), f"{path}, full fine-tuning")
      lora_columns[f"{name} as full fine-tuning ({where})"] = comparison(full, cfg, kind)
      lora_columns[f"{name}: LoRA rank {cfg.lora.rank} ({where})"] = comparison(report, cfg, kind)
    if not report.fits:
      status = 1
      continue
    columns[f"{name} ({where})"] = gpu_summary(report, cfg) if args.gpu else summary(report, cfg)
  if not args.no_docs:
    for table, key in ((columns, kind), (lora_columns, f"{kind}_lora")):
      if table:
        write_table(table, DOCS[kind], key)
        print(f"{os.path.relpath(DOCS[kind], ROOT)} table {key} updated")
  sys.exit(status)


if __name__ == "__main__":
  main()
