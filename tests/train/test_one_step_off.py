"""rollout.mode="one_step_off" (issue 33): with staleness forced to 0 the background rollout reproduces sync's rows
bitwise on 8 virtual CPU devices; at staleness 1 its responses are one version old and say so; the pipeline's
look-ahead checkpoints the position before the element it looked at."""

import jax
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.trainer import loop, overlap
from tests.train.test_train_e2e import rows, tiny

SHARDED = {"mesh.fsdp": 4, "mesh.tensor": 2}


def run(workdir, **overrides) -> tuple[loop.Trainer, list[dict]]:
  trainer = loop.Trainer(tiny(**SHARDED, **overrides), str(workdir))
  trainer.run()
  return trainer, rows(workdir)


@pytest.mark.slow  # two runs of three steps on 8 devices
def test_one_step_off_at_staleness_0_is_sync_bitwise(tmp_path):
  assert jax.device_count() == 8
  _, sync = run(tmp_path / "sync")
  trainer, overlapped = run(tmp_path / "one_step_off", **{"rollout.mode": "one_step_off", "rollout.max_staleness": 0})
  assert trainer.next_rollout.started == 2  # steps 2 and 3 were sampled on the background thread
  assert [r["step"] for r in overlapped] == [r["step"] for r in sync] == [0, 1, 2, 3]
  for a, b in zip(sync, overlapped):
    same = sorted(k for k in a if not k.startswith(("timing/", "throughput/")))
    assert sorted(k for k in b if not k.startswith(("timing/", "throughput/"))) == same
    for k in same:
      assert a[k] == b[k], (a["step"], k, a[k], b[k])  # bitwise: the same floats


def test_one_step_off_at_staleness_1_samples_with_the_previous_policy(tmp_path):
  trainer, logged = run(tmp_path, eval_every=0, algorithm="grpo",
                        **{"rollout.mode": "one_step_off", "rollout.tis_imp_ratio_cap": 2.0})
  assert trainer.next_rollout.started == 2
  assert [r["rollout/staleness_max"] for r in logged] == [0.0, 1.0, 1.0]  # step 1 samples before any update
  for r in logged:
    assert np.isfinite(r["loss"]) and np.isfinite(r["rollout_corr/is_weight_max"])
  # One update apart, π_old / π_rollout moves off 1 (at staleness 0 it is 1 up to rounding).
  assert max(abs(r["rollout_corr/is_weight_mean"] - 1.0) for r in logged[1:]) > 1e-4


class Counter:
  """A checkpointable iterator of 0, 1, 2, ..."""

  def __init__(self, start=0):
    self.next = start

  def __next__(self):
    self.next += 1
    return {"element": self.next - 1}

  def get_state(self):
    return {"next": self.next}


def test_the_look_ahead_checkpoints_the_position_before_what_it_looked_at():
  it = overlap.Lookahead(Counter())
  assert next(it)["element"] == 0
  ahead = it.peek()
  assert ahead["element"] == 1 and it.peek() is ahead and it.get_state() == {"next": 1}
  resumed = overlap.Lookahead(Counter(it.get_state()["next"]))  # a resume from a checkpoint taken now
  assert next(resumed)["element"] == 1  # the element in flight is drawn again, none is lost
  assert next(it) is ahead and it.get_state() == {"next": 2} and next(it)["element"] == 2


@pytest.mark.parametrize("overrides, field", [
    ({"rollout.mode": "async"}, "rollout.mode"),
    ({"rollout.mode": "one_step_off", "rollout.max_staleness": 2}, "rollout.max_staleness"),
    ({"rollout.mode": "one_step_off", "algorithm": "dapo"}, "rollout.mode"),
])
def test_bad_modes_name_the_field(overrides, field):
  with pytest.raises(config_lib.ConfigError, match=f"config.{field}"):
    config_lib.validate(tiny(**overrides), num_devices=1, check_paths=False)
