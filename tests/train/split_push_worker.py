"""One of two processes (gloo, 4 CPU devices each) pushing weights from the trainer's group to the rollout's as a
split run lays them out (`placement.split_devices`: each process's last 2 devices go to the rollout), counting the
arrays read back to the host while the push runs; prints one JSON line. Run by
tests/train/test_split_devices.py::test_the_push_on_two_processes_copies_each_shard_on_its_own_host.

  python -m tests.train.split_push_worker COORDINATOR_ADDRESS PROCESS_ID
"""

import json
import sys

import jax
import numpy as np
from jax._src import array as jax_array
from jax.sharding import NamedSharding, PartitionSpec as P


def main(address: str, process_id: int) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=2, process_id=process_id)
  from pacs_jax import sharding
  from pacs_jax.rollout import placement
  trainer_devices, rollout_devices = placement.split_devices(jax.devices(), 4)
  trainer = sharding.make_mesh(1, 2, 2, devices=trainer_devices)
  rollout = placement.rollout_mesh(rollout_devices, tensor=2)
  w = np.arange(64, dtype=np.float32).reshape(8, 8)
  weights = {"w": jax.device_put(w, NamedSharding(trainer, P(None, "tensor"))),
             "norm": jax.device_put(np.ones(8, np.float32), NamedSharding(trainer, P()))}
  target = {"w": NamedSharding(rollout, P(None, "tensor")), "norm": NamedSharding(rollout, P())}
  refused = ""
  try:  # what jax itself does with this reshard
    jax.device_put(weights["w"], target["w"])
  except ValueError as e:
    refused = str(e).splitlines()[0]
  reads, value = [], jax_array.ArrayImpl._value
  jax_array.ArrayImpl._value = property(lambda self: (reads.append(self.shape), value.fget(self))[1])
  stats = placement.PushStats()
  pushed = placement.push(weights, target, stats)
  jax_array.ArrayImpl._value = value
  shards_equal = all(np.array_equal(np.asarray(shard.data), w[shard.index]) for shard in pushed["w"].addressable_shards)
  print(json.dumps({
      "trainer": [[d.id, d.process_index] for d in trainer_devices],
      "rollout": [[d.id, d.process_index] for d in rollout_devices],
      "pushed_on": sorted(d.id for d in pushed["w"].sharding.device_set),
      "local": sorted(d.id for d in pushed["w"].sharding.addressable_devices),
      "reads": reads, "shards_equal": shards_equal, "row": stats.take(), "device_put": refused,
      "layout": placement.process_layout(trainer_devices, rollout_devices)}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
