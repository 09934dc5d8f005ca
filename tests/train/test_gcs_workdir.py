"""A run whose workdir is on Cloud Storage (a local emulator): everything lands in the bucket, it resumes from
there, and export and evaluate read from there; nothing goes to a local folder named `gs:`."""

import json
import os
import struct
import subprocess
import sys

import transformers

from pacs_jax import paths
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ["--config", os.path.join(ROOT, "configs", "tiny_cpu.py"), "--config.train.batch_prompts=8",
       "--config.train.mini_batch_prompts=4", "--config.data.synthetic_val_size=8", "--config.eval_every=2",
       "--config.checkpoint.every=2"]


def run(module, *args, env, cwd):
  result = subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  return result


def event_tags(data: bytes) -> set[str]:
  """Scalar tags of a TensorBoard event file (TFRecord framing: length, crc, Event proto, crc)."""
  from tensorboardX.proto import event_pb2
  tags, pos = set(), 0
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    tags.update(v.tag for v in event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]).summary.value)
    pos += 12 + length + 4
  return tags


def test_train_resume_export_evaluate_on_gs(local_gcs, tmp_path):
  workdir = f"gs://{local_gcs.bucket}/runs/{tmp_path.name}"
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  env = {**os.environ, **local_gcs.env, "XLA_FLAGS": child_env.xla_flags(),
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": child_env.pythonpath(ROOT),
         "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer")}

  run("pacs_jax.train", *RUN, "--workdir", workdir, "--config.steps=4", env=env, cwd=cwd)
  assert paths.listdir(workdir) == ["checkpoints", "metrics.jsonl", "model", "tensorboard"]
  assert paths.listdir(f"{workdir}/checkpoints") == ["2", "4"]
  assert paths.isfile(f"{workdir}/checkpoints/4/commit_success.txt")  # Orbax's commit marker on GCS
  assert paths.isfile(f"{workdir}/model/config.json") and paths.isfile(f"{workdir}/model/tokenizer.json")
  events = paths.listdir(f"{workdir}/tensorboard")
  assert len(events) == 1 and events[0].startswith("events.out.tfevents.")
  tags = event_tags(paths.read_bytes(f"{workdir}/tensorboard/{events[0]}"))
  assert {"loss", "reward/mean", "val/accuracy/synthetic/mod3"} <= tags

  # The newest checkpoint damaged in the bucket: the resumed run falls back to step 2 and sets 4 aside.
  paths.write_atomic(f"{workdir}/checkpoints/4/config/metadata", "{garbage")
  resumed = run("pacs_jax.train", *RUN, "--workdir", workdir, "--config.steps=6", env=env, cwd=cwd)
  assert "checkpoint step 4 cannot be restored (JSONDecodeError" in resumed.stderr, resumed.stderr
  assert "resumed from step 2" in resumed.stdout
  rows = [json.loads(line) for line in paths.read_text(f"{workdir}/metrics.jsonl").splitlines()]
  assert [r["step"] for r in rows] == list(range(7))
  assert paths.listdir(f"{workdir}/checkpoints") == ["2", "4", "6"]
  assert [name.split(".")[0] for name in paths.listdir(f"{workdir}/checkpoints_set_aside")] == ["4"]
  assert not paths.exists(f"{workdir}/trainer.lock")

  run("pacs_jax.export", "--workdir", workdir, "--out", str(tmp_path / "hf"), env=env, cwd=cwd)
  transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "hf")

  run("pacs_jax.evaluate", "--model", workdir, "--data", "synthetic/mod3", "--limit", "4", "--n", "2",
      "--max_new_tokens", "4", "--max_prompt_length", "16", "--batch_slots", "8", "--dtype", "float32",
      "--reward_workers", "1", env=env, cwd=cwd)
  exported = f"{workdir}-eval_step_6"  # (the workdir itself is never written)
  assert not paths.exists(f"{workdir}/export_step_6")
  # The released layouts (issue 11): one rollout line per problem holding its n samples, pass@k per source.
  summary = json.loads(paths.read_text(f"{exported}/eval_summary.json"))
  assert summary["complete"] and summary["overall"]["num_responses"] == 8
  lines = [json.loads(line) for line in paths.read_text(f"{exported}/eval_rollout.jsonl").splitlines()]
  assert len(lines) == 4 and all(len(line["rollout"]) == 2 for line in lines)
  assert set(json.loads(paths.read_text(f"{exported}/eval_metrics.json"))["synthetic/mod3"]) == {"pass@1", "pass@2"}

  for folder in (cwd, tmp_path, ROOT):
    assert not os.path.exists(os.path.join(folder, "gs:")), folder
