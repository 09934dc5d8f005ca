"""Hugging Face checkpoints <-> the NNX models of every registered family: safetensors (single or sharded with an
index) and config.json, both ways (a model directory's tokenizer and generation config: `pacs_jax.data.tokenizers`).

With a mesh, every tensor is read slice by slice (safetensors lazy slicing) straight into its sharding,
so no process ever holds a full host copy of a large model.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from pacs_jax import paths
from pacs_jax import sharding
from pacs_jax.models import families, hf_layout
from pacs_jax.models.decoder import CausalLM
from pacs_jax.models.hf_layout import TensorMap, read_slice, to_hf
from pacs_jax.models.model_config import ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------------
# Loading


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def resolve_path(path_or_repo_id: str) -> str:
  """A local checkpoint directory as is; a hub id (`Qwen/Qwen2.5-3B`) downloaded once to the local cache;
  FileNotFoundError naming both places when it is neither (a mistyped local path looks like a hub id)."""
  if os.path.isdir(path_or_repo_id) or not re.fullmatch(r"[\w.-]+/[\w.-]+", path_or_repo_id):
    return path_or_repo_id
  if paths.looks_local(path_or_repo_id):  # `./model`, or `runs/x` where runs/ exists: a path, not a hub id
    raise FileNotFoundError(f"{path_or_repo_id}: no such model directory (relative to {os.getcwd()})")
  from huggingface_hub import snapshot_download
  try:
    return snapshot_download(path_or_repo_id, allow_patterns=HUB_FILES)
  except Exception as e:  # no network, no such repo, gated: all one answer to a user who may have meant a path
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise FileNotFoundError(f"{path_or_repo_id}: no such local directory (relative to {os.getcwd()}), and not found "
                            f"on the Hugging Face hub either ({type(e).__name__}: {reason[:160]})") from e


def load_config(path: str, **overrides) -> ModelConfig:
  """Reads `path/config.json` into its family's `ModelConfig` (overrides: dtype, param_dtype, remat...)."""
  path = resolve_path(path)
  cfg_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(f"{cfg_path}: missing config.json (expected a Hugging Face model directory)")
  with open(cfg_path) as f:
    try:
      cfg = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
  try:
    return families.config_from_hf(cfg, **overrides)
  except KeyError as e:
    raise ValueError(f"{cfg_path}: missing field {e.args[0]!r}") from e
  except ValueError as e:
    raise ValueError(f"{cfg_path}: {e}") from e


