"""The built-in demo learns: PACS (the README's main command), GRPO and PPO on configs/tiny_cpu.py; each run is the
README's command as it is, and its row of `python -m pacs_jax.compare`'s table is the README's demo table's."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pacs_jax.study import compare_runs as compare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The table's columns a run decides (the step-time columns measure the machine): steps, reward (last 10%), val
# accuracy (last), entropy (last), response length (last), as (absolute, relative) tolerances: what the README
# prints plus another CPU's float noise, which over hundreds of sampled steps moves the last step's entropy by a few
# percent (GRPO's: 2.431 and 2.507 on two machines), and a collapsed entropy (PPO's) by some hundredths. The
# README's GRPO entropy read 0.240 and PPO's 0.064 (issue 35). PPO's last entropy is the exception: whether it has
# collapsed by step 300 depends on the processor (0.064, 0.664 and 0.028 on three machines, each bitwise on its own):
# the README's row is the machine's that last ran CI; on another, rerun the baselines and regenerate the table.
DECIDED = {1: (0, 0), 2: (0.01, 0), 3: (0.01, 0), 4: (0.05, 0.1), 5: (0.1, 0)}


def run(tmp_path, config_arg, *extra):
  env = {**os.environ, "XLA_FLAGS": "", "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer")}
  out = subprocess.run([sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", config_arg),
                        "--workdir", str(tmp_path), *extra], env=env, capture_output=True, text=True, timeout=1500)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]


def readme_row(label: str) -> list[str]:
  """The README's demo table's row of `label` (PACS, GRPO or PPO), its cells as the compare command prints them."""
  text = open(os.path.join(ROOT, "README.md")).read()
  table = text[text.index("```\nrun   steps"):].split("```")[1]
  return next(line.split() for line in table.splitlines() if line.startswith(label + " "))


def assert_readme_row(label: str, workdir) -> None:
  """The run's row of compare's summary table equals the README's in the columns the run decides."""
  header, row = compare.summary_rows({label: compare.read_run(str(workdir))})
  readme = readme_row(label)
  for column, (absolute, relative) in DECIDED.items():
    tolerance = absolute + relative * abs(float(readme[column]))
    assert abs(float(row[column]) - float(readme[column])) <= tolerance, (
        f"README's demo table drifted: {label} {header[column]} is {row[column]}, the README says {readme[column]}; "
        "rerun the README's baselines and `python -m pacs_jax.compare ... --labels PACS,GRPO,PPO`")


def rewards(rows):
  return [r["reward/mean"] for r in rows if "reward/mean" in r]


@pytest.mark.slow
def test_pacs_demo_reaches_0p9(tmp_path):
  r = rewards(run(tmp_path, "tiny_cpu.py"))
  assert np.mean(r[:20]) < 0.5  # it starts near the random model's rate ...
  assert np.mean(r[-20:]) >= 0.9  # ... and the last 20 steps average at least 0.9
  assert_readme_row("PACS", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_baselines_learn_the_demo_task(tmp_path, algorithm):
  rows = run(tmp_path, f"tiny_cpu.py:{algorithm}")  # the README's command
  r = rewards(rows)
  assert np.mean(r[:20]) < 0.5
  assert np.mean(r[-20:]) >= 0.9
  assert any(k.startswith("actor/") for k in rows[-1])
  if algorithm == "ppo":
    assert "critic/vf_loss" in rows[-1] and "critic/grad_norm" in rows[-1]
  assert_readme_row(algorithm.upper(), tmp_path)
