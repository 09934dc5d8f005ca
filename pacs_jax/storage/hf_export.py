"""Checkpoint -> Hugging Face export: restores only the policy parameters and writes them with `hf.save_pretrained`,
beside the run's tokenizer and generation config (`pacs_jax.data.tokenizers`). A LoRA run's checkpoint holds its
adapters only: its base weights are read again from the run's `model.hf_path` (or drawn again from its seed), checked
against the base fingerprint of the checkpoint's record, and the merged W + scale · A B is written; or, with
`adapter=True`, the adapters alone as a PEFT adapter folder.

Workdirs and outputs may be local or `gs://`; reading a workdir never creates or deletes anything in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import paths
from pacs_jax import sharding
from pacs_jax.data import tokenizers
from pacs_jax.models import decoder, families, hf, lora
from pacs_jax.models.model_config import ModelConfig
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.storage import resume
from pacs_jax.storage import workdir as workdir_lib
from pacs_jax.storage.workdir import CHECKPOINT_DIR, MODEL_DIR


def write_model_card(workdir: str, config: ModelConfig, tokenizer, source_dir: str | None = None) -> None:
  """Saves what export needs besides weights (process 0 only); `source_dir`: the model's own directory, whose
  generation_config.json and config.json's special-token ids are kept."""
  if jax.process_index() != 0:
    return
  with paths.staged_dir(workdir_lib.model_dir(workdir), last=(hf.CONFIG_FILE,)) as local:
    tokenizer.save_pretrained(local)
    with open(f"{local}/{tokenizers.GENERATION_CONFIG_FILE}", "w") as f:
      json.dump(tokenizers.generation_config(tokenizer, source_dir), f, indent=2)
    with open(f"{local}/{hf.CONFIG_FILE}", "w") as f:
      json.dump({**config.to_hf_dict(), **tokenizers.config_token_ids(tokenizer, source_dir)}, f, indent=2)


def open_checkpoints(workdir: str) -> checkpoint_lib.Checkpointer:
  """The workdir's checkpoints, read-only; FileNotFoundError (creating nothing) when there are none."""
  directory = workdir_lib.checkpoint_dir(workdir)
  if not paths.isdir(workdir):
    raise FileNotFoundError(f"{paths.normalize(workdir)}: no such workdir")
  if not paths.isdir(directory):
    raise FileNotFoundError(f"{paths.normalize(workdir)}: not a training workdir (it has no {CHECKPOINT_DIR}/)")
  ckpt = checkpoint_lib.Checkpointer(directory, read_only=True)
  if not ckpt.all_steps():
    ckpt.close()
    raise FileNotFoundError(f"{directory}: no complete checkpoint (has the run saved one yet?)")
  return ckpt


def latest_step(workdir: str) -> int:
  ckpt = open_checkpoints(workdir)
  try:
    return ckpt.latest_step()
  finally:
    ckpt.close()


class NoAdapters(checkpoint_lib.CheckpointMismatch):
  """An adapter export of a full-parameter run: its checkpoint holds no adapters."""


class BaseChanged(checkpoint_lib.CheckpointMismatch):
  """A LoRA run's base weights (model.hf_path) are not the ones its adapters were trained on."""


@dataclasses.dataclass
class Policy:
  """A checkpoint's policy: `model` (a LoRA run's holds its adapters on the base), the step, and a LoRA run's spec
  and base (`model.hf_path`, empty for a seeded random init)."""
  model: decoder.CausalLM
  step: int
  spec: lora.LoraSpec | None = None
  base_path: str = ""


def lora_spec_of(saved: dict) -> lora.LoraSpec | None:
  """The LoraSpec of a checkpoint's saved config (None: a full-parameter run, or one saved before LoRA existed)."""
  if not (saved.get("lora") or {}).get("rank"):
    return None
  return config_lib.lora_spec(ml_collections.ConfigDict(saved))


