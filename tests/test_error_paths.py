"""The error paths of evaluate, export and storage (issue 34): each fault ends in at most a few stderr lines with the
exit status docs/training.md's table gives it, because its cause is gone (no stderr is filtered here beyond the
platform's own import lines): Orbax's event loop outlives its reads, evaluate and export classify like train, a
model folder is read strictly, evaluate writes nothing into a workdir, stale export staging is removed."""

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import errors, paths
from pacs_jax.data import synthetic_tasks as synthetic
from pacs_jax.eval import runner
from pacs_jax.models import families as registry, hf
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.storage import resume
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lines jax's CUDA plugin prints at import where it finds no driver: not the program's output.
PLATFORM_NOISE = ("All log messages before absl::InitializeLog() is called", "cudart_stub.cc")


def env(**extra):
  return {**os.environ, "XLA_FLAGS": child_env.xla_flags(),
          "JAX_PLATFORMS": "cpu", "PYTHONPATH": child_env.pythonpath(ROOT),
          "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer"), **extra}


def cli(module, *args, cwd, prelude=None, environ=None):
  """`python -m module args`; `prelude`: Python run first in the same process (a simulated fault)."""
  command = [sys.executable, "-m", module, *args]
  if prelude:
    command = [sys.executable, "-c", f"{prelude}\nimport runpy, sys\nsys.argv = ['{module}', *sys.argv[1:]]\n"
               f"runpy.run_module('{module}', run_name='__main__', alter_sys=True)", *args]
  return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd, env=environ or env())


def stderr_lines(result) -> list[str]:
  return [line for line in result.stderr.splitlines()
          if line.strip() and not any(noise in line for noise in PLATFORM_NOISE)]


def assert_fails(result, status: int, *expected: str, most: int = 1):
  lines = stderr_lines(result)
  assert result.returncode == status, result.stderr
  assert 1 <= len(lines) <= most, "\n".join(lines)
  for text in expected:
    assert text in lines[-1], lines[-1]


def tiny_config(layers=2):
  return registry.preset("tiny", vocab_size=len(synthetic.build_tokenizer()), num_hidden_layers=layers,
                         hidden_size=32, intermediate_size=64)


def fake_workdir(directory, steps=(1, 2)):
  """A training workdir as the trainer leaves it (model card, checkpoints of the policy with their config and
  record), of a tiny 2-layer model: no training needed."""
  tokenizer = synthetic.build_tokenizer()
  model = registry.causal_lm(tiny_config(), rngs=nnx.Rngs(0))
  export_lib.write_model_card(str(directory), model.config, tokenizer)
  config = ml_collections.ConfigDict({"model": {"param_dtype": "float32"}, "algorithm": "pacs"})
  record = {"model": {k: model.config.to_hf_dict().get(k) for k in resume.MODEL_FIELDS}}
  ckpt = checkpoint_lib.Checkpointer(str(directory / "checkpoints"), keep=0, async_save=False)
  for step in steps:
    ckpt.save(step, {"params": nnx.state(model, nnx.Param)}, {}, config, record=record)
  ckpt.close()
  return directory


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return fake_workdir(tmp_path_factory.mktemp("good") / "run")


def tree(directory) -> dict[str, float]:
  return {str(p.relative_to(directory)): p.stat().st_mtime for p in directory.rglob("*")}


# ---------------------------------------------------------------------------------------------------------
# 1. A failed array read ends quietly: Orbax closed its event loop while the other arrays' reads were in flight.

