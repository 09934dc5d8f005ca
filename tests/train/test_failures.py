"""Failures a long job meets (issue 23): each ends in one line on stderr naming the thing, its path and the
cause, with a non-zero exit status of its kind, creates nothing before its inputs are read, and loses nothing
(exports never mix two steps nor touch foreign files; a resume under another run's settings is refused)."""

import errno
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import errors
from pacs_jax.data import synthetic_tasks as synthetic
from pacs_jax.models import qwen2
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.storage import hf_export as export_lib
from pacs_jax.trainer import loop
from pacs_jax.services.metrics import read_rows
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
RUN = ["--config", TINY, "--config.eval_every=0", "--config.train.batch_prompts=8",
       "--config.train.mini_batch_prompts=4", "--config.checkpoint.every=1"]
# Lines the C++ side of jax's CUDA plugin prints at import where it finds no driver (`pip install -e
# ".[gpu-compile]"`), in every process: not the program's output.
PLATFORM_NOISE = ("All log messages before absl::InitializeLog() is called", "cudart_stub.cc")


def tiny(**overrides):
  base = {"steps": 2, "eval_every": 0, "train.batch_prompts": 8, "train.mini_batch_prompts": 4,
          "checkpoint.async_save": False, "checkpoint.every": 1, "checkpoint.keep": 0}
  return config_lib.load_config_file(TINY, {**base, **overrides})


def env(**extra):
  return {**os.environ, "XLA_FLAGS": child_env.xla_flags(),
          "JAX_PLATFORMS": "cpu", "PYTHONPATH": child_env.pythonpath(ROOT),
          "PACS_JAX_COMPILATION_CACHE": os.path.join(ROOT, ".jax_cache", "trainer"), **extra}


def cli(module, *args, cwd, environ=None, prelude=None):
  """`python -m module args`; `prelude`: Python run first in the same process (a simulated fault)."""
  if prelude:
    command = [sys.executable, "-c", f"{prelude}\nimport runpy, sys\nsys.argv = ['{module}', *sys.argv[1:]]\n"
               f"runpy.run_module('{module}', run_name='__main__', alter_sys=True)", *args]
  else:
    command = [sys.executable, "-m", module, *args]
  return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd, env=environ or env())


def stderr_lines(result) -> list[str]:
  return [line for line in result.stderr.splitlines()
          if line.strip() and not any(noise in line for noise in PLATFORM_NOISE)]


def assert_failed_in_lines(result, most: int, status: int, *expected: str):
  lines = stderr_lines(result)
  assert result.returncode == status, result.stderr
  assert len(lines) <= most, "\n".join(lines)
  for text in expected:
    assert text in lines[-1], lines[-1]
  assert "Traceback" not in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------------------
# 5. Bad paths and names: <= 3 lines naming the field or file, non-zero exit, no workdir created.

@pytest.mark.parametrize("case", ["missing", "directory", "not_parquet", "prompts_too_long", "config_raises",
                                  "config_missing", "unknown_field", "unknown_field_in_a_section", "removed_field"])
def test_a_bad_path_or_name_is_one_line_and_creates_nothing(case, tmp_path):
  (tmp_path / "adir").mkdir()
  (tmp_path / "fake.parquet").write_text("not parquet")
  (tmp_path / "raising.py").write_text("def get_config():\n  raise RuntimeError('boom')\n")
  args, status, expected = {
      "missing": (["--config.data.train=missing.jsonl"], errors.EXIT_DATA, ["missing.jsonl: no such file"]),
      "directory": (["--config.data.train=adir"], errors.EXIT_DATA, ["adir: is a directory"]),
      "not_parquet": (["--config.data.train=fake.parquet"], errors.EXIT_DATA,
                      ["fake.parquet: not a readable parquet file", "magic bytes"]),
      "prompts_too_long": (["--config.data.max_prompt_length=2"], errors.EXIT_CONFIG,
                           ["config.data.max_prompt_length=2", "config.train.batch_prompts=8", "only 0 of 4096"]),
      "config_raises": (["--config", "raising.py"], errors.EXIT_CONFIG,
                        ["config file raising.py: RuntimeError: boom"]),
      "config_missing": (["--config", "nonexistent.py"], errors.EXIT_CONFIG,
                         ["config file nonexistent.py: [Errno 2] No such file or directory"]),
      "unknown_field": (["--config.trian.lr=1"], errors.EXIT_CONFIG,
                        ["--config.trian.lr: no such config field", 'Did you mean "train"']),
      "unknown_field_in_a_section": (["--config.rollout.slotz=1"], errors.EXIT_CONFIG,
                                     ["--config.rollout.slotz: no such config field", 'Did you mean "slots"']),
      "removed_field": (["--config.rollout.kv_cache=dense"], errors.EXIT_CONFIG,
                        ["--config.rollout.kv_cache: was removed: the rollout always uses the paged KV cache"]),
  }[case]
  result = cli("pacs_jax.train", *RUN, "--workdir", "run", "--config.steps=1", *args, cwd=tmp_path)
  assert_failed_in_lines(result, 3, status, "train: ", *expected)
  # (`__pycache__`: Python's byte-code of the config file it imported, where byte-code caches are on: not the run's.)
  assert sorted(set(os.listdir(tmp_path)) - {"__pycache__"}) == ["adir", "fake.parquet", "raising.py"]