def load_base(saved: dict, config: ModelConfig, record: dict | None, where: str) -> nnx.State:
  """A LoRA run's frozen base weights (`config.param_dtype`), as its trainer built them: `model.hf_path`'s, or the
  seeded random init; BaseChanged when their fingerprint is not the checkpoint record's."""
  cfg = ml_collections.ConfigDict(saved)
  expected = (record or {}).get("base")
  if expected is not None and resume.base_fingerprint(cfg) != expected:
    raise BaseChanged(f"{where}: its adapters were trained on another base than model.hf_path="
                      f"{cfg.model.hf_path or '(a random init)'} holds now (fingerprint {expected} in the checkpoint)")
  if cfg.model.hf_path:
    model, _ = hf.load_pretrained(cfg.model.hf_path, dtype=config.param_dtype)
  else:
    model = sharding.create_sharded(lambda: families.causal_lm(config, rngs=nnx.Rngs(cfg.seed)), None)
  return nnx.state(model, nnx.Param)


def load_policy(workdir: str, step: int | None = None) -> tuple[decoder.CausalLM, int]:
  """The policy of a training checkpoint on one device; the optimizer state is never read. Default: the
  newest checkpoint that restores (a damaged newer one is skipped with a warning)."""
  policy = load(workdir, step)
  return policy.model, policy.step


class ModelCardMismatch(checkpoint_lib.CheckpointMismatch):
  """A workdir whose model/config.json describes another model than its checkpoint was trained as."""


def check_model_card(ckpt: checkpoint_lib.Checkpointer, step: int, config: ModelConfig, where: str) -> None:
  """ModelCardMismatch, naming the fields, when the shape fields (`resume.MODEL_FIELDS`) of the checkpoint's record
  differ from those of `config` (the workdir's model/config.json); a checkpoint without a record is not checked."""
  record = ckpt.read_record(step)
  if record is None:
    return
  current = {k: config.to_hf_dict().get(k) for k in resume.MODEL_FIELDS}
  changes = resume.differences({"model": record.get("model")}, {"model": current}).get("model")
  if changes:
    raise ModelCardMismatch(f"{paths.join(ckpt.directory, str(step))}: trained as another model than "
                            f"{where}/{hf.CONFIG_FILE} describes ({'; '.join(changes)}): the two are of different runs")


def load(workdir: str, step: int | None = None, adapters_only: bool = False) -> Policy:
  """`load_policy`'s policy with what a LoRA run's export needs; `adapters_only`: a LoRA run's adapters on an
  abstract base (nothing of the base is read), and NoAdapters for a full-parameter run."""
  ckpt = open_checkpoints(workdir)
  try:
    with paths.local_dir(workdir_lib.model_dir(workdir)) as model_dir:
      if not paths.isfile(f"{model_dir}/{hf.CONFIG_FILE}"):
        raise FileNotFoundError(f"{workdir_lib.model_dir(workdir)}: missing {hf.CONFIG_FILE} (written when "
                                "training starts)")

      def restore(s: int) -> tuple:
        saved = ckpt.restore_config(s)
        param_dtype = config_lib.dtype(saved["model"]["param_dtype"])
        config = hf.load_config(model_dir, param_dtype=param_dtype, dtype=param_dtype)
        check_model_card(ckpt, s, config, workdir_lib.model_dir(workdir))
        spec = lora_spec_of(saved)
        if spec is None and adapters_only:
          raise NoAdapters(f"--adapter: {paths.join(ckpt.directory, str(s))} is a full-parameter run's checkpoint "
                           "(lora.rank 0): it has no adapters; export the model without --adapter")
        graphdef, trained, base = _abstract_policy(config, spec)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), trained)
        return saved, config, spec, graphdef, ckpt.restore_params(s, target), base

      if step is not None:
        if step not in ckpt.all_steps():
          raise FileNotFoundError(f"{ckpt.directory}: no checkpoint of step {step} (there are {ckpt.all_steps()})")
        restored = restore(step)
      else:
        step, restored = ckpt.restore_newest(restore)
      saved, config, spec, graphdef, trained, base = restored
      if spec is None:
        return Policy(nnx.merge(graphdef, trained), step)
      if not adapters_only:  # read after the step is chosen: a base that fails to load is no damaged checkpoint
        base = load_base(saved, config, ckpt.read_record(step), paths.join(ckpt.directory, str(step)))
      return Policy(nnx.merge(graphdef, trained, base), step, spec, saved["model"].get("hf_path") or "")
  finally:
    ckpt.close()