def test_a_failed_array_read_ends_in_one_line(tmp_path):
  """Checkpoints saved before resume records (nothing to compare the model card with) of another size: every array
  read fails. Orbax closed its event loop while the other arrays' reads were in flight: 36 lines, 10 of them
  `RuntimeError: Event loop is closed`, around the one line."""
  run = fake_workdir(tmp_path / "run")
  for step in (1, 2):
    shutil.rmtree(run / "checkpoints" / str(step) / checkpoint_lib.RECORD_ITEM)
  card = run / "model" / hf.CONFIG_FILE
  card.write_text(json.dumps({**json.loads(card.read_text()), "num_hidden_layers": 3}))
  result = cli("pacs_jax.export", "--workdir", str(run), "--out", "hf", cwd=tmp_path)
  assert_fails(result, errors.EXIT_CHECKPOINT, f"export: no checkpoint in {run}/checkpoints can be restored (2 steps; "
               "the newest, step 2: ValueError: Requested shape: (3, ", "is not compatible with the stored shape: (2, ")


# ---------------------------------------------------------------------------------------------------------
# 2. evaluate and export: one line, the documented status.

def test_a_checkpoint_of_another_size_is_one_line(workdir, tmp_path):
  other = tmp_path / "other"
  fake_workdir(other, steps=(1,))
  card = other / "model" / hf.CONFIG_FILE
  card.write_text(json.dumps({**json.loads(card.read_text()), "num_hidden_layers": 3}))
  expected = (f"{other}/checkpoints/1: trained as another model than {other}/model/config.json describes "
              "(model.num_hidden_layers: 2 -> 3)")
  before = tree(other)
  assert_fails(cli("pacs_jax.export", "--workdir", str(other), "--out", "hf", cwd=tmp_path), errors.EXIT_CHECKPOINT,
               f"export: {expected}")
  assert_fails(cli("pacs_jax.evaluate", "--model", str(other), "--data", "synthetic/mod3", cwd=tmp_path),
               errors.EXIT_CHECKPOINT, f"evaluate: {expected}")
  assert tree(other) == before and not (tmp_path / "hf").exists()


def test_every_checkpoint_damaged_is_one_line_without_a_flag_export_lacks(tmp_path):
  run = fake_workdir(tmp_path / "run")
  for step in (1, 2):
    (run / "checkpoints" / str(step) / "state" / "manifest.ocdbt").write_bytes(b"\0garbage" * 8)
  result = cli("pacs_jax.export", "--workdir", str(run), "--out", "hf", cwd=tmp_path)
  assert_fails(result, errors.EXIT_CHECKPOINT, f"export: no checkpoint in {run}/checkpoints can be restored (2 steps; "
               "the newest, step 2: ", "choose another workdir")
  assert "restore=never" not in result.stderr


