"""The trainer end to end: logged metrics, sharded vs single-device steps, GRPO/PPO on the same loop, real-data path."""

import glob
import json
import os
import struct

import jax
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.storage import resume as resume_lib
from pacs_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")

NAMED_METRICS = ("step", "reward/mean", "accuracy/synthetic/mod3", "response_length/mean", "response_length/clip_ratio",
                 "entropy", "loss", "pacs/reward_proxy_mean", "pacs/score_mean", "pacs/weight_mean", "grad_norm", "lr",
                 "skipped_updates", "timing/rollout_s", "timing/reward_s", "timing/update_s", "timing/step_s",
                 "throughput/tokens_per_s")


def tiny(**overrides):
  base = {"steps": 3, "eval_every": 2, "train.batch_prompts": 8, "train.mini_batch_prompts": 4,
          "data.synthetic_val_size": 8, "checkpoint.async_save": False}
  return config_lib.load_config_file(TINY, {**base, **overrides})


def rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def tensorboard_tags(workdir) -> set[str]:
  """Scalar tags in the event files (TFRecord framing: length, crc, Event proto, crc)."""
  from tensorboardX.proto import event_pb2
  tags = set()
  for path in glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      tags.update(v.tag for v in event.summary.value)
      pos += 12 + length + 4
  return tags


def test_metrics_jsonl_and_tensorboard_have_the_named_metrics(tmp_path):
  loop.train(tiny(), str(tmp_path), devices=jax.devices()[:1])
  logged = rows(tmp_path)
  assert [r["step"] for r in logged] == [0, 1, 2, 3]
  for name in NAMED_METRICS:
    assert name in logged[1], name
  assert "val/accuracy/synthetic/mod3" in logged[0] and "val/accuracy/synthetic/mod3" in logged[2]
  tags = tensorboard_tags(tmp_path)
  for name in NAMED_METRICS[1:]:
    assert name in tags, name
  assert os.path.isfile(tmp_path / "model" / "config.json")


def test_sharded_steps_match_single_device(tmp_path):
  assert jax.device_count() == 8
  single = tiny(eval_every=0)
  loop.train(single, str(tmp_path / "one"), devices=jax.devices()[:1])
  sharded = tiny(eval_every=0, **{"mesh.fsdp": 4, "mesh.tensor": 2})
  loop.train(sharded, str(tmp_path / "eight"))
  a, b = rows(tmp_path / "one"), rows(tmp_path / "eight")
  assert len(a) == len(b) == 3
  for ra, rb in zip(a, b):
    assert ra["reward/mean"] == rb["reward/mean"]  # the same rollouts
    np.testing.assert_allclose(rb["loss"], ra["loss"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(rb["grad_norm"], ra["grad_norm"], atol=1e-4, rtol=1e-4)


def test_config_validation_names_the_field():
  cfg = tiny(**{"train.mini_batch_prompts": 3})
  with pytest.raises(config_lib.ConfigError, match=r"config\.train\.mini_batch_prompts"):
    config_lib.validate(cfg, 1)
  cfg = tiny(**{"mesh.fsdp": 3})
  with pytest.raises(config_lib.ConfigError, match=r"config\.mesh\.fsdp"):
    config_lib.validate(cfg, 8)
  # 8 processes cannot each feed whole groups to a micro-batch of 4 prompts.
  cfg = tiny(**{"train.micro_batch_prompts": 4})
  config_lib.validate(cfg, 1, num_processes=4)
  with pytest.raises(config_lib.ConfigError, match=r"config\.train\.micro_batch_prompts.*8 processes"):
    config_lib.validate(cfg, 1, num_processes=8)
  cfg = tiny(**{"pacs.adv_estimator": "gae"})
  with pytest.raises(config_lib.ConfigError, match=r"config\.pacs\.adv_estimator"):
    config_lib.validate(cfg, 1)


def test_resume_names_changed_data_order_fields():
  cfg = tiny()
  saved = json.loads(cfg.to_json_best_effort())
  assert resume_lib.changed_data_fields(saved, cfg) == {}
  assert resume_lib.changed_data_fields(saved, tiny(steps=50, **{"train.lr": 0.5})) == {}  # longer runs are fine
  changed = resume_lib.changed_data_fields(saved, tiny(seed=9, **{"train.batch_prompts": 16}))
  assert changed == {"seed": (cfg.seed, 9), "train.batch_prompts": (8, 16)}