def _abstract_policy(config: ModelConfig, spec: lora.LoraSpec | None):
  """(graphdef, the checkpoint's trained parameters, abstract base or None) of the policy, abstract: a full run's
  parameters, or a LoRA run's adapters (fp32, as trained: any narrower dtype converts exactly) and its base."""
  if spec is None:
    return *nnx.split(nnx.eval_shape(lambda: families.causal_lm(config, rngs=nnx.Rngs(0))), nnx.Param), None
  return lora.split(nnx.eval_shape(lambda: lora.add_adapters(families.causal_lm(config, rngs=nnx.Rngs(0)), spec,
                                                              nnx.Rngs(0), dtype=jnp.float32)))


EXPORT_MARKER = ".pacs_jax_export.json"  # in an export: the files it wrote, so --overwrite replaces only those


class OutputNotEmpty(FileExistsError):
  """An export's --out holds files, and --overwrite was not given (or they are not a previous export's)."""


def save_model_dir(model, out_dir: str, tokenizer=None, *, max_shard_size: int | str | None = "5GB", dtype=None,
                   generation_config: dict | None = None, token_ids: dict | None = None) -> None:
  """A Hugging Face model directory: the weights and config.json (`hf.save_pretrained`, every process taking part),
  then, with a tokenizer, the tokenizer and generation_config.json (`tokenizers.save_tokenizer`, process 0);
  config.json's special-token ids are `token_ids` (default: the tokenizer's)."""
  if token_ids is None and tokenizer is not None:
    token_ids = tokenizers.config_token_ids(tokenizer)
  hf.save_pretrained(model, out_dir, max_shard_size=max_shard_size, dtype=dtype, token_ids=token_ids)
  if tokenizer is not None and jax.process_index() == 0:
    tokenizers.save_tokenizer(tokenizer, out_dir, generation_config)


def export(workdir: str, out_dir: str, step: int | None = None, dtype: str | None = None,
           max_shard_size: str | int | None = "5GB", overwrite: bool = False, adapter: bool = False) -> str:
  """Writes the checkpoint's policy as a Hugging Face directory (weights, config.json, tokenizer): a LoRA run's with
  its adapters merged into the base. `adapter`: a LoRA run's adapters alone, as a PEFT adapter folder (NoAdapters
  for a full-parameter run).

  The files are written into a fresh temporary folder and moved into place. An `out_dir` that holds files is
  refused unless `overwrite`, which replaces only the files a previous export wrote there (listed in its
  `.pacs_jax_export.json`); any other file there is left alone, and with one the export is refused.
  """
  remove_stale_staging(out_dir)
  previous = _previous_export(out_dir, overwrite)  # before the checkpoint is read: refuse early
  policy = load(workdir, step, adapters_only=adapter)
  hf.refuse_non_finite(lora.split(policy.model)[1] if adapter else nnx.state(policy.model, nnx.Param),
                       f"{workdir_lib.checkpoint_dir(workdir)}/{policy.step}", "; choose an earlier one with --step")
  staging = _staging_dir(out_dir)
  try:
    if adapter:
      peft = lora.to_peft(lora.split(policy.model)[1], policy.spec, policy.model.config, policy.base_path or None)
      if jax.process_index() == 0:
        _write_adapter(*peft, staging, dtype)
    else:
      _write_model(policy, workdir, staging, dtype, max_shard_size)
    if jax.process_index() == 0:
      files = sorted(os.path.relpath(os.path.join(root, name), staging)
                     for root, _, names in os.walk(staging) for name in names)
      with open(os.path.join(staging, EXPORT_MARKER), "w") as f:
        json.dump({"workdir": paths.normalize(workdir), "step": policy.step, "files": files}, f, indent=1)
      paths.ordinary_permissions(staging)  # a 0700 temporary folder and 0600 weights: unreadable to a server
      _move_into_place(staging, out_dir, files, previous)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return paths.normalize(out_dir)


