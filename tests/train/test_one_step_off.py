"""rollout.mode "one_step_off" and "async" (issue 33): with staleness forced to 0 the background rollouts reproduce
sync's rows bitwise on 8 virtual CPU devices; at staleness s their responses are up to s versions old and say so;
responses older than that are dropped, counted and drawn again; the pipeline's look-ahead checkpoints the position
before the elements it looked at."""

import jax
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.rollout import interface
from pacs_jax.trainer import loop, overlap
from tests.train.test_train_e2e import rows, tensorboard_tags, tiny

SHARDED = {"mesh.fsdp": 4, "mesh.tensor": 2}


def run(workdir, **overrides) -> tuple[loop.Trainer, list[dict]]:
  trainer = loop.Trainer(tiny(**SHARDED, **overrides), str(workdir))
  trainer.run()
  return trainer, rows(workdir)


TIMING = ("timing/", "throughput/")


@pytest.mark.slow  # three runs of three steps on 8 devices
def test_overlapped_modes_at_staleness_0_are_sync_bitwise(tmp_path):
  assert jax.device_count() == 8
  _, sync = run(tmp_path / "sync")
  for mode in ("one_step_off", "async"):
    trainer, overlapped = run(tmp_path / mode, **{"rollout.mode": mode, "rollout.max_staleness": 0})
    assert trainer.next_rollout.started == 2, mode  # steps 2 and 3 were sampled on the background thread
    assert [r["step"] for r in overlapped] == [r["step"] for r in sync] == [0, 1, 2, 3]
    assert [r.get("rollout/dropped") for r in overlapped] == [None, 0.0, 0.0, 0.0], mode
    for a, b in zip(sync, overlapped):
      same = sorted(k for k in a if not k.startswith(TIMING))
      assert sorted(k for k in b if not k.startswith(TIMING) and k != "rollout/dropped") == same
      for k in same:
        assert a[k] == b[k], (mode, a["step"], k, a[k], b[k])  # bitwise: the same floats


def test_one_step_off_at_staleness_1_samples_with_the_previous_policy(tmp_path):
  trainer, logged = run(tmp_path, eval_every=0, algorithm="grpo",
                        **{"rollout.mode": "one_step_off", "rollout.tis_imp_ratio_cap": 2.0})
  assert trainer.next_rollout.started == 2
  assert [r["rollout/staleness_max"] for r in logged] == [0.0, 1.0, 1.0]  # step 1 samples before any update
  for r in logged:
    assert np.isfinite(r["loss"]) and np.isfinite(r["rollout_corr/is_weight_max"])
  # One update apart, π_old / π_rollout moves off 1 (at staleness 0 it is 1 up to rounding).
  assert max(abs(r["rollout_corr/is_weight_mean"] - 1.0) for r in logged[1:]) > 1e-4


def test_async_runs_max_staleness_steps_ahead_and_logs_it(tmp_path):
  trainer, logged = run(tmp_path, eval_every=0, steps=4, algorithm="grpo",
                        **{"rollout.mode": "async", "rollout.max_staleness": 2, "rollout.tis_imp_ratio_cap": 2.0})
  assert trainer.next_rollout.started == 3  # steps 2 to 4
  # Step 1 samples before any update; steps 2 and 3 start with its weights, step 4 with step 2's.
  assert [r["rollout/staleness_max"] for r in logged] == [0.0, 1.0, 2.0, 2.0]
  assert [r["rollout/staleness_frac/2"] for r in logged[2:]] == [1.0, 1.0]
  assert [r["rollout/dropped"] for r in logged] == [0.0] * 4
  for r in logged:
    assert np.isfinite(r["loss"]) and np.isfinite(r["rollout_corr/is_weight_max"])
  tags = tensorboard_tags(tmp_path)
  for name in ("rollout/dropped", "rollout/staleness_frac/2", "rollout_corr/is_weight_mean",
               "rollout_corr/is_weight_max"):
    assert name in tags, name


@pytest.mark.slow  # two runs of three steps on 8 devices
def test_pacs_with_the_rollout_reference_at_staleness_0_is_the_released_objective(tmp_path):
  settings = {"eval_every": 0, "pacs.reference_policy": "rollout"}
  sync_trainer, sync = run(tmp_path / "sync", **settings)
  trainer, overlapped = run(tmp_path / "async", **settings, **{"rollout.mode": "async", "rollout.max_staleness": 0})
  assert trainer.next_rollout.started == 2
  for a, b in zip(sync, overlapped, strict=True):
    for k in a:
      if not k.startswith(TIMING):
        assert a[k] == b[k], (a["step"], k, a[k], b[k])  # bitwise: π_old is the reference, as released
  # The first mini-batch's reference is the policy being trained: r̂ = 0 up to the rounding between the log-prob
  # pass and the train step's forward on the sharded mesh, in both.
  assert sync_trainer.minibatch_metrics[0]["pacs/reward_proxy_abs_mean"] < 1e-5
  assert trainer.minibatch_metrics == sync_trainer.minibatch_metrics


