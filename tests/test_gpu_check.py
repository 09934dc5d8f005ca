"""The GPU check (benchmarks/gpu_check.sh / .py) in its CPU dry mode, its parsers, and the wheel download for the GPU
machine (benchmarks/gpu_wheels.py, resolved against the package registry without downloading)."""

import json
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402


def _probe_wheel(folder) -> str:
  """A one-module wheel, as gpu_wheels.py would bring one."""
  path = os.path.join(folder, "pacs_probe_pkg-0.1-py3-none-any.whl")
  info = "pacs_probe_pkg-0.1.dist-info"
  files = {"pacs_probe_pkg.py": "VALUE = 7\n",
           f"{info}/METADATA": "Metadata-Version: 2.1\nName: pacs-probe-pkg\nVersion: 0.1\n",
           f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
  with zipfile.ZipFile(path, "w") as z:
    for name, text in files.items():
      z.writestr(name, text)
    z.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n")
  return path


def test_dry_mode_installs_the_wheels_runs_the_model_parts_and_writes_its_summary(tmp_path):
  wheels, site, out = tmp_path / "whl", tmp_path / "site", tmp_path / "out"
  wheels.mkdir()
  _probe_wheel(str(wheels))
  env = {**os.environ, "PACS_WHEELS_DIR": str(wheels), "PACS_WHEELS_SITE": str(site), "PYTHON": sys.executable}
  p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry", "--out", str(out),
                      "--parts", "env,ceilings,update_cudnn,rollout"], env=env, capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "1 wheels from" in p.stdout and (site / "pacs_probe_pkg.py").exists()
  result = json.loads((out / "gpu_check.json").read_text())
  assert result["mode"] == "dry (CPU)" and result["device"]["jax"]
  assert result["parts"]["ceilings"]["bf16_matmul_tflops"] > 0
  update, rollout = result["parts"]["update_cudnn"], result["parts"]["rollout"]
  assert update["rc"] == 0 and update["train_step_s"] > 0 and update["logprobs_s"] > 0
  assert update["tokens_per_call"] == update["rows_per_call"] * (32 + 32)  # the dry mode's prompt + response
  assert math_finite(update["metrics"]["loss"])
  assert rollout["rc"] == 0 and rollout["decode_tokens_per_s"] > 0 and rollout["decode_steps"] == 32
  assert rollout["compiled_gb_per_step_at_top"] > 0 and 0 < rollout["decode_of_roofline"]
  summary = (out / "gpu_check.md").read_text()
  assert "| 1.5B update" in summary and "rollout: 8 slots" in summary


def math_finite(x) -> bool:
  return x == x and abs(x) != float("inf")


def test_the_demo_the_plan_and_pytest_are_read_from_their_output(tmp_path):
  rows = [{"step": 0, "val/accuracy/all": 0.0}]
  rows += [{"step": i, "reward/mean": 0.3 if i <= 10 else 0.95, "timing/step_s": 0.1} for i in range(1, 31)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  demo = gpu_check.demo_reached(str(tmp_path / "metrics.jsonl"))
  assert demo["steps"] == 30 and demo["step_reaching_0.9"] == 20 and demo["first_10_mean_reward"] == pytest.approx(0.3)
  assert gpu_check.demo_reached(str(tmp_path / "none.jsonl"))["step_reaching_0.9"] is None
  table = "resident per GPU (GB)\n  total                                    35.81       40.20\n"
  assert gpu_check.plan_peaks(table) == {"rollout_peak_gb": 35.81, "update_peak_gb": 40.2}
  assert gpu_check.pytest_counts("...\n==== 2 failed, 677 passed, 1 skipped in 283.19s ====\n") == {
      "failed": 2, "passed": 677, "skipped": 1}


def test_the_wheels_are_what_the_machine_lacks_resolved_for_its_python():
  have = gpu_wheels.machine_packages(os.path.join(ROOT, "benchmarks", "gpu_machine_packages.txt"))
  assert {"jax", "flax", "optax", "orbax-checkpoint", "torch", "numpy"} <= have
  needs = gpu_wheels.wanted(gpu_wheels.project_needs(), have)
  names = {gpu_wheels.requirement_name(r) for r in needs}
  assert {"grain", "math-verify", "ml-collections", "tensorboardx"} <= names and not names & have
  p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_wheels.py"), "--dry_run"],
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  planned = [line.split()[0] for line in p.stdout.splitlines() if line.startswith("  ")]
  wheels = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("  ")]
  assert {"grain", "math-verify", "ml-collections"} <= {n.split("==")[0] for n in planned}
  assert not {n.split("==")[0] for n in planned} & have  # nothing the machine has is brought again
  assert all(w.endswith(".whl") and ("cp312" in w or "py3" in w or "abi3" in w) for w in wheels), wheels
