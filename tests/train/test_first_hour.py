"""A researcher's first hour, as the README shows it: the demo, then the README's export / evaluate and baseline /
compare commands, run as they are (from a fresh folder, two steps each instead of hundreds). Each baseline
trains its own run and leaves the demo's checkpoints untouched; a finished run says so; compare writes a PNG
and a table of the three runs."""

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from pacs_jax.services import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = ["--config.steps=2", "--config.eval_every=1"]  # what the test adds to the README's train commands


def readme_block(heading: str) -> list[list[str]]:
  """The argv of each command in the first bash block under `## heading`."""
  text = open(os.path.join(ROOT, "README.md")).read()
  section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
  block = re.search(r"```bash\n(.+?)\n```", section, re.S).group(1)
  return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def run(argv: list[str], cwd) -> subprocess.CompletedProcess:
  """A README command from `cwd`: `python` is this interpreter, `configs/` the repository's. JAX_PLATFORMS is
  left unset, as a user's shell has it."""
  assert argv[:2] == ["python", "-m"], argv
  argv = [sys.executable] + [a.replace("configs/", os.path.join(ROOT, "configs", "")) for a in argv[1:]]
  if argv[2] == "pacs_jax.train":
    argv += QUICK
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env.update(XLA_FLAGS="", PACS_JAX_COMPILATION_CACHE=os.path.join(ROOT, ".jax_cache", "trainer"))
  out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  if not runtime.accelerator_present():  # no libtpu / CUDA plugin failures on a host without accelerators
    assert "TPU_WORKER_HOSTNAMES" not in out.stderr and "Unable to load CUDA" not in out.stderr, out.stderr[-3000:]
  return out


def checkpoint_digest(workdir) -> dict[str, str]:
  files = {}
  for folder, _, names in os.walk(workdir / "checkpoints"):
    for name in names:
      path = os.path.join(folder, name)
      files[os.path.relpath(path, workdir)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
  return files


def steps_logged(workdir) -> list[int]:
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line)["step"] for line in f]


@pytest.mark.slow
def test_demo_then_readme_commands(tmp_path):
  demo = run(["python", "-m", "pacs_jax.train"], tmp_path)  # the quick start's command
  runs = tmp_path / "runs"
  assert "workdir    " + str(runs / "tiny_cpu-pacs") in demo.stdout
  for line in ("algorithm pacs", "model      preset tiny", "tokenizer  synthetic", "data       train synthetic/mod3",
               "devices    1 x cpu", "done at step 2"):
    assert line in demo.stdout, demo.stdout
  demo_checkpoints = checkpoint_digest(runs / "tiny_cpu-pacs")
  assert demo_checkpoints

  export, evaluate = readme_block("After the demo: export and evaluate")
  run(export, tmp_path)
  evaluated = run(evaluate, tmp_path)
  assert "pass@8" in evaluated.stdout
  with open(tmp_path / "exported" / "eval_metrics.json") as f:
    assert set(json.load(f)["synthetic/mod3"]) == {"pass@1", "pass@2", "pass@4", "pass@8"}

  *baselines, compare = readme_block("Baselines and comparison")
  for argv, algorithm in zip(baselines, ("grpo", "ppo")):
    out = run(argv, tmp_path)
    assert f"algorithm {algorithm}" in out.stdout and "resumed" not in out.stdout
    assert steps_logged(runs / f"tiny_cpu-{algorithm}") == [0, 1, 2]
  assert checkpoint_digest(runs / "tiny_cpu-pacs") == demo_checkpoints  # the demo's run is as it was
  assert steps_logged(runs / "tiny_cpu-pacs") == [0, 1, 2]

  compared = run(compare, tmp_path)
  assert os.path.getsize(tmp_path / "compare.png") > 10_000
  table = compared.stdout.splitlines()
  assert table[0].split()[:3] == ["run", "steps", "reward"]
  assert [row.split()[0] for row in table[1:4]] == ["tiny_cpu-pacs", "tiny_cpu-grpo", "tiny_cpu-ppo"]
  assert all(row.split()[1] == "2" for row in table[1:4])

  again = run(["python", "-m", "pacs_jax.train"], tmp_path)
  assert "already at step 2 of config.steps=2" in again.stdout
  assert checkpoint_digest(runs / "tiny_cpu-pacs") == demo_checkpoints
