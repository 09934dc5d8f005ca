"""Split devices (issue 33, `rollout.devices`): the rollout on the last devices, the trainer on the rest, each
weight push a device-to-device copy (no shard read back to the host), timed and counted in the rows; with the
same meshes the split run's rows are those of a shared run on the trainer's devices alone, bitwise; one_step_off on
split devices overlaps the next rollout with the update and says by how much. On two processes (gloo, 4 CPU devices
each) each process gives 2 devices to each group, its push copies shards on its own devices only, and a split run
trains the rows of one process's split run, bitwise."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax._src import array as jax_array
from jax.sharding import NamedSharding, PartitionSpec as P

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.rollout import placement
from pacs_jax.trainer import loop
from tests.train.test_train_e2e import rows, tiny

class Reads(list):
  pushes = 0


SHARDED = {"mesh.fsdp": 2, "mesh.tensor": 2}
TIMING = ("timing/", "throughput/", "weights/")


@pytest.fixture
def host_reads(monkeypatch):
  """Counts arrays read back to the host (what `device_put` does when no device holds a shard it needs) while a
  weight push runs (`placement.push`), and pushes in `host_reads.pushes`."""
  reads, pushing = Reads(), []
  value, push = jax_array.ArrayImpl._value, placement.push
  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(lambda self: (pushing and reads.append(self.shape),
                                                                            value.fget(self))[1]))

  def counted_push(*args, **kwargs):
    pushing.append(True)
    reads.pushes += 1
    try:
      return push(*args, **kwargs)
    finally:
      pushing.pop()
  monkeypatch.setattr(placement, "push", counted_push)
  return reads


def test_the_push_copies_shards_device_to_device(host_reads):
  trainer_devices, rollout_devices = placement.split_devices(jax.devices(), 4)
  assert [d.id for d in rollout_devices] == [4, 5, 6, 7]
  trainer = sharding.make_mesh(1, 2, 2, devices=trainer_devices)
  rollout = placement.rollout_mesh(rollout_devices, tensor=2)
  assert dict(rollout.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
  w = np.arange(64, dtype=np.float32).reshape(8, 8)
  weights = {"w": jax.device_put(w, NamedSharding(trainer, P(None, "tensor"))),
             "norm": jax.device_put(np.ones(8, np.float32), NamedSharding(trainer, P()))}
  target = {"w": NamedSharding(rollout, P(None, "tensor")), "norm": NamedSharding(rollout, P())}
  stats = placement.PushStats()
  pushed = placement.push(weights, target, stats)
  assert host_reads == [] and host_reads.pushes == 1
  assert {d.id for d in pushed["w"].sharding.device_set} == {4, 5, 6, 7}
  np.testing.assert_array_equal(np.asarray(pushed["w"]), np.asarray(weights["w"]))
  row = stats.take()
  # Each of the 4 rollout devices holds half of w (tensor 2) and the whole norm.
  assert row["weights/pushes"] == 1 and row["weights/push_bytes"] == 4 * (32 + 8) * 4 and row["weights/push_s"] > 0
  assert stats.take()["weights/pushes"] == 0  # counted once
  # A layout the trainer's mesh holds no shard of would be assembled on the host: the check says so.
  assert placement.device_to_device(weights["w"].sharding, target["w"], (8, 8))
  assert not placement.device_to_device(weights["w"].sharding, NamedSharding(rollout, P("fsdp", "tensor")), (8, 8))
  # The push on several processes (`local_copy`: each shard from the same shard on the same process) reads nothing.
  copied = placement.local_copy(weights["w"], target["w"])
  assert host_reads == [] and copied.sharding == target["w"]
  np.testing.assert_array_equal(np.asarray(copied), w)
  placement.push(weights["w"], NamedSharding(rollout, P("fsdp", "tensor")))
  assert host_reads  # (the instrument sees a host round trip when there is one)


def run(workdir, devices=None, **overrides) -> tuple[loop.Trainer, list[dict]]:
  trainer = loop.Trainer(tiny(**SHARDED, **overrides), str(workdir), devices=devices)
  trainer.run()
  return trainer, rows(workdir)


@pytest.mark.slow  # two runs of three steps
def test_a_split_run_trains_as_a_shared_run_on_the_trainers_devices(tmp_path, host_reads):
  assert jax.device_count() == 8
  trainer, split = run(tmp_path / "split", **{"rollout.devices": 4})
  assert {d.id for d in trainer.mesh.devices.flat} == {0, 1, 2, 3}
  assert {d.id for d in trainer.rollout_mesh.devices.flat} == {4, 5, 6, 7}
  assert host_reads.pushes == 5 and host_reads == []  # every push stayed on the devices
  _, shared = run(tmp_path / "shared", devices=jax.devices()[:4])  # the same meshes' shapes, one group
  assert [r["step"] for r in split] == [r["step"] for r in shared] == [0, 1, 2, 3]
  for a, b in zip(shared, split):
    same = sorted(k for k in a if not k.startswith(TIMING))
    assert sorted(k for k in b if not k.startswith(TIMING)) == same
    for k in same:
      assert a[k] == b[k], (a["step"], k, a[k], b[k])  # bitwise: the same floats
  # Each push writes every rollout device's shards: tensor-split weights twice (fsdp 2), whole ones 4 times.
  engine = trainer.sampler.ahead_of_time()
  per_push = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize * 4
                 for x, s in zip(jax.tree.leaves(engine.abstract_params()), jax.tree.leaves(engine.param_shardings)))
  # A row counts the pushes since the last row: step 1's, step 0's validation and its rollout; step 2's, its rollout
  # (its validation runs after its row); step 3's, step 2's validation and its rollout.
  assert [r["weights/pushes"] for r in split[1:]] == [2.0, 1.0, 2.0]
  for r in split[1:]:
    assert r["weights/push_bytes"] == r["weights/pushes"] * per_push and r["weights/push_s"] > 0
    assert r["timing/rollout_wall_s"] > 0 and r["timing/update_wall_s"] > 0 and r["timing/overlap_fraction"] == 0.0


@pytest.mark.slow  # three steps
def test_one_step_off_on_split_devices_overlaps_the_rollout_with_the_update(tmp_path, host_reads):
  trainer, logged = run(tmp_path, eval_every=0, algorithm="grpo",
                        **{"rollout.devices": 4, "rollout.mode": "one_step_off", "rollout.tis_imp_ratio_cap": 2.0})
  assert trainer.next_rollout.started == 2 and host_reads.pushes == 3 and host_reads == []
  assert [r["rollout/staleness_max"] for r in logged] == [0.0, 1.0, 1.0]
  assert logged[0]["timing/overlap_fraction"] == 0.0  # step 1's rollout ran alone
  for r in logged[1:]:  # steps 2 and 3 were sampled on the rollout's devices during the previous update
    assert 0.0 < r["timing/overlap_fraction"] <= 1.0 and r["timing/overlap_s"] > 0, r
    assert np.isfinite(r["loss"])
  # A background push is counted in the row being built when it finishes: three in all, one per rollout.
  assert sum(r["weights/pushes"] for r in logged) == 3.0


@pytest.mark.parametrize("rollout_devices, devices, processes, message", [
    (8, 8, 1, "leaves none for the trainer"),
    (-1, 8, 1, "must be an integer >= 0"),
    (1, 7, 1, "mesh.tensor=2"),  # the trainer's 6 take tensor 2, the rollout's 1 cannot
    (3, 8, 2, "do not divide among the 2 processes"),
])
def test_bad_splits_name_the_field(rollout_devices, devices, processes, message):
  cfg = tiny(**{"mesh.fsdp": -1, "mesh.tensor": 2, "train.batch_prompts": 12, "train.mini_batch_prompts": 6,
                "rollout.devices": rollout_devices})
  with pytest.raises(config_lib.ConfigError, match=f"config.rollout.devices: .*{message}"):
    config_lib.validate(cfg, num_devices=devices, num_processes=processes, check_paths=False)


def two_processes(*args, devices: int = 4) -> list[str]:
  """`python -m ARGS... COORDINATOR PROCESS_ID` on two processes of `devices` CPU devices each: their outputs."""
  from tests import test_multihost as mh
  port = mh.portpicker.pick_unused_port()
  procs = [subprocess.Popen([sys.executable, "-m", *args, f"127.0.0.1:{port}", str(i)], env=mh.env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  return outs


def test_the_push_on_two_processes_copies_each_shard_on_its_own_host():
  outs = two_processes("tests.train.split_push_worker")
  results = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out in outs]
  for process, r in enumerate(results):
    assert r["layout"] is None
    # Each process's first 2 devices train, its last 2 sample.
    assert [p for _, p in r["trainer"]] == [p for _, p in r["rollout"]] == [0, 0, 1, 1]
    assert r["pushed_on"] == sorted(i for i, _ in r["rollout"])
    assert r["local"] == [i for i, p in r["rollout"] if p == process]
    assert r["reads"] == [] and r["shards_equal"]  # device to device, every shard right
    # Every rollout device's bytes (both processes'): half of w (tensor 2) and the whole norm on each of 4.
    assert r["row"]["weights/pushes"] == 1 and r["row"]["weights/push_bytes"] == 4 * (32 + 8) * 4
    # jax's own device_put refuses this reshard (different device sets across processes).
    assert "cross-host reshard" in r["device_put"]


@pytest.mark.slow  # two runs of three steps, one on two processes
def test_a_split_run_on_two_processes_trains_as_one_process(tmp_path):
  from tests import test_multihost as mh
  extra = ["--config.mesh.tensor=2", "--config.rollout.devices=4", "--config.rollout.mode=one_step_off",
           "--config.rollout.max_staleness=1", "--config.algorithm=grpo", "--config.rollout.tis_imp_ratio_cap=2.0",
           "--config.steps=3", "--config.eval_every=2", "--config.data.synthetic_val_size=8"]
  one, two = tmp_path / "one", tmp_path / "two"
  mh.run_one(one, *extra, devices=8)  # trainer on devices 0-3, rollout on 4-7
  outs = mh.run_two(two, *extra, devices=4)  # on each process: trainer on its first 2, rollout on its last 2
  assert "devices    4 x cpu (mesh data=1 fsdp=2 tensor=2)" in outs[0]
  for a, b in zip(mh.final_params(str(one), 3), mh.final_params(str(two), 3), strict=True):
    np.testing.assert_array_equal(a, b)
  rows_one, rows_two = mh.metrics(one), mh.metrics(two)
  assert [r["step"] for r in rows_two] == [0, 1, 2, 3]  # step 0: the validation before training
  assert [r["rollout/staleness_max"] for r in rows_two[1:]] == [0, 1, 1]
  for a, b in zip(rows_one, rows_two, strict=True):
    same = sorted(k for k in a if not k.startswith(TIMING))
    assert sorted(k for k in b if not k.startswith(TIMING)) == same
    for k in same:
      assert a[k] == b[k], (a["step"], k, a[k], b[k])  # bitwise: the same floats
  for a, b in zip(rows_one[1:], rows_two[1:]):  # a push is counted in the next step's row
    for k in ("weights/pushes", "weights/push_bytes"):
      assert a[k] == b[k], (a["step"], k)
    assert (b["weights/push_s"] > 0) == (b["weights/pushes"] > 0)
  assert any(k.startswith("val/") for k in rows_two[0]) and any(k.startswith("val/") for k in rows_two[2])
  # One push per rollout (3) and per validation (steps 0 and 2), on each process.
  assert sum(r["weights/pushes"] for r in rows_two[1:]) == 5.0 and rows_two[1]["weights/push_bytes"] > 0


def test_a_split_whose_mesh_does_not_fit_the_trainers_share_names_what_to_set():
  """Issue 44: `--config.rollout.devices=4` alone on the demo (mesh.fsdp=1) on 8 devices says how to give the trainer
  the other 4, instead of a bare "data*fsdp*tensor = 1 but there are 4 devices"."""
  cfg = tiny(**{"mesh.fsdp": 1, "rollout.devices": 4})
  with pytest.raises(config_lib.ConfigError, match=r"rollout.devices=4 leaves the trainer 4 devices; set "
                                                   r"--config.mesh.fsdp=-1"):
    config_lib.validate(cfg, num_devices=8, num_processes=1, check_paths=False)