def _write_model(policy: Policy, workdir: str, local: str, dtype: str | None, max_shard_size) -> None:
  """The policy (a LoRA run's merged) as a Hugging Face directory, with the run's tokenizer, into `local`."""
  with paths.local_dir(workdir_lib.model_dir(workdir)) as model_dir:
    tokenizer = tokenizers.load_tokenizer(model_dir)  # read whole: no file of it is needed afterwards
    generation = tokenizers.generation_config(tokenizer, model_dir)
    token_ids = tokenizers.config_token_ids(tokenizer, model_dir)  # the source model's, kept in its model card
  model = lora.merged_model(policy.model, policy.spec) if policy.spec else policy.model
  save_model_dir(model, local, tokenizer, max_shard_size=max_shard_size,
                 dtype=config_lib.dtype(dtype) if dtype else None, generation_config=generation, token_ids=token_ids)


STAGING = ".pacs_jax_export.partial"  # `<STAGING>-<host>-<pid>-<random>`: an export being written


def _staging_dir(out_dir: str) -> str:
  """A fresh local folder to write the export into, on the file system it will end up on (renamed into place):
  beside a new `out_dir`, inside an existing empty one (e.g. a mount point, which cannot be replaced), a
  temporary folder for a `gs://` one."""
  prefix = f"{STAGING}-{socket.gethostname()}-{os.getpid()}-"
  if paths.is_remote(out_dir):
    return tempfile.mkdtemp(prefix=prefix)
  target = paths.normalize(out_dir)
  if os.path.isdir(target):
    return tempfile.mkdtemp(prefix=prefix, dir=target)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  return tempfile.mkdtemp(prefix=f".{os.path.basename(target)}{prefix}", dir=os.path.dirname(target))


def remove_stale_staging(out_dir: str) -> list[str]:
  """Removes the staging folders of earlier exports to `out_dir` (beside or inside it) whose process is gone (a
  kill -9 leaves one holding full weights); returns their paths. Another host's are left alone."""
  if paths.is_remote(out_dir):
    return []
  target = paths.normalize(out_dir)
  candidates = [os.path.join(target, n) for n in paths.listdir(target) if n.startswith(STAGING + "-")]
  beside = f".{os.path.basename(target)}{STAGING}-"
  candidates += [os.path.join(os.path.dirname(target), n) for n in paths.listdir(os.path.dirname(target))
                 if n.startswith(beside)]
  removed = []
  for folder in candidates:
    host, pid = os.path.basename(folder).split(STAGING + "-", 1)[1].rsplit("-", 2)[:2]
    if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
      shutil.rmtree(folder, ignore_errors=True)
      removed.append(folder)
  return removed


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # another user's process
  return True


def _previous_export(out_dir: str, overwrite: bool) -> list[str]:
  """The files of the previous export in `out_dir` that `overwrite` replaces ([] for a missing or empty
  folder); OutputNotEmpty when the folder holds files that may not be replaced."""
  names = [n for n in paths.listdir(out_dir) if not n.startswith(STAGING + "-")]
  if not names:
    if paths.isfile(out_dir):
      raise OutputNotEmpty(f"--out {paths.normalize(out_dir)}: is a file, not a folder")
    return []
  marker = paths.join(out_dir, EXPORT_MARKER)
  previous = json.loads(paths.read_text(marker))["files"] if paths.isfile(marker) else None
  if previous is None:
    raise OutputNotEmpty(f"--out {paths.normalize(out_dir)}: holds files that no pacs_jax export wrote "
                         f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); choose an empty or new folder")
  if not overwrite:
    raise OutputNotEmpty(f"--out {paths.normalize(out_dir)}: holds the export of step "
                         f"{json.loads(paths.read_text(marker)).get('step')}; pass --overwrite to replace it "
                         "(only its files: others there stay)")
  return previous