def test_pacs_with_the_rollout_reference_takes_stale_responses_behaviour_log_probs(tmp_path):
  # Step 3's responses were sampled by the policy before step 2's update: their reference is that policy, read
  # from their behaviour log-probs, so r̂ is not 0 on the first mini-batch as it is with π_old as the reference.
  trainer, logged = run(tmp_path, eval_every=0, **{"pacs.reference_policy": "rollout", "rollout.mode": "async",
                                                   "rollout.max_staleness": 1})
  assert [r["rollout/staleness_max"] for r in logged] == [0.0, 1.0, 1.0]
  first = trainer.minibatch_metrics[0]
  assert first["pacs/reward_proxy_abs_mean"] > 1e-3, first
  assert all(np.isfinite(r["loss"]) for r in logged)


def test_pacs_with_the_frozen_reference_weighs_stale_responses(tmp_path):
  # The sequence-level rollout correction: π_old comes from a log-prob pass (the frozen reference has none of its
  # own), each response's weight is its tokens' ratio π_old / μ; at step 1 (fresh) it is 1 up to rounding, one
  # update apart it is not, and the weights reach the rows and TensorBoard.
  trainer, logged = run(tmp_path, eval_every=0, **{"rollout.mode": "one_step_off", "rollout.tis_imp_ratio_cap": 2.0})
  assert trainer.cfg.pacs.reference_policy == "frozen"
  assert [r["rollout/staleness_max"] for r in logged] == [0.0, 1.0, 1.0]
  assert abs(logged[0]["rollout_corr/is_weight_mean"] - 1.0) < 1e-3
  assert max(abs(r["rollout_corr/is_weight_mean"] - 1.0) for r in logged[1:]) > 1e-3
  for r in logged:
    assert np.isfinite(r["loss"]) and np.isfinite(r["rollout_corr/is_weight_max"])
  tags = tensorboard_tags(tmp_path)
  assert "rollout_corr/is_weight_mean" in tags and "rollout_corr/tis_truncated_frac" in tags


class Finished:
  """A rollout in flight that has finished (a future's `result`)."""

  def __init__(self, value):
    self.value = value

  def result(self):
    return self.value


def completion(prompt, sample, version):
  return interface.Completion(prompt, sample, [prompt, sample], np.zeros(2, np.float32), "eos", version)


def test_responses_older_than_max_staleness_are_dropped_counted_and_drawn_again():
  overlapped = overlap.Overlapped(worker=None, max_staleness=2)
  element = {"prompt_ids": []}
  made = [completion(0, 0, 5), completion(0, 1, 4), completion(1, 0, 2), completion(1, 1, 7)]
  overlapped.queue._pending.append((element, Finished(made), None))
  fresh = [completion(p, s, 7) for p in (0, 1) for s in (0, 1)]
  got = overlapped.take(element, version=7, resample=lambda: fresh)
  assert overlapped.dropped == 2  # versions 4 and 2 are 3 and 5 behind 7
  assert [(c.prompt_index, c.sample_index, c.policy_version) for c in got] == [(0, 0, 5), (0, 1, 7), (1, 0, 7),
                                                                                (1, 1, 7)]
  overlapped.queue._pending.append((element, Finished(made[:1]), None))
  assert overlapped.take(element, version=7, resample=lambda: 1 / 0) == made[:1] and overlapped.dropped == 0
  assert overlapped.take(element, version=7, resample=lambda: 1 / 0) is None  # none in flight for it


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


def test_the_look_ahead_looks_several_elements_ahead():
  it = overlap.Lookahead(Counter())
  assert [it.peek(i)["element"] for i in (2, 0, 1)] == [2, 0, 1] and it.get_state() == {"next": 0}
  assert next(it)["element"] == 0 and it.get_state() == {"next": 1}
  assert it.peek(2)["element"] == 3 and next(it)["element"] == 1 and it.get_state() == {"next": 2}
  assert [next(it)["element"] for _ in range(3)] == [2, 3, 4] and it.get_state() == {"next": 5}


@pytest.mark.parametrize("overrides, field", [
    ({"rollout.mode": "async", "rollout.max_staleness": -1}, "rollout.max_staleness"),
    ({"rollout.mode": "async", "algorithm": "dapo"}, "rollout.mode"),
    ({"rollout.mode": "one_step_off", "rollout.max_staleness": 2}, "rollout.max_staleness"),
    ({"rollout.mode": "one_step_off", "algorithm": "dapo"}, "rollout.mode"),
])
def test_bad_modes_name_the_field(overrides, field):
  with pytest.raises(config_lib.ConfigError, match=f"config.{field}"):
    config_lib.validate(tiny(**overrides), num_devices=1, check_paths=False)