def weight_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file path, from the index or the single file."""
  index_path = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
  single = os.path.join(path, SINGLE_FILE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
  with safe_open(single, framework="numpy") as f:
    return {name: single for name in f.keys()}


class WeightsMismatch(ValueError):
  """A model directory whose weights hold a tensor its config.json's family does not use, lack one it needs, or hold
  one of another shape than config.json gives it."""


class NonFiniteWeights(ValueError):
  """Weights holding NaN or inf (a run that diverged before its check, a damaged file): nothing to export or evaluate."""


@jax.jit
def _all_finite(tree):
  return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), tree)


def refuse_non_finite(params: nnx.State, where: str, hint: str = "") -> None:
  """Raises NonFiniteWeights naming the first tensor (of `params`, a model's nnx.Param state) holding NaN or inf."""
  finite = jax.device_get(_all_finite(params))
  bad = [".".join(map(str, key)) for key, ok in sorted(nnx.to_flat_state(finite), key=lambda kv: str(kv[0]))
         if not bool(ok.get_value() if isinstance(ok, nnx.Variable) else ok)]
  if bad:
    more = f" and {len(bad) - 1} more tensors" if len(bad) > 1 else ""
    raise NonFiniteWeights(f"{where}: the weights are non-finite (NaN or inf in {bad[0]}{more}){hint}")


# Tensors a checkpoint may hold that no family reads (transformers ignores them too): rotary tables some older
# exports saved, and an lm_head saved beside embeddings it is tied to.
_IGNORED_TENSORS = re.compile(r"(.*\.rotary_emb\.inv_freq|lm_head\.weight)")


def check_tensor_names(path: str, config: ModelConfig, needed: list[str], files: dict[str, str]) -> None:
  """WeightsMismatch, naming the first tensor and the model_type, unless the weights hold exactly the tensors
  the family of `config` reads (`needed`): a tensor it would ignore (q/k/v biases of Qwen2 weights under a llama
  config.json) changes what the model computes as surely as a missing one."""
  wanted = set(needed)
  missing = [name for name in needed if name not in files]
  unused = sorted(name for name in files if name not in wanted and not (
      _IGNORED_TENSORS.fullmatch(name) and (name != "lm_head.weight" or config.tie_word_embeddings)))
  for names, what in ((missing, f"is missing from the weights, and model_type {config.model_type!r} needs it"),
                      (unused, f"is not used by model_type {config.model_type!r}")):
    if names:
      more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
      raise WeightsMismatch(f"{path}: tensor {names[0]!r}{more} {what} (from {CONFIG_FILE}: "
                            f"{config.num_hidden_layers} layers); are {CONFIG_FILE} and the weights of one model?")


def _read_into(maps, files, abstract_state, mesh, dtype) -> dict:
  """Returns {path: jax.Array} for every mapped parameter, each HF tensor checked against its expected shape.

  A stacked parameter [layers, ...] is read layer by layer into its slices. With a mesh, each device
  reads only its own slice of every tensor (the callback's index: layers, then the per-layer dims).
  """
  shardings = sharding.state_shardings(abstract_state, mesh, "train") if mesh is not None else None
  flat = dict(nnx.to_flat_state(abstract_state))
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  by_path: dict[tuple, list[TensorMap]] = {}
  for m in maps:
    by_path.setdefault(m.path, []).append(m)
  handles = {}

  def open_tensor(m: TensorMap, shape: tuple):
    if m.hf_name not in files:
      where = sorted(set(files.values()))
      raise KeyError(f"tensor {m.hf_name!r} is missing from {', '.join(where)}")
    fname = files[m.hf_name]
    if fname not in handles:
      handles[fname] = safe_open(fname, framework="numpy").__enter__()
    tensor = handles[fname].get_slice(m.hf_name)
    expected, got = hf_layout.hf_shape(m.layout, shape), tuple(tensor.get_shape())
    if expected != got:
      raise WeightsMismatch(f"{fname}: tensor {m.hf_name!r} has shape {got}, expected {expected} from {CONFIG_FILE}; "
                            f"are {CONFIG_FILE} and the weights of one model?")
    return tensor

  def reader(group: list[TensorMap], shape: tuple):
    """index (slices over `shape`) -> that part of the parameter, read from the group's HF tensors."""
    layout = group[0].layout
    if group[0].layer is None:
      tensor = open_tensor(group[0], shape)
      return lambda index: np.asarray(read_slice(tensor, layout, shape, index), dtype=dtype)
    if [m.layer for m in group] != list(range(shape[0])):
      raise WeightsMismatch(f"{group[0].path}: expected one tensor per layer for {shape[0]} layers")
    tensors = [open_tensor(m, shape[1:]) for m in group]

    def read(index):
      index = tuple(index) or (slice(None),)
      lo, hi = hf_layout.slice_bounds(index[0], shape[0])
      return np.stack([np.asarray(read_slice(tensors[i], layout, shape[1:], index[1:]), dtype=dtype)
                       for i in range(lo, hi)])
    return read

  out = {}
  try:
    for path, group in by_path.items():
      shape = tuple(flat[path].get_value().shape)
      read = reader(group, shape)
      if mesh is None:
        out[path] = jnp.asarray(read(()))
      else:
        sh = flat_shardings[path]
        sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
        out[path] = jax.make_array_from_callback(shape, sh, read)
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)
  return out