def _move_into_place(staging: str, out_dir: str, files: list[str], previous: list[str]) -> None:
  """A new folder is renamed into place whole; over a previous export, its files are replaced by the new ones
  (config.json first out and last in: a folder that has it is complete) and nothing else is touched."""
  if not paths.is_remote(out_dir) and not previous and not os.path.isdir(out_dir):
    os.replace(staging, paths.normalize(out_dir))  # a new folder, whole
    return
  marker = paths.join(out_dir, EXPORT_MARKER)
  # While files move, the marker claims both sets: an interrupted export or overwrite can be redone.
  paths.write_atomic(marker, json.dumps({"files": sorted(set(previous) | set(files))}, indent=1))
  for name in sorted(previous, key=lambda n: n not in (hf.CONFIG_FILE, lora.ADAPTER_CONFIG)):
    if name != EXPORT_MARKER:
      paths.remove(paths.join(out_dir, name))
  last = (hf.CONFIG_FILE, lora.ADAPTER_CONFIG, EXPORT_MARKER)
  for name in sorted(files, key=lambda n: (n in last, n)) + [EXPORT_MARKER]:
    source, target = os.path.join(staging, name), paths.join(out_dir, name)
    if paths.is_remote(out_dir):
      paths.path(target).write_bytes(open(source, "rb").read())
    else:
      paths.rename(source, target)


def is_workdir(path: str) -> bool:
  """A training workdir (checkpoints and the model card), as opposed to a Hugging Face directory."""
  return paths.isdir(workdir_lib.checkpoint_dir(path)) and paths.isfile(
      paths.join(workdir_lib.model_dir(path), hf.CONFIG_FILE))


@contextlib.contextmanager
def model_to_evaluate(path: str, step: int | None = None) -> Iterator[tuple[str, str, str]]:
  """(Hugging Face directory to read, default output folder, the name evaluate records) of `--model path`: a
  Hugging Face directory itself; of a training workdir, its checkpoint (the newest that restores by default)
  exported into a temporary local folder removed afterwards, the results going to `<workdir>-eval_step_<S>`
  beside it: a workdir is never written."""
  if not is_workdir(path):
    cause = paths.unreachable(path)  # (asked once: is_workdir's retried look-ups read an outage as "no folder")
    if cause:
      raise paths.StorageUnreachable(f"{path}: storage unreachable ({cause}); rerun the same command to resume")
    if not paths.isfile(paths.join(path, hf.CONFIG_FILE)):
      raise FileNotFoundError(f"--model {path}: neither a Hugging Face directory ({hf.CONFIG_FILE}) nor a training "
                              f"workdir ({CHECKPOINT_DIR}/ and {MODEL_DIR}/)")
    yield path, path, paths.canonical(path)
    return
  with tempfile.TemporaryDirectory(prefix="pacs_jax_evaluate_") as tmp:
    local = export(path, os.path.join(tmp, "model"), step=step)
    step = json.loads(paths.read_text(os.path.join(local, EXPORT_MARKER)))["step"]
    yield local, f"{paths.normalize(path)}-eval_step_{step}", f"{paths.canonical(path)} step {step}"


def export_adapter(adapters: nnx.State, spec: lora.LoraSpec, config: ModelConfig, out_dir: str, *,
                   base_model_name_or_path: str | None = None, dtype=None) -> str:
  """Writes a causal LM's LoRA adapters as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors
  with PEFT's key names) that `peft.PeftModel.from_pretrained(base, out_dir)` loads and vLLM serves as a LoRA
  adapter; `base_model_name_or_path` goes into its config, `dtype` (e.g. "bfloat16") converts on the way out.
  Every process takes part in gathering the adapters; process 0 writes (the config last, on Cloud Storage)."""
  peft = lora.to_peft(adapters, spec, config, base_model_name_or_path)
  if jax.process_index() == 0:
    with paths.staged_dir(out_dir, last=(lora.ADAPTER_CONFIG,)) as local:
      _write_adapter(*peft, local, dtype)
  return paths.normalize(out_dir)


def _write_adapter(tensors: dict[str, np.ndarray], adapter_config: dict, local: str, dtype) -> None:
  """A PEFT adapter folder's two files (`lora.to_peft`'s tensors and config) into the local folder `local`."""
  if dtype is not None:
    tensors = {k: v.astype(config_lib.dtype(dtype) if isinstance(dtype, str) else dtype) for k, v in tensors.items()}
  hf.save_safetensors({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(local, lora.ADAPTER_WEIGHTS))
  with open(os.path.join(local, lora.ADAPTER_CONFIG), "w") as f:
    json.dump(adapter_config, f, indent=2)