# ---------------------------------------------------------------------------------------------------------
# 1. Exports: written beside and moved into place; a used --out refused unless --overwrite, which replaces
# only a previous export's files.

def weights(directory):
  from safetensors.numpy import load_file
  out = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(directory, name)))
  return out


def test_export_twice_into_one_folder(tmp_path):
  import transformers

  workdir = tmp_path / "run"
  loop.train(tiny(), str(workdir), devices=jax.devices()[:1])
  out = tmp_path / "hf"
  result = cli("pacs_jax.export", "--workdir", str(workdir), "--step", "2", "--out", str(out), cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  assert sorted(os.listdir(tmp_path)) == ["hf", "run"]  # the temporary folder is gone
  (out / "notes.txt").write_text("mine")  # e.g. what evaluate writes beside the weights

  second = ["--workdir", str(workdir), "--step", "1", "--out", str(out), "--max_shard_size=100KB"]
  before = {name: (out / name).read_bytes() for name in os.listdir(out)}
  refused = cli("pacs_jax.export", *second, cwd=tmp_path)
  assert_failed_in_lines(refused, 1, errors.EXIT_INPUT, f"export: --out {out}: holds the export of step 2",
                         "--overwrite")
  assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before  # untouched

  result = cli("pacs_jax.export", *second, "--overwrite", cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  names = os.listdir(out)
  assert "model.safetensors" not in names and "model.safetensors.index.json" in names  # no stale step-2 file
  assert (out / "notes.txt").read_text() == "mine"
  model, step = export_lib.load_policy(str(workdir), 1)
  assert step == 1
  expected = {k: np.asarray(v) for k, v in weights_of(model).items()}
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out)
  state = {k: v.detach().numpy() for k, v in reloaded.state_dict().items()}
  for name, value in expected.items():
    np.testing.assert_array_equal(state[name], value, err_msg=name)  # exactly step 1's weights
  assert not np.array_equal(expected["model.embed_tokens.weight"], step2_embedding(workdir))

  # A folder no export wrote is never touched, --overwrite or not.
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "config.json").write_text("{}")
  refused = cli("pacs_jax.export", "--workdir", str(workdir), "--out", str(foreign), "--overwrite", cwd=tmp_path)
  assert_failed_in_lines(refused, 1, errors.EXIT_INPUT, f"--out {foreign}: holds files that no pacs_jax export wrote")
  assert os.listdir(foreign) == ["config.json"] and (foreign / "config.json").read_text() == "{}"


def weights_of(model) -> dict:
  """HF name -> array of a model's parameters, as save_pretrained writes them."""
  import tempfile

  from pacs_jax.models import hf
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(model, d)
    return weights(d)


def step2_embedding(workdir):
  model, _ = export_lib.load_policy(str(workdir), 2)
  return np.asarray(weights_of(model)["model.embed_tokens.weight"])


# ---------------------------------------------------------------------------------------------------------
# 2 and 6. A resume under another algorithm, model size (layer count) or tokenizer: refused in one line.

