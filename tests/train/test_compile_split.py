"""`--compile_only` for split devices (issue 33, acceptance 6): on a small TPU topology (libtpu, no TPU) the update
programs compile for the trainer's chips and the rollout programs for the rollout's, each group's memory is checked,
and the sync and overlapped step estimates follow from the groups' compiled times."""

import collections
import os

import jax
import pytest

from pacs_jax import config as config_lib
from pacs_jax.compile import aot_split as split
from pacs_jax.rollout import placement
from pacs_jax.trainer import split as trainer_split
from pacs_jax.compile.aot_report import step_seconds
from pacs_jax.compile.target import target
from tests.train.test_compile_only import run_cli, tiny_tpu_config  # noqa: F401 (a fixture)

SPLIT = {"rollout.devices": 2, "mesh.fsdp": -1}  # v5p:2x2x1: the trainer on chips 0-1, the rollout on 2-3


@pytest.fixture(scope="module")
def split_report(tiny_tpu_config):  # noqa: F811
  cfg = config_lib.load_config_file(tiny_tpu_config, SPLIT)
  with jax.default_matmul_precision("default"):
    return split.compile_split(cfg, target(cfg)), cfg


def test_each_group_compiles_its_own_programs_and_fits(split_report):
  report, cfg = split_report
  trainer = {p.name for p in report.trainer.programs}
  rollout = {p.name for p in report.rollout.programs}
  assert {"to_sample_params", "logprobs", "train_step"} <= trainer and not any("decode" in n for n in trainer)
  assert any(n.startswith("decode[") for n in rollout) and any(n.startswith("prefill[") for n in rollout)
  assert not {"train_step", "to_sample_params"} & rollout
  assert {d.id for d in report.trainer.target.devices} | {d.id for d in report.rollout.target.devices} == {0, 1, 2, 3}
  assert report.trainer.mesh_shape == {"data": 1, "fsdp": 1, "tensor": 2}
  assert report.rollout.mesh_shape == {"data": 1, "fsdp": 1, "tensor": 2}
  assert not report.trainer.failed and not report.rollout.failed and report.fits
  # The trainer's chips hold the weights it pushes beside its state; the rollout's, the pushed copy and the cache.
  assert set(report.rollout.resident) == {"rollout"} and set(report.trainer.resident) == {"update"}
  assert report.trainer.resident["update"]["rollout weights (staged for the push)"] == report.push_bytes > 0
  assert report.rollout.resident["rollout"]["decode state (KV cache)"] > 0


def test_the_step_estimates_add_up(split_report):
  report, _ = split_report
  update, rollout, push = step_seconds(report.trainer, "update"), report.rollout_s(), report.push_s
  assert update > 0 and rollout > 0 and 0 < push < 1e-3  # a few MB over ICI
  sync, overlapped = report.step_s()
  assert sync == pytest.approx(rollout + push + update) and overlapped == pytest.approx(max(rollout + push, update))
  assert report.waves == 2  # 8 prompts x 8 responses in 32 slots
  # Shorter responses: fewer decode calls, down to one wave's (the longest response still runs to its end).
  assert report.rollout_s(0.5) < rollout and report.rollout_s(0.25) == pytest.approx(report.rollout_s(0.5))
  text = split.format_split(report, num_processes=1)
  assert "every one at max (worst case)" in text and "both groups fit" in text
  # At the length profiles (issue 42; here `max` alone, compile.length_profile ""): the rollout group's decode
  # with its kernel, the trainer's padded update.
  steps = {e["profile"]: e for e in report.estimates()}
  assert set(steps) == {"max"} and steps["max"]["rollout_s"] > rollout - step_seconds(report.rollout, "rollout", "decode")
  for e in steps.values():
    assert e["update_s"] == pytest.approx(update) and e["sync_s"] == pytest.approx(e["rollout_s"] + push + update)
    assert e["overlapped_s"] == pytest.approx(max(e["rollout_s"] + push, update))
  assert "whole RL step by length profile" in text


def test_compile_only_on_a_split_prints_the_groups_and_the_estimates(tiny_tpu_config, tmp_path):  # noqa: F811
  proc = run_cli("--config", tiny_tpu_config, "--compile_only", "--config.rollout.devices=2", "--config.mesh.fsdp=-1")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "== rollout group ==" in proc.stdout and "overlapped s" in proc.stdout and "both groups fit" in proc.stdout


def test_a_multi_host_split_compiles_the_groups_the_runtime_runs():
  """v5p:2x4x4 (8 hosts of 2x2x1 chips) split 16/16 along its first axis: every host holds 2 chips of each group
  (x = 0 trains, x = 1 samples), the groups `--compile_only` compiles for are the runtime's meshes' devices, and
  the run's config is accepted; v5p:4x4x4 split 32/32 gives each group whole hosts, which the run refuses."""
  configs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
  for name, k, runs in (("qwen3b_v5p", 16, True), ("qwen7b_v5p", 32, False)):
    cfg = config_lib.load_config_file(os.path.join(configs, f"{name}.py"), {"rollout.devices": k, "mesh.fsdp": -1})
    tgt = target(cfg)
    (_, trainer), (_, rollout) = split.group(cfg, tgt, "trainer"), split.group(cfg, tgt, "rollout")
    mesh, rollout_mesh = trainer_split.meshes(cfg, list(tgt.devices))
    assert set(mesh.devices.flat) == set(trainer.devices) and set(rollout_mesh.devices.flat) == set(rollout.devices)
    hosts = [collections.Counter(d.process_index for d in g.devices) for g in (trainer, rollout)]
    if runs:
      assert {d.coords[0] for d in rollout.devices} == {1} and {d.coords[0] for d in trainer.devices} == {0}
      assert hosts[0] == hosts[1] == {p: 2 for p in range(8)}
      assert placement.process_layout(trainer.devices, rollout.devices) is None
      config_lib.validate(cfg, num_processes=tgt.num_processes, devices=list(tgt.devices), check_paths=False)
    else:
      assert not set(hosts[0]) & set(hosts[1])  # whole hosts on each side
      with pytest.raises(config_lib.ConfigError, match="config.rollout.devices: .*every process needs devices in both"):
        config_lib.validate(cfg, num_processes=tgt.num_processes, devices=list(tgt.devices), check_paths=False)