def test_a_damaged_newest_checkpoint_falls_back_in_one_line(tmp_path):
  run = fake_workdir(tmp_path / "run")
  (run / "checkpoints" / "2" / "state" / "manifest.ocdbt").write_bytes(b"\0garbage" * 8)
  result = cli("pacs_jax.export", "--workdir", str(run), "--out", "hf", cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  lines = stderr_lines(result)
  assert len(lines) == 1 and "checkpoint step 2 cannot be restored (" in lines[0], lines
  assert "restored step 1 instead" in lines[0]
  assert json.loads((tmp_path / "hf" / export_lib.EXPORT_MARKER).read_text())["step"] == 1


@pytest.mark.parametrize("case", ["missing_data", "no_model", "no_workdir", "bad_eval_value", "config_type"])
def test_usage_faults_are_one_line_with_the_documented_status(case, workdir, tmp_path):
  module, args, status, expected = {
      "missing_data": ("pacs_jax.evaluate", ["--model", str(workdir), "--data", "missing.jsonl"], errors.EXIT_INPUT,
                       "evaluate: --data 'missing.jsonl': not a file"),
      "no_model": ("pacs_jax.evaluate", ["--data", "synthetic/mod3"], errors.EXIT_INPUT,
                   "evaluate: --model is required: Hugging Face model directory"),
      "no_workdir": ("pacs_jax.export", ["--out", "hf"], errors.EXIT_INPUT, "export: --workdir is required: "),
      "bad_eval_value": ("pacs_jax.evaluate", ["--model", str(workdir), "--data", "synthetic/mod3", "--n", "0"],
                         errors.EXIT_CONFIG, "evaluate: --n: config.rollout.n: must be >= 1, got 0"),
      "config_type": ("pacs_jax.train", ["--config.train.lr=abc"], errors.EXIT_CONFIG,
                      "train: --config.train.lr=abc: could not convert string to float: 'abc'"),
  }[case]
  assert_fails(cli(module, *args, cwd=tmp_path), status, expected)
  assert os.listdir(tmp_path) == []


def test_an_unreachable_gs_workdir_is_named_unreachable(local_gcs, tmp_path):
  """export and evaluate from a `gs://` workdir whose store refuses connections: one line, EXIT_STORAGE, after one
  retried look-up (paths.STORAGE_RETRIES: 15 s; here 4 attempts, about 7 s). evaluate used to retry a second
  look-up (is_workdir's isdir took the outage for "no such folder", then isfile retried again): 14 s longer than
  export."""
  workdir = f"gs://{local_gcs.bucket}/runs/{tmp_path.name}"
  local_gcs.stop_serving()
  seconds = {}
  try:
    for module, args in (("pacs_jax.export", ["--workdir", workdir, "--out", "hf"]),
                         ("pacs_jax.evaluate", ["--model", workdir, "--data", "synthetic/mod3"])):
      started = time.monotonic()
      result = cli(module, *args, cwd=tmp_path, environ=env(**local_gcs.env, PACS_JAX_STORAGE_ATTEMPTS="4"))
      seconds[module] = time.monotonic() - started
      prog = module.split(".")[-1]
      assert_fails(result, errors.EXIT_STORAGE, f"{prog}: {workdir}: storage unreachable (Connection refused); "
                   "rerun the same command to resume")
  finally:
    local_gcs.serve_again()
  assert os.listdir(tmp_path) == []
  assert seconds["pacs_jax.evaluate"] < seconds["pacs_jax.export"] + 5, seconds  # no second 7 s of retries


EMPTY_MOUNT_POINT = """
import errno, os
rmdir = os.rmdir
def busy(path, *a, **k):
  if os.path.basename(os.fspath(path)) == "mnt":
    raise OSError(errno.EBUSY, "Device or resource busy", os.fspath(path))
  return rmdir(path, *a, **k)
os.rmdir = busy
"""

# safetensors' own error for a write that fails with ENOSPC (its Rust io::Error in the text of a SafetensorError),
# as 0.8 words it and as older versions did. (It replaces a file rather than writing through it, so /dev/full in its
# place is no simulation.)
FULL_DISK = """
import safetensors, safetensors.numpy
def full(tensors, filename, metadata=None):
  raise safetensors.SafetensorError({text!r})
safetensors.numpy.save_file = full
"""
SAFETENSORS_ENOSPC = ("Error while serializing: I/O error: No space left on device (os error 28)",
                      'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left '
                      'on device" })')


@contextlib.contextmanager
def small_tmpfs(directory, size):
  """A real filesystem of `size` mounted on `directory` (as root, where mounts are allowed); yields whether it is."""
  directory.mkdir()
  mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                                   str(directory)], capture_output=True).returncode == 0
  try:
    yield mounted
  finally:
    if mounted:
      subprocess.run(["umount", str(directory)], check=True)


def test_export_into_an_empty_mount_point(workdir, tmp_path):
  """A real (tmpfs) mount point where mounts are allowed, else its EBUSY on rmdir simulated."""
  with small_tmpfs(tmp_path / "mnt", "8m") as real:
    result = cli("pacs_jax.export", "--workdir", str(workdir), "--out", "mnt", cwd=tmp_path,
                 prelude=None if real else EMPTY_MOUNT_POINT)
    assert result.returncode == 0, result.stderr
    assert hf.CONFIG_FILE in os.listdir(tmp_path / "mnt") and os.listdir(tmp_path) == ["mnt"]
    assert not [n for n in os.listdir(tmp_path / "mnt") if "partial" in n]