@pytest.fixture(scope="module")
def one_layer_run(tmp_path_factory):
  """A 1-step PACS run of a 1-layer tiny model (the tiny preset has 2)."""
  workdir = tmp_path_factory.mktemp("one_layer") / "run"
  saved = qwen2.PRESETS["tiny"]
  qwen2.PRESETS["tiny"] = saved.replace(num_hidden_layers=1)
  try:
    loop.train(tiny(steps=1), str(workdir), devices=jax.devices()[:1])
  finally:
    qwen2.PRESETS["tiny"] = saved
  return workdir


@pytest.fixture(scope="module")
def two_layer_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("two_layer") / "run"
  loop.train(tiny(steps=1), str(workdir), devices=jax.devices()[:1])
  return workdir


def other_tokenizer(directory) -> str:
  """The synthetic tokenizer with two words' ids swapped: same size, other ids."""
  tokenizer = synthetic.build_tokenizer()
  tokenizer.save_pretrained(directory)
  path = os.path.join(directory, "tokenizer.json")
  with open(path) as f:
    spec = json.load(f)
  vocab = spec["model"]["vocab"]
  vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
  with open(path, "w") as f:
    json.dump(spec, f)
  return str(directory)


@pytest.mark.parametrize("change", ["algorithm", "layers", "tokenizer", "algorithm_allowed", "data_and_rollout"])
def test_a_resume_under_another_run_is_refused_in_one_line(change, one_layer_run, two_layer_run, tmp_path):
  workdir, args, expected = {
      "algorithm": (two_layer_run, ["--config.algorithm=grpo"], ["another algorithm (algorithm: 'pacs' -> 'grpo')",
                                                                  "--config.checkpoint.allow_changes=algorithm"]),
      "layers": (one_layer_run, [], ["another model (model.num_hidden_layers: 1 -> 2)",
                                     "--config.checkpoint.restore=never"]),
      "tokenizer": (two_layer_run, [f"--config.tokenizer={other_tokenizer(tmp_path / 'tok')}"],
                    ["another tokenizer (tokenizer.name: 'synthetic' ->", "tokenizer.vocab_sha256",
                     "--config.checkpoint.allow_changes=tokenizer"]),
      # Allowed, but PPO's state has a critic that PACS's has not: healthy checkpoints of another state, not damage.
      "algorithm_allowed": (two_layer_run, ["--config.algorithm=ppo", "--config.checkpoint.allow_changes=algorithm"],
                            ["holds another training state than this run's (of another form: critic_opt_state, critic_params)",
                             "use another --workdir, or --config.checkpoint.restore=never"]),
      # The README's quick check, then the real run in the same workdir (issue 35): refused, not a warning.
      "data_and_rollout": (two_layer_run, ["--config.data.max_prompt_length=32", "--config.rollout.max_new_tokens=5"],
                           ["another data/rollout (data.max_prompt_length: 16 -> 32; rollout.max_new_tokens: 4 -> 5)",
                            "--config.checkpoint.allow_changes=data,rollout"]),
  }[change]
  before = sorted(os.listdir(workdir / "checkpoints"))
  result = cli("pacs_jax.train", *RUN, "--workdir", str(workdir), "--config.steps=3", *args, cwd=tmp_path)
  start = (f"train: {workdir}/checkpoints/1: " if change == "algorithm_allowed" else
           f"train: {workdir}/checkpoints: checkpoint step 1 was trained with")
  assert_failed_in_lines(result, 3 if change == "algorithm_allowed" else 1, errors.EXIT_CHECKPOINT, start, *expected)
  assert "Repair" not in result.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == before  # nothing set aside, nothing saved
  assert [r["step"] for r in read_rows(str(workdir / "metrics.jsonl"))] == [1]
  log = (workdir / errors.LOG_FILE).read_text()
  assert "Traceback" in log and "CheckpointMismatch" in log


def test_allowed_changes_resume_and_other_changes_warn(two_layer_run, tmp_path, caplog):
  workdir = tmp_path / "run"
  import shutil
  shutil.copytree(two_layer_run, workdir)
  cfg = tiny(steps=1, **{"pacs.beta": 2.0, "train.lr": 1e-3, "checkpoint.allow_changes": "objective"})
  trainer = loop.Trainer(cfg, str(workdir), devices=jax.devices()[:1])
  with caplog.at_level("WARNING"):
    trainer.run()
  messages = [r.getMessage() for r in caplog.records]
  assert any("resuming step 1 with another objective" in m and "pacs.beta: 1.0 -> 2.0" in m for m in messages)
  assert any("config changed since checkpoint step 1: train.lr: 0.003 -> 0.001" in m for m in messages), messages


