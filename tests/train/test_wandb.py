"""Optional wandb logging (config section `wandb`), in wandb's offline mode: the history of a demo run equals its
metrics.jsonl, a restarted run continues the same wandb run, and a service that cannot be reached costs one warning
line, never the run. The offline files are read with wandb's own protobuf records."""

import glob
import json
import logging
import os
import struct

import jax
import pytest

from pacs_jax import config as config_lib
from pacs_jax.trainer import loop
from pacs_jax.services import tracking

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 32768  # the .wandb file: a LevelDB-style log of 32 KiB blocks after a 7-byte ":W&B" header


def records(path: str):
  """The protobuf Records of an offline run's .wandb file."""
  data, pos, parts = open(path, "rb").read(), 7, b""
  assert data[:4] == b":W&B"
  while pos + 7 <= len(data):
    left = BLOCK - pos % BLOCK
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
    if kind == 0:  # the zero padding at a block's end
      pos += left
      continue
    parts, pos = (b"" if kind in (1, 2) else parts) + data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind in (1, 4):  # a whole record, or the last piece of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      yield record


def offline_runs(workdir) -> list[tuple[str, list[dict]]]:
  """(run id, history rows without wandb's own `_` keys) of each offline run under the workdir, oldest first."""
  out = []
  for path in sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb"))):
    run_id, rows = None, []
    for r in records(path):
      kind = r.WhichOneof("record_type")
      if kind == "run":
        run_id = r.run.run_id
      elif kind == "history":
        row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        rows.append({"step": r.history.step.num, **{k: v for k, v in row.items() if not k.startswith("_")}})
    out.append((run_id, rows))
  return out


def tiny(steps, **overrides):
  return config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "steps": steps, "eval_every": 2, "train.batch_prompts": 8, "train.mini_batch_prompts": 8,
      "checkpoint.async_save": False, "checkpoint.every": 1, "wandb.enabled": True, "wandb.mode": "offline",
      "wandb.tags": "demo,test", **overrides})


@pytest.fixture(autouse=True)
def wandb_home(tmp_path, monkeypatch):
  for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
  monkeypatch.delenv("WANDB_MODE", raising=False)


def test_offline_history_equals_metrics_and_a_restart_continues_the_same_run(tmp_path):
  workdir = tmp_path / "run"
  loop.train(tiny(2), str(workdir), devices=jax.devices()[:1])
  metrics = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  [(first_id, history)] = offline_runs(workdir)
  assert history == metrics and [r["step"] for r in history] == [0, 1, 2]  # step 0: the first validation
  assert (workdir / tracking.RUN_ID_FILE).read_text().strip() == first_id

  loop.train(tiny(3), str(workdir), devices=jax.devices()[:1])  # restarted with more steps: resumes at step 2
  metrics = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  runs = offline_runs(workdir)
  assert [run_id for run_id, _ in runs] == [first_id, first_id]
  assert runs[1][1] == metrics[3:] and [r["step"] for r in runs[1][1]] == [3]
  first_file = sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "*.wandb")))[0]
  logged = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for r in records(first_file)
            for item in (r.run.config.update if r.WhichOneof("record_type") == "run" else
                         r.config.update if r.WhichOneof("record_type") == "config" else [])}
  assert logged["steps"] == 2 and logged["wandb"]["tags"] == "demo,test"


def test_an_unreachable_service_costs_one_warning_line(tmp_path, monkeypatch, caplog, capfd):
  monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
  monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
  caplog.set_level(logging.WARNING)
  last = loop.train(tiny(1, **{"wandb.mode": "online", "wandb.init_timeout_s": 3.0, "eval_every": 0}),
                    str(tmp_path / "run"), devices=jax.devices()[:1])
  assert last["reward/mean"] >= 0
  lines = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage() and not r.name.startswith("wandb")]
  assert len(lines) == 1 and lines[0].startswith("wandb: not logging to pacs-jax ("), lines
  out, err = capfd.readouterr()
  assert not [line for line in (out + err).splitlines() if "wandb" in line and "not logging to" not in line], out + err
  assert len([json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]) == 1


def test_a_missing_package_or_a_bad_mode_names_the_field(monkeypatch):
  with pytest.raises(config_lib.ConfigError, match=r"^config\.wandb\.mode: "):
    config_lib.validate(tiny(1, **{"wandb.mode": "sometimes"}), 1)
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(config_lib.ConfigError, match=r"^config\.wandb\.enabled: wandb is not installed"):
    config_lib.validate(tiny(1), 1)
