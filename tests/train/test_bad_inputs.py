"""Small failures a new user meets: each ends in one message naming the field, file or line, creates nothing it
should not, and a run whose updates are all skipped says so on the console."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pacs_jax import config as config_lib
from pacs_jax.data import sources
from pacs_jax.models import hf
from pacs_jax.storage import lock as workdir_lock
from pacs_jax.services import health
from pacs_jax.trainer import loop
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")


def tiny(**overrides):
  base = {"steps": 2, "eval_every": 0, "train.batch_prompts": 8, "train.mini_batch_prompts": 4,
          "checkpoint.async_save": False}
  return config_lib.load_config_file(TINY, {**base, **overrides})


@pytest.mark.parametrize("field, value", [
    ("log_every", 0), ("reward_workers", 0), ("seed", -1), ("rollout.top_k", -1), ("eval_every", -1),
    ("checkpoint.restore", "sometimes"), ("checkpoint.lock_stale_after_s", 0.0), ("pacs.beta", float("nan")),
])
def test_validate_names_the_field(field, value):
  with pytest.raises(config_lib.ConfigError, match=rf"^config\.{field.replace('.', r'[.]')}: "):
    config_lib.validate(tiny(**{field: value}), 1)


@pytest.mark.parametrize("spec", ["runs/qwen", "./qwen", "../qwen"])
def test_a_missing_relative_model_path_is_not_looked_up_on_the_hub(spec, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "runs").mkdir()  # runs/qwen: the first part is a local folder, so a path, not owner/name
  import huggingface_hub
  monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("looked up on the hub"))
  with pytest.raises(config_lib.ConfigError, match=r"^config\.model\.hf_path: .* is not a directory"):
    config_lib.validate(tiny(**{"model.hf_path": spec, "tokenizer": ""}), 1)
  with pytest.raises(FileNotFoundError, match="no such model directory"):
    hf.resolve_path(spec)


def test_a_mistyped_path_that_looks_like_a_hub_id_names_the_path_and_the_hub(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # no own/ here: `own/tiny_qwen33` may be a hub id, and the hub cannot be reached
  import httpx
  import huggingface_hub

  def unreachable(*args, **kwargs):
    raise httpx.ConnectError("[Errno -2] Name or service not known")
  monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
  with pytest.raises(FileNotFoundError) as raised:
    hf.resolve_path("own/tiny_qwen33")
  message = str(raised.value)
  assert message.startswith(f"own/tiny_qwen33: no such local directory (relative to {tmp_path})"), message
  assert "not found on the Hugging Face hub" in message and "Name or service not known" in message
  assert "\n" not in message


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json", "blank_lines.jsonl"])
def test_an_empty_data_file_is_named(name, tmp_path):
  path = tmp_path / name
  path.write_text("\n\n" if name.startswith("blank") else "")
  with pytest.raises(sources.DataError, match=rf"{path}: no usable rows \(the file is empty\)"):
    sources.load_records(str(path))
  # The trainer stops on it naming the file (before, the empty prompt set was blamed on max_prompt_length),
  # and lets go of the workdir.
  with pytest.raises(sources.DataError, match=str(path)):
    loop.Trainer(tiny(**{"data.train": str(path)}), str(tmp_path / "run"), devices=jax.devices()[:1])
  assert not (tmp_path / "run" / workdir_lock.LOCK_FILE).exists()


def test_invalid_utf8_names_file_and_line_and_is_skipped_when_asked(tmp_path):
  path = tmp_path / "math.jsonl"
  path.write_bytes(b'{"problem": "1+1", "answer": "2"}\n{"problem": "caf\xe9?", "answer": "3"}\n'
                   b'{"problem": "2+2", "answer": "4"}\n')
  with pytest.raises(sources.DataError, match=rf"{path}: line 2: invalid UTF-8 \(byte 0xe9 at column 17\)") as raised:
    sources.load_records(str(path))
  assert str(raised.value).endswith("(--config.data.skip_bad_rows=True skips bad rows)")  # the flag as typed
  result = sources.load_records(str(path), skip_bad_rows=True)
  assert [r["answer"] for r in result.records] == ["2", "4"] and result.num_skipped == 1

  array = tmp_path / "deepscaler.json"
  array.write_bytes(b'[{"problem": "1+1", "answer": 2},\n {"problem": "\xff", "answer": 3}]')
  with pytest.raises(sources.DataError, match=rf"{array}: row 1: invalid UTF-8"):
    sources.load_records(str(array))
  result = sources.load_records(str(array), skip_bad_rows=True)
  assert [r["answer"] for r in result.records] == ["2"] and result.num_skipped == 1


def cli(module, *args, cwd):
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                        env={**os.environ, "XLA_FLAGS": child_env.xla_flags(),
                             "JAX_PLATFORMS": "cpu", "PYTHONPATH": child_env.pythonpath(ROOT)})


def assert_one_clean_message(result, expected):
  assert result.returncode != 0
  assert expected in result.stderr, result.stderr
  for noise in ("Traceback", "cannot schedule new futures"):
    assert noise not in result.stderr, result.stderr


def test_export_of_a_mistyped_workdir_creates_nothing(tmp_path):
  result = cli("pacs_jax.export", "--workdir", "runs/dmeo", "--out", "exported", cwd=tmp_path)
  assert_one_clean_message(result, f"export: {tmp_path}/runs/dmeo: no such workdir")
  assert os.listdir(tmp_path) == []


def test_export_and_evaluate_of_a_workdir_without_checkpoints(tmp_path):
  """A run killed before its first save: model/ and metrics, an empty checkpoints/ folder."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints").mkdir(parents=True)
  (workdir / "model").mkdir()
  (workdir / "model" / "config.json").write_text("{}")
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  result = cli("pacs_jax.export", "--workdir", "run", "--out", "exported", cwd=tmp_path)
  assert_one_clean_message(result, f"export: {workdir}/checkpoints: no complete checkpoint")
  result = cli("pacs_jax.evaluate", "--model", "run", "--data", "synthetic/mod3", cwd=tmp_path)
  assert_one_clean_message(result, f"evaluate: {workdir}/checkpoints: no complete checkpoint")
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_a_run_whose_updates_are_all_skipped_says_so(tmp_path, caplog):
  trainer = loop.Trainer(tiny(), str(tmp_path), devices=jax.devices()[:1])
  # NaN weights: every gradient is non-finite, so every update is skipped; the step says so, then the health check
  # (services/health.py) stops the run at that step boundary, before saving.
  trainer.state = trainer.state.replace(params=jax.tree.map(lambda x: x * jnp.nan, trainer.state.params))
  with caplog.at_level(logging.WARNING), pytest.raises(health.Unhealthy, match="training stopped at step 1: the "
                                                       "weights were non-finite before any update") as stopped:
    trainer.run()
  assert "train.lr" not in str(stopped.value)  # (the line advised lowering it: no rate makes NaN weights finite)
  warnings = [r.getMessage() for r in caplog.records if "updates skipped" in r.getMessage()]
  assert warnings == ["step 1: 2 of 2 updates skipped (non-finite gradient): the parameters did not change"]
  assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")


def test_a_lora_run_on_a_non_finite_base_says_so(tmp_path):
  """A NaN base under finite adapters: every gradient is non-finite, every update skipped, the adapters' norm stays
  finite (nothing looks diverged). The line said `lower train.lr first` (no rate makes the base finite)."""
  trainer = loop.Trainer(tiny(**{"lora.rank": 4, "lora.modules_to_save": ""}), str(tmp_path), devices=jax.devices()[:1])
  nan_base = jax.tree.map(lambda x: x * jnp.nan, trainer.base)
  trainer.base, trainer.ref_params = nan_base, nan_base  # (a LoRA run's reference is its base)
  with pytest.raises(health.Unhealthy, match="training stopped at step 1: the weights were non-finite before any "
                                             "update") as stopped:
    trainer.run()
  assert "train.lr" not in str(stopped.value)
  assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")