def test_a_checkpoint_without_a_record_still_resumes(two_layer_run, tmp_path, caplog):
  import shutil
  workdir = tmp_path / "run"
  shutil.copytree(two_layer_run, workdir)
  shutil.rmtree(workdir / "checkpoints" / "1" / checkpoint_lib.RECORD_ITEM)  # as saved before records existed
  trainer = loop.Trainer(tiny(steps=2), str(workdir), devices=jax.devices()[:1])
  with caplog.at_level("WARNING"):
    trainer.run()
  assert any("checkpoint step 1 predates resume records" in r.getMessage() for r in caplog.records)
  assert [r["step"] for r in read_rows(str(workdir / "metrics.jsonl"))] == [1, 2]
  # ... and one under another algorithm is refused on what its saved config tells.
  with pytest.raises(checkpoint_lib.CheckpointMismatch, match="another algorithm"):
    shutil.rmtree(workdir / "checkpoints" / "2" / checkpoint_lib.RECORD_ITEM)
    loop.Trainer(tiny(steps=3, algorithm="grpo"), str(workdir), devices=jax.devices()[:1]).run()


# ---------------------------------------------------------------------------------------------------------
# 3. A full disk during an (async) save: the run stops at the next step boundary in a few lines naming the
# step, path and cause; a restart resumes from the last complete checkpoint, bitwise.

DISK_FULL_AT_STEP_2 = f"""
import errno
from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler
save = handler.JsonCheckpointHandler._save_fn
async def full_disk(self, x, directory):
  if '/2.orbax-checkpoint-tmp' in str(directory):
    raise OSError(errno.ENOSPC, 'No space left on device', str(directory / 'metadata'))
  return await save(self, x, directory)
handler.JsonCheckpointHandler._save_fn = full_disk
"""


def final_params(workdir, step):
  model, restored = export_lib.load_policy(str(workdir), step)
  assert restored == step
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_a_full_disk_stops_the_run_in_a_few_lines_and_a_restart_resumes(tmp_path):
  args = [*RUN, "--config.steps=4"]
  failed = cli("pacs_jax.train", *args, "--workdir", "run", cwd=tmp_path, prelude=DISK_FULL_AT_STEP_2)
  assert_failed_in_lines(failed, 3, errors.EXIT_STORAGE, "train: saving checkpoint step 2 to",
                         f"{tmp_path}/run/checkpoints/2", "No space left on device")
  logged = [r["step"] for r in read_rows(str(tmp_path / "run" / "metrics.jsonl"))]
  assert logged in ([1, 2], [1, 2, 3]), logged  # stopped at the boundary after the failure came in
  assert sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit()) == [1]

  resumed = cli("pacs_jax.train", *args, "--workdir", "run", cwd=tmp_path)
  assert resumed.returncode == 0, resumed.stderr
  assert "resumed from step 1" in resumed.stdout
  assert [r["step"] for r in read_rows(str(tmp_path / "run" / "metrics.jsonl"))] == [1, 2, 3, 4]
  reference = cli("pacs_jax.train", *args, "--workdir", "reference", cwd=tmp_path)
  assert reference.returncode == 0, reference.stderr
  for a, b in zip(final_params(tmp_path / "run", 4), final_params(tmp_path / "reference", 4)):
    np.testing.assert_array_equal(a, b)
  assert errno.ENOSPC  # (the simulated cause)


# ---------------------------------------------------------------------------------------------------------
# 4. A Cloud Storage outage mid-run (the emulator stops answering): the trainer gives up within seconds, not
# minutes, in a few lines naming the bucket and the cause; once the bucket is back the same command resumes from
# the last complete checkpoint and metrics.jsonl holds each step once.

# How long the trainer may take to give up once the bucket stops answering: a request's retries
# (paths.STORAGE_RETRIES: about 15 s, 3 s in the tests) plus a step in flight and the shutdown, with room for a loaded CI machine.
GIVE_UP_WITHIN_S = 45