@pytest.mark.parametrize("text", SAFETENSORS_ENOSPC)
def test_export_onto_a_full_disk_is_one_line(text, workdir, tmp_path):
  result = cli("pacs_jax.export", "--workdir", str(workdir), "--out", "hf", cwd=tmp_path,
               prelude=FULL_DISK.format(text=text))
  assert_fails(result, errors.EXIT_STORAGE, "model.safetensors: No space left on device")
  assert os.listdir(tmp_path) == []  # the staging folder is removed


def test_export_onto_a_really_full_disk_is_one_line(workdir, tmp_path):
  """A 16 KiB tmpfs where mounts are allowed (else the simulation of safetensors 0.8's error): safetensors 0.8's
  real ENOSPC text ended in a 30-line traceback, exit 1, that the older simulated text had hidden."""
  with small_tmpfs(tmp_path / "full", "16k") as real:
    result = cli("pacs_jax.export", "--workdir", str(workdir), "--out", "full/hf", cwd=tmp_path,
                 prelude=None if real else FULL_DISK.format(text=SAFETENSORS_ENOSPC[0]))
    assert_fails(result, errors.EXIT_STORAGE, "model.safetensors: No space left on device")
    assert os.listdir(tmp_path / "full") == []  # the staging folder is removed


# ---------------------------------------------------------------------------------------------------------
# 3. A model folder is read strictly.

