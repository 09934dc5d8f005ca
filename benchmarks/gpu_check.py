"""The project on one GPU, in one command and a few minutes: the device and versions, the `gpu` tests and a fast subset
of the suite on the GPU, the demo to its 0.9 reward, the 1.5B recipe's train step, log-prob pass and decode (cuDNN
attention against the XLA path) with random weights of the real shapes, their peak memory against `--compile_only`'s
plan, and (in the background, on the CPU) the suite under this machine's jax. Writes gpu_check.json and
gpu_check.md to --out.

  bash benchmarks/gpu_check.sh                   # on the GPU machine (installs the wheels in .whl/ first)
  python benchmarks/gpu_check.py --dry           # CPU dry mode: every step it can, tiny shapes (tested in CI)

Each part runs in its own process with its own time limit, so a part that fails or runs over is reported and the
rest still run. The wheels the GPU machine lacks come from `python benchmarks/gpu_wheels.py` (run here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = "configs/qwen1p5b_1gpu.py"
# A fast subset of the suite that runs on one GPU (one device: no 8-device meshes): the model against transformers,
# the attention paths, the KV cache against the uncached forward, the objectives against their re-enactments.
FAST_TESTS = ("tests/models/test_flash_attention.py", "tests/models/test_qwen2_hf.py", "tests/models/test_paged.py",
              "tests/models/test_chunked_logprobs.py", "tests/algos/test_pacs.py", "tests/algos/test_grpo.py",
              "tests/rollout/test_sampling.py")
MODEL_PARTS = ("update_cudnn", "rollout", "rollout_short", "update_xla")  # "model": all four
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "grain",
            "transformers", "torch", "numpy", "math-verify")


def log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], timeout: float, env: dict | None = None, log_path: str | None = None) -> dict:
  """Runs `cmd` from the repo root; {rc, seconds, tail, timed_out} (rc None when it ran past `timeout`)."""
  start = time.perf_counter()
  full_env = {**os.environ, **(env or {})}
  full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
  try:
    p = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=max(timeout, 1))
    out, rc, timed_out = p.stdout + p.stderr, p.returncode, False
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    out += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    rc, timed_out = None, True
  if log_path:
    with open(log_path, "w") as f:
      f.write(out)
  return {"cmd": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - start, 1), "timed_out": timed_out,
          "tail": out[-3000:]}


def versions() -> dict:
  from importlib import metadata
  out = {"python": platform.python_version()}
  for name in VERSIONS:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return out


def device_line() -> dict:
  """The device, driver and versions (nvidia-smi where there is one)."""
  info = {"date": datetime.date.today().isoformat(), "host_cpus": os.cpu_count(), **versions()}
  try:
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    if q.returncode == 0 and q.stdout.strip():
      name, driver, memory, clock = [x.strip() for x in q.stdout.strip().splitlines()[0].split(",")]
      info.update(gpu=name, driver=driver, gpu_memory=memory, max_sm_clock=clock)
  except (OSError, subprocess.TimeoutExpired):
    pass
  return info


CEILINGS = r"""
import json, time, jax, jax.numpy as jnp
dry = {dry}
n = 512 if dry else 8192
def best(f, *a, reps=5):
  jax.block_until_ready(f(*a)); t = []
  for _ in range(reps):
    s = time.perf_counter(); jax.block_until_ready(f(*a)); t.append(time.perf_counter() - s)
  return sorted(t)[len(t) // 2]
k = jax.random.split(jax.random.key(0), 2)
a = jax.random.normal(k[0], (n, n), jnp.bfloat16); b = jax.random.normal(k[1], (n, n), jnp.bfloat16)
mm = jax.jit(lambda a, b: a @ b)
t = best(mm, a, b)
x = jax.random.normal(k[0], ((1 << 20) if dry else (1 << 30),), jnp.float32)  # 4 GiB on the GPU
cp = jax.jit(lambda x: x + 1.0)
tc = best(cp, x)
print(json.dumps({{"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                  "bf16_matmul_tflops": 2 * n ** 3 / t / 1e12, "matmul_n": n,
                  "copy_gbps": 2 * x.nbytes / tc / 1e9, "copy_bytes": x.nbytes}}))
"""


def last_json(text: str) -> dict | None:
  for line in reversed(text.strip().splitlines()):
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        return None
  return None


def pytest_counts(text: str) -> dict:
  """{'passed': n, 'failed': n, ...} from pytest's closing line."""
  counts = {}
  for line in reversed(text.splitlines()):
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line)
    if found and ("=" in line or " in " in line):
      counts = {k: int(v) for v, k in found}
      break
  return counts