@pytest.mark.parametrize("first_to_fail", ["metrics", "checkpoint"])
def test_an_outage_ends_in_a_few_lines_and_a_restart_resumes_without_duplicate_rows(first_to_fail, local_gcs,
                                                                                    tmp_path):
  prefix = f"runs/{tmp_path.name}"
  workdir = f"gs://{local_gcs.bucket}/{prefix}"
  environ = env(**local_gcs.env)
  command = [sys.executable, "-m", "pacs_jax.train", *RUN, "--workdir", workdir]
  if first_to_fail == "checkpoint":
    # Without metrics rows to write, the first to meet the outage is a checkpoint save (failing in Orbax's thread):
    # the outage starts once the first checkpoint is complete.
    only = ["--config.log_every=1000"]
    started = lambda: local_gcs.exists(f"{prefix}/checkpoints/1/commit_success.txt")
  else:
    # A complete checkpoint (step 1) first; then a run that saves none before its end, so whenever the outage
    # starts, the first to meet it is a metrics row (not a save that happens to fall in the same instant).
    first = subprocess.run([*command, "--config.steps=1"], capture_output=True, text=True, cwd=tmp_path,
                           env=environ, timeout=300)
    assert first.returncode == 0, first.stderr
    only = ["--config.checkpoint.every=1000"]
    started = lambda: (local_gcs.read(f"{prefix}/metrics.jsonl") or b"").count(b"\n") >= 3  # it logs steps 2, 3
  trainer = subprocess.Popen([*command, "--config.steps=1000", *only], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=environ)
  try:
    deadline = time.monotonic() + 240
    while not started():
      assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()
      time.sleep(0.2)
    local_gcs.stop_serving()
    stopped = time.monotonic()
    out, err = trainer.communicate(timeout=300)
    gave_up_after = time.monotonic() - stopped
  finally:
    trainer.kill()
    local_gcs.serve_again()
  failed = subprocess.CompletedProcess(trainer.args, trainer.returncode, out, err)
  # At most 5 (as before issue 34): the failure's line, after the warnings that come before it when the outage falls
  # where they are due (the restart's config change, TensorBoard's upload retry, orbax's wait for the previous save,
  # tensorstore's notice of the emulator's test token); 7 lines on the merged tree when the step's phase lines were
  # on stderr (they went to stdout).
  assert_failed_in_lines(failed, 5, errors.EXIT_STORAGE, f"train: {workdir}: storage unreachable (Connection refused) "
                         "at step ", "; the last complete checkpoint is step ", "; rerun the same command to resume")
  assert gave_up_after < GIVE_UP_WITHIN_S, (gave_up_after, err)
  last_line = stderr_lines(failed)[-1]
  complete = int(last_line.split("the last complete checkpoint is step ")[1].split(";")[0])
  assert local_gcs.exists(f"{prefix}/checkpoints/{complete}/commit_success.txt")
  assert not local_gcs.exists(f"{prefix}/checkpoints/{complete + 1}/commit_success.txt")
  traceback_log = last_line.rsplit("(traceback: ", 1)[1].rstrip(")")
  with open(traceback_log) as f:
    assert ("StorageError: saving checkpoint step" in f.read()) == (first_to_fail == "checkpoint")
  if first_to_fail == "checkpoint":
    return  # (the restart is the same)

  logged = [r["step"] for r in read_rows(f"{workdir}/metrics.jsonl")]
  assert logged[:complete] == list(range(1, complete + 1)) and len(logged) > complete, (complete, logged)
  steps = max(logged) + 1  # past every step the failed run logged: a resume that repeats one shows twice
  resumed = subprocess.run([*command, f"--config.steps={steps}", "--config.checkpoint.every=1000"],
                           capture_output=True, text=True, cwd=tmp_path, env=environ, timeout=300)
  assert resumed.returncode == 0, resumed.stderr
  assert f"resumed from step {complete}" in resumed.stdout, resumed.stdout
  assert [r["step"] for r in read_rows(f"{workdir}/metrics.jsonl")] == list(range(1, steps + 1))
  assert not any(os.path.exists(os.path.join(folder, "gs:")) for folder in (tmp_path, os.getcwd()))