def load_pretrained(path: str, dtype=jnp.float32, mesh=None, compute_dtype=None,
                    **config_overrides) -> tuple[CausalLM, ModelConfig]:
  """Loads a transformers checkpoint directory of a registered family as an NNX model (params in `dtype`).

  `compute_dtype` (default: `dtype`) is the matmul dtype; `config_overrides` set other non-HF fields
  such as `remat`. With a `mesh`, params are placed in their train-mode shardings, each device reading
  only its own slice from disk.
  """
  path = resolve_path(path)
  config = load_config(path, param_dtype=dtype, dtype=compute_dtype or dtype, **config_overrides)
  files = weight_files(path)
  abstract = nnx.eval_shape(lambda: families.causal_lm(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  flat = nnx.to_flat_state(abstract_state)
  maps = families.tensor_maps(config, [p for p, _ in flat])
  check_tensor_names(path, config, [m.hf_name for m in maps], files)
  arrays = _read_into(maps, files, abstract_state, mesh, dtype)
  for p, var in flat:
    var.set_value(arrays[p])
  state = nnx.from_flat_state(flat)
  return nnx.merge(graphdef, state), config


# ----------------------------------------------------------------------------------------------
# Saving


def _to_host(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def _parse_size(size: int | str | None) -> int | None:
  if size is None or isinstance(size, int):
    return size
  m = re.fullmatch(r"\s*(\d+)\s*(KB|MB|GB|B)\s*", size.upper())
  if not m:
    raise ValueError(f"max_shard_size {size!r}: expected e.g. '5GB' or a byte count")
  return int(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[m.group(2)]


def _plan_shards(maps, flat, dtype, limit) -> list[list[TensorMap]]:
  """Groups tensors into files of at most `limit` bytes, from shapes alone (nothing gathered yet)."""
  shards, size = [[]], 0
  for m in maps:
    v = flat[m.path].get_value()
    shape = v.shape[1:] if m.layer is not None else v.shape
    nbytes = math.prod(shape) * np.dtype(dtype or v.dtype).itemsize
    if limit is not None and size and size + nbytes > limit:
      shards.append([])
      size = 0
    shards[-1].append(m)
    size += nbytes
  return shards


def save_safetensors(tensors: dict[str, np.ndarray], file: str) -> None:
  """safetensors' `save_file` (with transformers' metadata) with a plain file's mode (safetensors writes 0600), a
  failed write raised as the OSError it is (e.g. ENOSPC naming the file: safetensors reports the errno inside the
  text of its own error type)."""
  try:
    save_file(tensors, file, metadata={"format": "pt"})
  except Exception as e:  # noqa: BLE001 (SafetensorError: "... I/O error: No space left on device (os error 28)",
    # older versions "... IoError(Os { code: 28, kind: StorageFull, ...")
    code = re.search(r"Os \{ code: (\d+)|\(os error (\d+)\)", str(e))
    if code is None:
      raise
    number = int(code.group(1) or code.group(2))
    raise OSError(number, os.strerror(number), file) from e
  paths.ordinary_permissions(file)


def save_pretrained(model: CausalLM, out_dir: str, max_shard_size: int | str | None = "5GB", dtype=None,
                    token_ids: dict | None = None) -> None:
  """Writes the weights and config.json of a directory `transformers.AutoModelForCausalLM.from_pretrained` loads
  unchanged; `token_ids` (bos/eos/pad_token_id) go into config.json. `pacs_jax.save_pretrained` adds the
  tokenizer and generation_config.json.

  Tensors are gathered to the host one file at a time (all processes take part in the gathers), and
  only process 0 writes. Files are split at `max_shard_size` with a `model.safetensors.index.json`,
  as transformers does. `dtype` (e.g. jnp.bfloat16) converts on the way out.
  """
  config = model.config
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  plan = _plan_shards(families.tensor_maps(config, flat), flat, dtype, _parse_size(max_shard_size))
  write = jax.process_index() == 0
  if write:
    os.makedirs(out_dir, exist_ok=True)
  weight_map, total = {}, 0
  for i, maps in enumerate(plan):
    tensors = {}
    for m in maps:
      value = flat[m.path].get_value()
      array = _to_host(value if m.layer is None else value[m.layer])  # one layer of a stacked parameter
      array = array.astype(dtype) if dtype is not None else array
      tensors[m.hf_name] = np.ascontiguousarray(to_hf(m.layout, array))
      total += tensors[m.hf_name].nbytes
    fname = SINGLE_FILE if len(plan) == 1 else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
    if write:
      save_safetensors(tensors, os.path.join(out_dir, fname))
    weight_map.update({name: fname for name in tensors})
  if not write:
    return
  if len(plan) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, f, indent=2)
  hf_config = config.to_hf_dict()
  if dtype is not None:
    hf_config["torch_dtype"] = "bfloat16" if np.dtype(dtype) == jnp.bfloat16 else str(np.dtype(dtype))
  hf_config["dtype"] = hf_config["torch_dtype"]
  hf_config.update(token_ids or {})
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
