"""A tool run killed with SIGKILL mid-conversation (a sandbox program running) and restarted (issue 43): no prompt
lost or repeated (each step's conversations are of the uninterrupted run's prompts, with its turns), each metrics
row once, and no sandbox program outlives the killed trainer."""

import json
import os
import sys
import time

import pytest

from pacs_jax.envs import sandbox as sandbox_lib
from pacs_jax.services.metrics import read_rows
from tests import kill_loop
from tests.processes import live_processes
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4
# The random init (no warm-up): it calls the tool in a fifth to a third of its responses, so every step runs
# programs to kill the trainer among; the demo's warmed-up base calls in a few percent (test_tool_demo_learns.py).
ARGS = [f"--config.steps={STEPS}", "--config.eval_every=0", "--config.checkpoint.every=1", "--config.model.warmup=",
        "--config.train.batch_prompts=4", "--config.train.mini_batch_prompts=4", "--config.rollout.n=4"]


def trainer_cmd(workdir):
  return [sys.executable, "-m", "pacs_jax.train", "--config", os.path.join(ROOT, "configs", "tiny_tools_cpu.py"),
          "--workdir", str(workdir), f"--config.rollout_data_dir={workdir}/dumps", *ARGS]


def env():
  return {**os.environ, "XLA_FLAGS": child_env.xla_flags(), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer")}


def sandbox_programs(trainer_pid: int) -> list[int]:
  """Live sandbox processes the trainer started."""
  return [p[0] for p in live_processes() if p[1] == trainer_pid and sandbox_lib.CHILD in p[4]]


def checkpointed(workdir) -> bool:
  """A finished checkpoint is in the workdir (a save in flight has a temporary name)."""
  folder = os.path.join(workdir, "checkpoints")
  return os.path.isdir(folder) and any(name.isdigit() for name in os.listdir(folder))


def alive(pid: int) -> bool:
  """Whether sandbox process `pid` still runs (a zombie waiting for its reaper does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return state != "Z" and sandbox_lib.CHILD in f.read().decode(errors="replace")
  except OSError:
    return False


def conversations(workdir) -> dict[int, list[tuple]]:
  """Each step's dumped conversations: (prompt, turns, observations), in the dump's order."""
  out = {}
  for step in range(1, STEPS + 1):
    with open(os.path.join(workdir, "dumps", f"{step}.jsonl")) as f:
      out[step] = [(r["input"], r["turns"], r["observations"]) for r in map(json.loads, f)]
  return out


@pytest.mark.slow
def test_a_tool_run_killed_mid_conversation_resumes_with_each_prompt_once(tmp_path):
  straight = tmp_path / "straight"
  kill_loop.run_to_the_end(trainer_cmd(straight), env())
  workdir = tmp_path / "run"
  proc = kill_loop.start(trainer_cmd(workdir), env())
  programs = []

  def mid_conversation() -> bool:  # a step's checkpoint written, and a model's program running in the sandbox
    nonlocal programs
    programs = checkpointed(workdir) and sandbox_programs(proc.pid)
    return bool(programs)

  kill_loop.wait_for(mid_conversation, proc, poll=0.002)
  proc.kill()  # SIGKILL, a program running
  proc.communicate()
  deadline = time.monotonic() + 5
  while any(map(alive, programs)):
    assert time.monotonic() < deadline, "a sandbox program outlived the killed trainer"
    time.sleep(0.05)
  assert "resumed from step" in kill_loop.run_to_the_end(trainer_cmd(workdir), env())
  assert [r["step"] for r in kill_loop.rows(workdir)] == list(range(1, STEPS + 1))  # each row once
  assert conversations(workdir) == conversations(straight)  # each step's prompts once, none lost, the same turns