def test_a_side_effect_of_an_outage_is_named_as_the_outage(local_gcs, monkeypatch):
  """Whatever a client raises while the store is down (Orbax's "not a directory" where gcsfs's listing failed, a
  closed handle), the failure is the outage: the store is asked once more; a connection that failed is the cause
  even when the store answers again by then."""
  workdir = f"gs://{local_gcs.bucket}/runs/side_effects"
  monkeypatch.setattr(errors, "_log_dir", workdir)
  side_effects = [NotADirectoryError(f"{workdir}/checkpoints is not a directory"), OSError("handle is closed"),
                  ValueError("ABORTED: All 5 retry attempts failed: CURL error Could not connect to server")]
  outage = errors.Failure(errors.EXIT_STORAGE, f"{workdir}: storage unreachable (Connection refused); rerun the "
                          "same command to resume")
  assert errors.classify(side_effects[0]).status == errors.EXIT_INPUT  # the store answers: it is what it says
  local_gcs.stop_serving()
  try:
    assert [errors.classify(e) for e in side_effects] == [outage] * 3
  finally:
    local_gcs.serve_again()
  try:
    try:
      raise ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed ('127.0.0.1', 4443)")
    except OSError as e:
      raise OSError("handle is closed") from e
  except OSError as e:
    assert errors.classify(e) == outage
  disk_full = OSError(errno.ENOSPC, "No space left on device", "/w/checkpoints/3")
  assert errors.classify(disk_full) == errors.Failure(errors.EXIT_STORAGE, "/w/checkpoints/3: No space left on device")
  assert errors.classify(ValueError("a bug")) is None  # a bug keeps its whole traceback


def test_a_blip_shorter_than_the_retries_passes_unnoticed(local_gcs, tmp_path):
  """Writes through gcsfs (metrics, JSON items) and through Orbax's tensorstore context (arrays) wait out a store
  that stops answering for a moment (paths.STORAGE_RETRIES)."""
  import threading

  import tensorstore as ts
  from orbax.checkpoint._src.serialization import tensorstore_utils

  from pacs_jax import paths
  context = tensorstore_utils.get_ts_context(use_ocdbt=True)  # as Orbax opens its arrays
  assert context.spec.to_json()["gcs_request_retries"]["max_retries"] == paths.STORAGE_RETRIES.attempts
  prefix = f"runs/{tmp_path.name}"
  arrays = ts.KvStore.open({"driver": "gcs", "bucket": local_gcs.bucket, "path": f"{prefix}/arrays/"},
                           context=context).result()
  local_gcs.stop_serving()
  threading.Timer(1.5, local_gcs.serve_again).start()
  array_written = arrays.write("0.0", b"weights")  # (tried at once, then retried in tensorstore's threads)
  paths.write_atomic(f"gs://{local_gcs.bucket}/{prefix}/metrics.jsonl", "{}\n")
  array_written.result()
  assert local_gcs.exists(f"{prefix}/metrics.jsonl") and local_gcs.exists(f"{prefix}/arrays/0.0")


def test_a_failed_async_save_is_reported_before_the_next_save(tmp_path, monkeypatch):
  """poll_failure (each step) reports a save that failed in Orbax's thread, naming the step and cause, without
  waiting for the next save; the last complete step stays the one before."""
  import jax.numpy as jnp
  import ml_collections
  from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

  save = handler.JsonCheckpointHandler._save_fn

  async def full_disk(self, x, directory):
    if "/2.orbax-checkpoint-tmp" in str(directory):
      raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))
    return await save(self, x, directory)

  monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", full_disk)
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path / "checkpoints"), keep=0, async_save=True)
  config = ml_collections.ConfigDict({"seed": 0})
  checkpointer.save(1, {"w": jnp.ones(3)}, {}, config)
  checkpointer.save(2, {"w": jnp.ones(3)}, {}, config)  # (waits for step 1)
  deadline = time.monotonic() + 60
  while checkpointer.poll_failure() is None:
    assert time.monotonic() < deadline, "the failed save of step 2 was never reported"
    time.sleep(0.05)
  assert checkpointer.poll_failure().startswith(f"saving checkpoint step 2 to {tmp_path}/checkpoints/2 failed: ")
  assert "No space left on device" in checkpointer.poll_failure()
  assert checkpointer.last_complete_step() == 1
  checkpointer.abandon()
