"""A packed run (`train.packing`, issue 42) trains as the padded one: the same metrics rows to 1e-5 over two steps
(a full PACS run on an 8-device mesh; a LoRA PPO run, with its value pass), and a packed run stopped after its
first step and resumed from the checkpoint ends bitwise where the uninterrupted packed run ends."""

import os

import jax
import numpy as np

from pacs_jax.services.metrics import METRICS_FILE, read_rows
from pacs_jax.trainer import loop
from tests import tiny_config

# The tiny config's prompts (about 6 of 16 tokens) and responses of up to 4 tokens: under half of each padded row.
RUN = {"checkpoint.every": 1, "checkpoint.keep": 0}


def train(workdir, devices, **overrides):
  loop.train(tiny_config.two_steps(**{**RUN, **overrides}), str(workdir), devices=jax.devices()[:devices])
  return read_rows(os.path.join(workdir, METRICS_FILE))


# pacs/accuracy counts the responses whose ψ > 0; at step 1 the policy is its own reference, so every ψ is 0 up to
# float rounding and its sign is the rounding's (any change of summation order flips some): a count of coin flips.
DISCONTINUOUS = ("pacs/accuracy",)


def numbers(row, skip=()):
  return {k: v for k, v in row.items() if not k.startswith(("timing/", "throughput/", "time")) and
          isinstance(v, (int, float)) and k not in skip}


def assert_close(padded, packed):
  assert len(padded) == len(packed) == 2
  for a, b in zip(padded, packed):
    a, b = numbers(a, DISCONTINUOUS), numbers(b, DISCONTINUOUS)
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_packed_run_trains_as_the_padded_one_and_resumes_bitwise(tmp_path):
  """PACS, a full run on 8 devices; the packed run again, stopped after step 1 and resumed from its checkpoint."""
  run = {"mesh.fsdp": -1}
  packed = train(tmp_path / "packed", 8, **run, **{"train.packing": True})
  assert_close(train(tmp_path / "padded", 8, **run), packed)
  train(tmp_path / "resumed", 8, **run, **{"train.packing": True}, steps=1)
  resumed = train(tmp_path / "resumed", 8, **run, **{"train.packing": True})  # from step 1's checkpoint
  assert [numbers(r) for r in resumed] == [numbers(r) for r in packed]


def test_a_packed_lora_ppo_run_trains_as_the_padded_one(tmp_path):
  """LoRA (the frozen base an argument of every program) and PPO's value pass, on 2 devices."""
  run = {"algorithm": "ppo", "lora.rank": 8, "mesh.fsdp": 2, "ppo.critic_lr": 3e-3, "train.lr": 1e-3}
  assert_close(train(tmp_path / "padded", 2, **run), train(tmp_path / "packed", 2, **run, **{"train.packing": True}))