def demo_reached(metrics_path: str, threshold: float = 0.9, window: int = 10) -> dict:
  """The demo's first step whose `window`-step mean reward reaches `threshold` (None if none), its steps and the
  median step time."""
  rewards, times = [], []
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      for line in f:
        row = json.loads(line)
        if "reward/mean" in row:
          rewards.append(row["reward/mean"])
          times.append(row.get("timing/step_s"))
  reached = next((i + 1 for i in range(window - 1, len(rewards))
                  if sum(rewards[i - window + 1:i + 1]) / window >= threshold), None)
  first = sum(rewards[:window]) / min(window, len(rewards)) if rewards else None
  times = sorted(t for t in times if isinstance(t, (int, float)))
  return {"steps": len(rewards), "first_10_mean_reward": first, "step_reaching_0.9": reached,
          "last_10_mean_reward": sum(rewards[-window:]) / min(window, len(rewards)) if rewards else None,
          "median_step_s": times[len(times) // 2] if times else None}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dry", action="store_true", help="CPU dry mode: every part it can, tiny shapes")
  parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "runs", "gpu_check"))
  parser.add_argument("--parts", default="env,ceilings,tests,demo,model,plan,cpu_suite",
                      help="comma-separated parts to run")
  parser.add_argument("--budget_s", type=float, default=480.0, help="all parts together (each has its own limit)")
  parser.add_argument("--demo_steps", type=int, default=300)
  parser.add_argument("--bandwidth_gbps", type=float, default=None,
                      help="the decode roofline's bandwidth when the ceilings part does not run")
  parser.add_argument("--mini_batch_prompts", type=int, default=8,
                      help="the 1.5B train step's prompts a call (the recipe's 32 make a call of ~20 s)")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  left = lambda: args.budget_s - (time.perf_counter() - start)
  platform_env = {"JAX_PLATFORMS": "cpu" if args.dry else "cuda"}
  result: dict = {"mode": "dry (CPU)" if args.dry else "gpu", "parts": {}}

  def save():
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
      json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
      f.write(summary(result))

  result["device"] = device_line()
  log(f"gpu_check ({result['mode']}): {json.dumps(result['device'])}; results to {args.out}")
  save()

  # The suite under this machine's jax, on its CPU, in the background while the GPU works (GPU machine only).
  suite = None
  if "cpu_suite" in parts and not args.dry:
    workers = max(2, (os.cpu_count() or 8) * 5 // 8)
    suite_log = open(os.path.join(args.out, "cpu_suite.log"), "w")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    suite = subprocess.Popen(["timeout", str(int(args.budget_s - 30)), sys.executable, "-m", "pytest", "-n",
                              str(workers), "-v", "-rf", "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=env,
                             stdout=suite_log, stderr=subprocess.STDOUT)
    log(f"cpu_suite: the suite on {workers} CPU workers in the background (cpu_suite.log)")
  # --compile_only's plan for the 1.5B recipe (the config's H100 target, compiled on this host's CPU).
  plan = None
  if "plan" in parts:
    plan_log = open(os.path.join(args.out, "compile_only.log"), "w")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    plan = subprocess.Popen(["timeout", str(int(args.budget_s - 30)), sys.executable, "-m", "pacs_jax.train",
                             "--config", CONFIG, "--compile_only"], cwd=ROOT, env=env, stdout=plan_log,
                            stderr=subprocess.STDOUT)
    log("plan: --compile_only for the recipe's H100 target in the background (compile_only.log)")

  if "ceilings" in parts:
    log("ceilings: bf16 matrix product and device copy")
    r = run([sys.executable, "-c", CEILINGS.format(dry=args.dry)], min(120, left()), platform_env)
    result["parts"]["ceilings"] = {**r, **(last_json(r["tail"]) or {})}
    log(f"  {result['parts']['ceilings'].get('bf16_matmul_tflops', 'failed')} TFLOP/s, "
        f"{result['parts']['ceilings'].get('copy_gbps', '-')} GB/s")
    save()

  model_parts = [name for name in MODEL_PARTS if name in parts or "model" in parts]
  if model_parts:
    bandwidth = result["parts"].get("ceilings", {}).get("copy_gbps") or args.bandwidth_gbps
    tiny = ["--tiny"] if args.dry else []
    mini = [] if args.dry else ["--mini_batch_prompts", str(args.mini_batch_prompts)]
    roofline = ["--bandwidth_gbps", str(bandwidth)] if bandwidth else []
    runs = {"update_cudnn": (["--phase", "update", "--attention", "xla" if args.dry else "cudnn", *mini], 200),
            "rollout": (["--phase", "rollout", *roofline], 150),
            # Short rows: the weights dominate each step's bytes (what the decode does apart from its attention).
            "rollout_short": (["--phase", "rollout", "--prompt_len", "64", "--new_tokens", "192", *roofline], 100),
            "update_xla": (["--phase", "update", "--attention", "xla", "--repeats", "1", *mini], 150)}
    for name in model_parts:
      extra, limit = runs[name]
      if left() < 30:
        result["parts"][name] = {"skipped": f"{left():.0f} s left of the budget"}
        continue
      log(f"model: {name} ({CONFIG}, random weights)")
      r = run([sys.executable, os.path.join(HERE, "gpu_model.py"), "--config", CONFIG, *extra, *tiny],
              min(limit, left() - 10), platform_env, os.path.join(args.out, f"{name}.log"))
      result["parts"][name] = {**r, **(last_json(r["tail"]) or {})}
      keep = ("train_step_s", "train_step_mfu", "logprobs_s", "decode_tokens_per_s", "decode_of_roofline",
              "measured_peak_gb", "planned_peak_gb", "compiled_gb_per_step_at_top", "roofline_gb_per_step_at_top", "rc")
      log(f"  {json.dumps({k: v for k, v in result['parts'][name].items() if k in keep})}")
      save()

  # The tests and the demo at once (small programs; each process takes GPU memory as it goes, not 75% of it).
  small_env = {**platform_env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  threads = []
  if "tests" in parts:
    def tests():
      selection = ["-m", "gpu"] if args.dry else []
      r = run([sys.executable, "-m", "pytest", "-v", "-rf", "--durations=10", "-p", "no:cacheprovider", *selection,
               *FAST_TESTS],
              min(150, left()), small_env, os.path.join(args.out, "tests.log"))
      g = run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "gpu", "tests"],
              min(90, left()), small_env, os.path.join(args.out, "tests_gpu.log"))
      result["parts"]["tests"] = {"subset": {**r, "counts": pytest_counts(r["tail"])},
                                  "gpu_marked": {**g, "counts": pytest_counts(g["tail"])}}
      log(f"tests: subset {result['parts']['tests']['subset']['counts']}, gpu-marked "
          f"{result['parts']['tests']['gpu_marked']['counts']}")
    threads.append(threading.Thread(target=tests))
  if "demo" in parts:
    def demo():
      steps = 3 if args.dry else args.demo_steps
      workdir = tempfile.mkdtemp(prefix="pacs_demo_")
      r = run([sys.executable, "-m", "pacs_jax.train", "--workdir", workdir, f"--config.steps={steps}",
               "--config.checkpoint.every=1000"], min(200, left()), small_env, os.path.join(args.out, "demo.log"))
      result["parts"]["demo"] = {**r, **demo_reached(os.path.join(workdir, "metrics.jsonl"))}
      log(f"demo: {json.dumps({k: v for k, v in result['parts']['demo'].items() if k not in ('tail', 'cmd')})}")
    threads.append(threading.Thread(target=demo))
  if threads:
    log(f"{' and '.join(p for p in ('tests', 'demo') if p in parts)} on {platform_env['JAX_PLATFORMS']}")
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  save()

  for name, proc, timeout in (("plan", plan, 60), ("cpu_suite", suite, max(left(), 10))):
    if proc is None:
      continue
    try:
      proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
    path = os.path.join(args.out, "compile_only.log" if name == "plan" else "cpu_suite.log")
    text = open(path).read()
    result["parts"][name] = {"rc": proc.returncode, "tail": text[-3000:]}
    if name == "plan":
      result["parts"][name].update(plan_peaks(text))
    else:
      result["parts"][name]["counts"] = pytest_counts(text)
    save()
  result["seconds"] = round(time.perf_counter() - start, 1)
  save()
  log(f"done in {result['seconds']} s: {os.path.join(args.out, 'gpu_check.md')}")
  print(summary(result))


def plan_peaks(text: str) -> dict:
  """The phase peaks (GB per GPU) from `--compile_only`'s table."""
  m = re.search(r"^\s*total\s+([\d.]+)\s+([\d.]+)\s*$", text, re.M)  # the resident table's last row
  return {"rollout_peak_gb": float(m.group(1)), "update_peak_gb": float(m.group(2))} if m else {}


def _fmt(x, spec=".3g"):
  return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def summary(result: dict) -> str:
  d, p = result["device"], result["parts"]
  lines = [f"# gpu_check ({result['mode']})", "",
           f"device: {d.get('gpu', 'no GPU')}, driver {d.get('driver', '-')}, jax {d.get('jax', '-')} "
           f"(jaxlib {d.get('jaxlib', '-')}, flax {d.get('flax', '-')}, optax {d.get('optax', '-')}, orbax "
           f"{d.get('orbax-checkpoint', '-')}), Python {d.get('python')}, {d.get('date')}", ""]
  c = p.get("ceilings", {})
  if c:
    lines += [f"ceilings: bf16 {c.get('matmul_n')}^3 matrix product {_fmt(c.get('bf16_matmul_tflops'))} TFLOP/s, "
              f"device copy {_fmt(c.get('copy_gbps'))} GB/s (read + written)", ""]
  t = p.get("tests", {})
  if t:
    lines += [f"tests on the device: subset {t['subset'].get('counts')} ({t['subset']['seconds']} s), gpu-marked "
              f"{t['gpu_marked'].get('counts')} ({t['gpu_marked']['seconds']} s)", ""]
  demo = p.get("demo", {})
  if demo:
    lines += [f"demo: {demo.get('steps')} steps, first 10 mean reward {_fmt(demo.get('first_10_mean_reward'))}, "
              f"10-step mean reward >= 0.9 at step {demo.get('step_reaching_0.9')}, last 10 "
              f"{_fmt(demo.get('last_10_mean_reward'))}, median step {_fmt(demo.get('median_step_s'))} s "
              f"({demo.get('seconds')} s in all, rc {demo.get('rc')})", ""]
  rows = [("update_cudnn", "cuDNN"), ("update_xla", "XLA")]
  if any(name in p for name, _ in rows):
    rows = [(name, p.get(name, {}).get("attention", label)) for name, label in rows]
    lines += ["| 1.5B update (random weights) | attention | train step s | TFLOP/s | MFU | log-prob pass s | MFU | "
              "compile s | measured peak GB | plan (this device) GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in rows:
      u = p.get(name, {})
      if u.get("train_step_s"):
        lines.append(f"| {u.get('tokens_per_call')} tokens a call | {label} | {_fmt(u['train_step_s'])} | "
                     f"{_fmt(u.get('train_step_tflops'))} | {_fmt(u.get('train_step_mfu'), '.1%')} | "
                     f"{_fmt(u.get('logprobs_s'))} | {_fmt(u.get('logprobs_mfu'), '.1%')} | "
                     f"{_fmt(u.get('train_step_compile_s'))} | {_fmt(u.get('measured_peak_gb'))} | "
                     f"{_fmt(u.get('planned_peak_gb'))} |")
      elif u:
        lines.append(f"| failed or skipped | {label} | rc {u.get('rc')} {u.get('skipped', '')} | | | | | | | |")
    lines.append("")
  r = p.get("rollout", {})
  if r.get("decode_tokens_per_s"):
    lines += [f"rollout: {r['slots']} slots, prompts of {r['prompt_len']}, {r['new_tokens']} new tokens each: prefill "
              f"{_fmt(r['prefill_tokens_per_s'])} tokens/s; decode {_fmt(r['decode_tokens_per_s'])} tokens/s "
              f"({_fmt(r['decode_step_ms'])} ms a step; weights {_fmt(r['weights_gb'])} GB + KV read "
              f"{_fmt(r['kv_read_per_step_gb'])} GB a step), roofline {_fmt(r.get('roofline_tokens_per_s'))} tokens/s "
              f"-> {_fmt(r.get('decode_of_roofline'), '.1%')} of it; measured peak {_fmt(r.get('measured_peak_gb'))} "
              "GB", ""]
  elif r:
    lines += [f"rollout: failed (rc {r.get('rc')})", ""]
  for name in ("rollout", "rollout_short"):
    r = p.get(name, {})
    if name == "rollout_short" and r.get("decode_tokens_per_s"):
      lines += [f"rollout, short rows ({r['prompt_len']} + {r['new_tokens']}): decode {_fmt(r['decode_tokens_per_s'])} "
                f"tokens/s ({_fmt(r['decode_step_ms'])} ms a step; weights {_fmt(r['weights_gb'])} GB + KV read "
                f"{_fmt(r['kv_read_per_step_gb'])} GB), {_fmt(r.get('decode_of_roofline'), '.1%')} of its roofline", ""]
    if r.get("compiled_gb_per_step_at_top"):
      lines += [f"{name}: the compiled decode call at its top page budget ({r['top_page_budget']}) moves "
                f"{_fmt(r['compiled_gb_per_step_at_top'])} GB a step (the compiler's bytes, loops applied) where the "
                f"roofline counts {_fmt(r['roofline_gb_per_step_at_top'])} GB", ""]
  pl = p.get("plan", {})
  if pl:
    lines += [f"--compile_only plan ({CONFIG}, H100 target, compiled on the CPU): rollout phase "
              f"{_fmt(pl.get('rollout_peak_gb'))} GB, update phase {_fmt(pl.get('update_peak_gb'))} GB (rc "
              f"{pl.get('rc')})", ""]
  s = p.get("cpu_suite", {})
  if s:
    lines += [f"the suite on this machine's CPU under jax {d.get('jax')}: {s.get('counts')} (rc {s.get('rc')})", ""]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