def test_a_tensor_the_family_does_not_use_or_lacks_is_refused(tmp_path):
  model = registry.causal_lm(tiny_config(), rngs=nnx.Rngs(0))  # qwen2: q/k/v biases
  directory = tmp_path / "qwen"
  hf.save_pretrained(model, str(directory))
  hf.load_pretrained(str(directory))  # as written: fine
  card = directory / hf.CONFIG_FILE
  original = json.loads(card.read_text())
  card.write_text(json.dumps({**original, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
  with pytest.raises(hf.WeightsMismatch, match=r"tensor 'model\.layers\.0\.self_attn\.[qkv]_proj\.bias' \(and 5 "
                     r"more\) is not used by model_type 'llama'"):
    hf.load_pretrained(str(directory))
  card.write_text(json.dumps({**original, "num_hidden_layers": 3}))
  with pytest.raises(hf.WeightsMismatch, match=r"tensor 'model\.layers\.2\.[\w.]+' \(and \d+ more\) is missing from "
                     r"the weights, and model_type 'qwen2' needs it"):
    hf.load_pretrained(str(directory))
  # The issue's probe: evaluate on such a folder ended in 33-40 lines and safetensors' KeyError.
  export_lib.save_model_dir(model, str(tmp_path / "tokenizer_only"), synthetic.build_tokenizer())
  for name in os.listdir(tmp_path / "tokenizer_only"):
    if name.startswith(("tokenizer", "special_tokens", "vocab", "generation")):
      shutil.copy(tmp_path / "tokenizer_only" / name, directory / name)
  assert_fails(cli("pacs_jax.evaluate", "--model", "qwen", "--data", "synthetic/mod3", cwd=tmp_path),
               errors.EXIT_INPUT, "evaluate: ", "tensor 'model.layers.2.", "is missing from the weights, and "
               "model_type 'qwen2' needs it")
  assert not (directory / "eval_summary.json").exists()  # (issue 44: one was left, marked incomplete)
  assert errors.classify(hf.WeightsMismatch("x")).status == errors.EXIT_INPUT


# ---------------------------------------------------------------------------------------------------------
# 4. Stale export staging is removed; evaluate's workdir export goes to a temporary folder.

def test_stale_staging_of_a_killed_export_is_removed(workdir, tmp_path):
  dead = subprocess.Popen(["true"])
  dead.wait()
  import socket
  stale = tmp_path / f".hf{export_lib.STAGING}-{socket.gethostname()}-{dead.pid}-abc"
  stale.mkdir()
  (stale / "model.safetensors").write_bytes(b"weights")
  live = tmp_path / f".hf{export_lib.STAGING}-{socket.gethostname()}-{os.getpid()}-abc"
  live.mkdir()
  export_lib.export(str(workdir), str(tmp_path / "hf"))
  assert sorted(os.listdir(tmp_path)) == sorted([live.name, "hf"])


def test_evaluate_reads_a_workdir_without_writing_into_it(workdir):
  before = tree(workdir)
  with export_lib.model_to_evaluate(str(workdir)) as (model_dir, out, name):
    assert not model_dir.startswith(str(workdir)) and os.path.isfile(os.path.join(model_dir, hf.CONFIG_FILE))
    assert out == f"{workdir}-eval_step_2" and name == f"{workdir} step 2"
  assert not os.path.exists(model_dir) and tree(workdir) == before


# ---------------------------------------------------------------------------------------------------------
# The exit-status table of docs/training.md is errors' own, for the three commands.

def test_the_docs_exit_status_table_is_the_code(workdir):
  text = open(os.path.join(ROOT, "docs", "training.md")).read()
  rows = dict(re.findall(r"^\| (\d+) \| `(EXIT_\w+)` \|", text, re.M))
  assert rows and {int(k): getattr(errors, v) for k, v in rows.items()} == {int(k): int(k) for k in rows}
  assert {name for name in dir(errors) if name.startswith("EXIT_")} == set(rows.values())
  assert "`train`, `evaluate` and `export`" in text


# ---------------------------------------------------------------------------------------------------------
# Issue 44's probes, in process: each failure classifies to its documented status in one line, leaving nothing behind.

def model_folder(directory, **card):
  """A tiny model's Hugging Face folder (with the synthetic tokenizer), its config.json's fields `card` changed."""
  export_lib.save_model_dir(registry.causal_lm(tiny_config(), rngs=nnx.Rngs(0)), str(directory),
                            synthetic.build_tokenizer())
  config = directory / hf.CONFIG_FILE
  config.write_text(json.dumps({**json.loads(config.read_text()), **card}))
  return directory


def assert_one_line(e: BaseException, status: int, *expected: str):
  failure = errors.classify(e)
  assert failure is not None, f"unclassified (a traceback, exit 1): {e!r}"
  assert failure.status == status and "\n" not in failure.message, failure
  for text in expected:
    assert text in failure.message, failure.message


EVAL = runner.EvalSettings(n=1, max_new_tokens=2, max_prompt_length=32, batch_slots=4, dtype="float32")


def test_evaluate_on_weights_of_another_shape_than_config_json_is_one_line_and_writes_nothing(tmp_path):
  """The issue's probe: a 39-line traceback ending in a plain ValueError (exit 1), and eval_summary.json, marked
  incomplete, left in the model folder (it was written before the weights were read)."""
  folder = model_folder(tmp_path / "model", intermediate_size=96)
  before = tree(folder)
  with pytest.raises(hf.WeightsMismatch) as caught:
    runner.evaluate(str(folder), "synthetic/mod3", EVAL, scorer=object(), progress=False)
  assert_one_line(caught.value, errors.EXIT_INPUT, "tensor 'model.layers.0.mlp.", "has shape (64, 32), expected "
                  "(96, 32) from config.json")
  assert tree(folder) == before


def test_no_prompt_that_fits_has_the_status_errors_documents_it_under(tmp_path):
  """It exited 3 (EXIT_CONFIG: the value to change is max_prompt_length, as train's refusal says) while errors.py
  filed it under EXIT_DATA (4); the output folder is not created."""
  folder = model_folder(tmp_path / "model")
  with pytest.raises(config_lib.ConfigError) as caught:
    runner.evaluate(str(folder), "synthetic/mod3", dataclasses.replace(EVAL, max_prompt_length=1),
                    out_dir=str(tmp_path / "out"), scorer=object(), progress=False)
  assert_one_line(caught.value, errors.EXIT_CONFIG, "--max_prompt_length=1: no problem of")
  documented = dict(re.findall(r"^(EXIT_\w+) = \d+  # (.*)$", open(errors.__file__).read(), re.M))
  assert [name for name, text in documented.items() if "no prompt" in text] == ["EXIT_CONFIG"], documented
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("read_only", [True, False], ids=["export_or_evaluate", "train"])
def test_every_checkpoint_damaged_is_one_summary_line(read_only, tmp_path, monkeypatch):
  """One line naming how many steps failed and the newest's cause (train's refusal grew a line per step: 5 lines
  for 3); each step's cause goes with the traceback (its notes) into the log."""
  directory = tmp_path / "checkpoints"
  directory.mkdir()
  ckpt = checkpoint_lib.Checkpointer(str(directory), read_only=read_only)
  monkeypatch.setattr(ckpt, "all_steps", lambda: [30, 20, 10])

  def damaged(step):
    raise ValueError(f"damaged step {step}\nsecond line of the cause")

  with pytest.raises(checkpoint_lib.NoRestorableCheckpoint) as caught:
    ckpt.restore_newest(damaged)
  ckpt.close()
  hint = "choose another workdir" if read_only else "--config.checkpoint.restore=never"
  assert_one_line(caught.value, errors.EXIT_CHECKPOINT, f"no checkpoint in {directory} can be restored (3 steps; the "
                  "newest, step 30: ValueError: damaged step 30)", hint)
  assert caught.value.__notes__ == [f"step {s}: ValueError: damaged step {s}" for s in (30, 20, 10)]


# tensorstore's error for a checkpoint write on a full disk (read on a 300 KiB tmpfs), Orbax's wrapping of it, and
# an OSError as Python raises it.
TENSORSTORE_ENOSPC = ('RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT database at local file "{tmp}/state.'
                      'orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: "{tmp}/state.orbax-checkpoint-tmp/ocdbt.'
                      'process_0/d/cbd6d144457330fb58086204482cc473": Failed to write 205627 bytes to file 7: No space '
                      "left on device [os_error_code='28']")


def wrapped(error):
  try:
    raise error
  except Exception as e:  # noqa: BLE001
    try:
      raise RuntimeError("Orbax: the save failed") from e
    except RuntimeError as outer:
      return outer


@pytest.mark.parametrize("kind", ["tensorstore", "orbax", "oserror"])
def test_a_checkpoint_save_on_a_full_disk_says_so_and_leaves_nothing_half_written(kind, tmp_path, monkeypatch):
  """It read `...: ValueError: RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT database at local file
  "/.../1.orbax-checkpoint-tmp/state.orbax-` (cut at 300 characters), and left the step's temporary folder."""
  directory = tmp_path / "checkpoints"
  ckpt = checkpoint_lib.Checkpointer(str(directory), keep=0, async_save=False)
  partial = directory / "1.orbax-checkpoint-tmp"
  error = {"tensorstore": ValueError(TENSORSTORE_ENOSPC.format(tmp=partial)),
           "orbax": wrapped(ValueError(TENSORSTORE_ENOSPC.format(tmp=partial))),
           "oserror": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "state" / "d" / "x"))}[kind]

  def write_then_fail(*args, **kwargs):  # as the writer: part of the step written, then the disk is full
    (partial / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    raise error

  monkeypatch.setattr(ckpt.manager, "save", write_then_fail)
  with pytest.raises(paths.StorageError) as caught:
    ckpt.save(1, {"params": {"w": jnp.ones((2, 2))}}, {}, ml_collections.ConfigDict({"seed": 0}))
  assert_one_line(caught.value, errors.EXIT_STORAGE, f"saving checkpoint step 1 to {directory}/1 failed: No space "
                  "left on device")
  assert str(caught.value).endswith("failed: No space left on device")
  assert os.listdir(directory) == []
