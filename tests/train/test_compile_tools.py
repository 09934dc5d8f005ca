"""`--compile_only` of a tool run (issue 43): the tiny tool demo compiled for a small TPU topology (libtpu, no TPU)
decodes with its turn end as a pause id and compiles the continue programs a conversation's observations take, at
every slot continued at once; the report counts them in the rollout phase's memory and time."""

import os

import jax
import pytest

from pacs_jax import config as config_lib
from pacs_jax.compile import aot
from tests.compile_report import assert_every_program_compiled, by_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY_TOOLS_TPU = """
import sys
sys.path.insert(0, {configs!r})
from tiny_tools_cpu import get_config as tiny_tools


def get_config():
  c = tiny_tools()
  c.hardware.tpu_topology = "v5p:2x2x1"  # one v5p host: 4 chips
  c.hardware.num_devices, c.hardware.num_processes, c.hardware.hbm_gb = 4, 1, 95.0
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 2, 2
  c.model.dtype, c.model.remat, c.model.attention_chunk = "bfloat16", True, 16
  c.data.max_prompt_length, c.rollout.max_new_tokens = 32, 64
  c.train.batch_prompts, c.train.mini_batch_prompts, c.train.micro_batch_prompts = 8, 4, 2
  c.rollout.slots = 32
  c.eval_every = 0
  c.compile.length_profile = ""
  return c
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  path = tmp_path_factory.mktemp("configs") / "tiny_tools_tpu.py"
  path.write_text(TINY_TOOLS_TPU.format(configs=os.path.join(ROOT, "configs")))
  cfg = config_lib.load_config_file(str(path))
  pauses = []  # (program, pause ids) of each rollout program lowered
  abstract_run = aot.abstract_run

  def recording(*args, **kwargs):
    state, policy, engine, progs = abstract_run(*args, **kwargs)
    for name in ("lower_insert_requests", "lower_decode", "lower_continue"):
      lower = getattr(engine, name)

      def wrapped(*a, _lower=lower, _name=name, **k):
        pauses.append((_name, k.get("pauses", a[5] if _name == "lower_insert_requests" and len(a) > 5 else 0)))
        return _lower(*a, **k)
      setattr(engine, name, wrapped)
    return state, policy, engine, progs

  mp = pytest.MonkeyPatch()
  mp.setattr(aot, "abstract_run", recording)
  try:
    with jax.default_matmul_precision("default"):
      return aot.compile_run(cfg), cfg, pauses
  finally:
    mp.undo()


def test_the_continue_programs_are_compiled_at_every_observation_bucket(report):
  report, cfg, pauses = report
  assert_every_program_compiled(report)
  # An observation here is at most max_new_tokens = 64 tokens (output_bytes 160 + the template exceed it): the
  # continue buckets 16, 32 and 64, each at the 32 slots continued at once.
  continues = by_name(report, "continue[")
  assert [p.name for p in continues] == ["continue[Q=32,T=16]", "continue[Q=32,T=32]", "continue[Q=32,T=64]"]
  for p in continues:
    assert p.phase == "rollout" and p.flops >= p.model_flops > 0 and p.optimal_s > 0, p
    # The decode state is donated: updated in place, not copied.
    assert p.alias >= report.resident["rollout"]["decode state (KV cache)"] * 0.99, p
  # The step's continue calls, bounded at the longest bucket: 2 waves of the 32 slots (8 prompts x 8 responses), each
  # continued after 2 of its 3 turns.
  assert [p.calls for p in continues] == [0.0, 0.0, 4.0]
  # Every rollout program of a conversation takes its one pause id (the turn end).
  assert {name for name, _ in pauses} == {"lower_insert_requests", "lower_decode", "lower_continue"}
  assert all(count == 1 for _, count in pauses), pauses


def test_the_report_counts_the_continue_programs(report):
  report, _, _ = report
  total, largest = report.phase_total("rollout")
  top = max(by_name(report, "continue["), key=lambda p: p.peak)
  assert total >= top.peak > 0 and largest is not None
  text = aot.format_report(report)
  assert "continue[Q=32,T=64]" in text and "fits in 95 GB per chip" in text
  assert report.fits
