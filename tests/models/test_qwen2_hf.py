"""The NNX Qwen2 against transformers' PyTorch Qwen2: import, export, presets, bad checkpoints."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from pacs_jax.models import decoder, families as registry, hf, qwen2

# (tie_word_embeddings, heads, kv heads, rope theta): tied/untied, GQA with 2 and 3 query heads per
# kv head, non-default rope theta.
VARIANTS = {
    "tied_gqa2": dict(tie=True, heads=4, kv=2, theta=12_345.0),
    "untied_gqa3": dict(tie=False, heads=6, kv=2, theta=1_000_000.0),
}


def make_hf_model(tie=True, heads=4, kv=2, theta=10_000.0, vocab=97, hidden=48, layers=2, seed=0):
  torch.manual_seed(seed)
  cfg = transformers.Qwen2Config(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=80, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256, rms_norm_eps=1e-5,
      tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": theta})
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  with torch.no_grad():  # random biases so the q/k/v bias mapping is actually exercised
    for layer in model.model.layers:
      for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        proj.bias.normal_(0, 0.5)
      layer.input_layernorm.weight.normal_(1, 0.2)
  return model


def left_padded_batch(vocab, lengths, seed=0):
  rng = np.random.default_rng(seed)
  T = max(lengths)
  ids = np.zeros((len(lengths), T), np.int32)
  mask = np.zeros((len(lengths), T), np.int32)
  for b, n in enumerate(lengths):
    ids[b, T - n:] = rng.integers(1, vocab, n)
    mask[b, T - n:] = 1
  return ids, mask


def torch_logits_per_row(model, ids, mask):
  """transformers logits of each row's real tokens, run unpadded one row at a time."""
  out = []
  with torch.no_grad():
    for row, m in zip(ids, mask):
      real = torch.tensor(row[m > 0][None].astype(np.int64))
      out.append(model(real).logits[0].numpy())
  return out


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_dir(request, tmp_path_factory):
  model = make_hf_model(**VARIANTS[request.param])
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  return str(path), model


def test_load_pretrained_matches_transformers_left_padded(hf_dir):
  path, torch_model = hf_dir
  model, config = hf.load_pretrained(path)
  assert config.tie_word_embeddings == torch_model.config.tie_word_embeddings
  assert config.rope_theta == torch_model.config.rope_parameters["rope_theta"]
  ids, mask = left_padded_batch(config.vocab_size, [11, 5, 8])
  logits = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  assert logits.shape == (3, 11, config.vocab_size)
  for b, ref in enumerate(torch_logits_per_row(torch_model, ids, mask)):
    np.testing.assert_allclose(logits[b][mask[b] > 0], ref, atol=1e-4, rtol=0)


def test_padded_row_equals_unpadded_sequence():
  model = registry.causal_lm(registry.preset("tiny"), rngs=nnx.Rngs(3))
  ids, mask = left_padded_batch(256, [9, 4])
  padded = model(jnp.asarray(ids), jnp.asarray(mask))
  alone = model(jnp.asarray(ids[1:, 5:]))
  np.testing.assert_allclose(np.asarray(padded[1, 5:]), np.asarray(alone[0]), atol=1e-5)


def _roundtrip(model, out_dir, **kw):
  hf.save_pretrained(model, out_dir, **kw)
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out_dir).eval()
  ids, mask = left_padded_batch(model.config.vocab_size, [7, 3], seed=1)
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  for b, ref in enumerate(torch_logits_per_row(reloaded, ids, mask)):
    np.testing.assert_allclose(ours[b][mask[b] > 0], ref, atol=1e-5, rtol=0)
  return reloaded


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_pretrained_roundtrip_through_transformers(variant, tmp_path):
  model, _ = hf.load_pretrained(_saved(variant, tmp_path / "src"))
  # Perturb so the export carries JAX-side values, not a copy of the source files.
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), state))
  _roundtrip(model, str(tmp_path / "out"), max_shard_size=None)
  assert os.path.isfile(tmp_path / "out" / "model.safetensors")


def _saved(variant, path, **save_kw):
  make_hf_model(**VARIANTS[variant]).save_pretrained(path, **save_kw)
  return str(path)


def test_sharded_checkpoint_with_index_both_ways(tmp_path):
  torch_model = make_hf_model(**VARIANTS["untied_gqa3"])
  torch_model.save_pretrained(tmp_path / "src", max_shard_size="40KB")
  assert os.path.isfile(tmp_path / "src" / "model.safetensors.index.json")
  model, config = hf.load_pretrained(str(tmp_path / "src"))
  ids, mask = left_padded_batch(config.vocab_size, [6, 9])
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  for b, ref in enumerate(torch_logits_per_row(torch_model, ids, mask)):
    np.testing.assert_allclose(ours[b][mask[b] > 0], ref, atol=1e-4, rtol=0)
  # Our writer splits too, with an index transformers follows.
  _roundtrip(model, str(tmp_path / "out"), max_shard_size=40_000)
  with open(tmp_path / "out" / "model.safetensors.index.json") as f:
    files = set(json.load(f)["weight_map"].values())
  assert len(files) > 2


def test_bf16_checkpoint_loads(tmp_path):
  torch_model = make_hf_model(**VARIANTS["tied_gqa2"]).to(torch.bfloat16)
  torch_model.save_pretrained(tmp_path)
  model, _ = hf.load_pretrained(str(tmp_path), dtype=jnp.bfloat16)
  q = model.model.layers.self_attn.q_kernel[0]  # layer 0 of the stacked layers
  assert q.dtype == jnp.bfloat16
  ref = torch_model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(q, np.float32).reshape(q.shape[0], -1).T, ref)


# ----------------------------------------------------------------------------------------------
# Presets: exact parameter counts (transformers reports these on the meta device for the same configs).

PRESET_COUNTS = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
                 "qwen2.5-3b": 3_085_938_688, "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PRESET_COUNTS))
def test_presets_abstract_param_counts(name):
  config = registry.preset(name)
  abstract = nnx.eval_shape(lambda: registry.causal_lm(config, rngs=nnx.Rngs(0)))
  assert decoder.count_params(abstract) == PRESET_COUNTS[name]
  # The same config through transformers, on the meta device (no memory).
  with torch.device("meta"):
    ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config.to_hf_dict()))
  assert sum(p.numel() for p in ref.parameters()) == PRESET_COUNTS[name]


def test_config_roundtrip_through_transformers_config():
  config = registry.preset("qwen2.5-7b")
  back = qwen2.Qwen2Config.from_hf_dict(transformers.Qwen2Config(**config.to_hf_dict()).to_dict())
  assert back == config


# ----------------------------------------------------------------------------------------------
# Bad input names the file and the tensor.


def test_missing_config(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"config\.json"):
    hf.load_pretrained(str(tmp_path))


def test_unsupported_model_type(tmp_path):
  path = _saved("tied_gqa2", tmp_path)
  cfg = json.load(open(tmp_path / "config.json"))
  cfg["model_type"] = "gemma"
  json.dump(cfg, open(tmp_path / "config.json", "w"))
  with pytest.raises(ValueError, match=r"config\.json.*unsupported model_type 'gemma'"):
    hf.load_pretrained(path)


def test_wrong_shape_tensor(tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _saved("tied_gqa2", tmp_path)
  f = str(tmp_path / "model.safetensors")
  tensors = load_file(f)
  tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
  save_file(tensors, f, metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"model\.safetensors.*'model\.layers\.1\.mlp\.up_proj\.weight' has shape"):
    hf.load_pretrained(path)


def test_missing_tensor(tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _saved("untied_gqa3", tmp_path)
  f = str(tmp_path / "model.safetensors")
  tensors = load_file(f)
  del tensors["lm_head.weight"]
  save_file(tensors, f, metadata={"format": "pt"})
  # Refused before any tensor is read, naming the tensor and the family (issue 34: a model folder is read strictly).
  with pytest.raises(hf.WeightsMismatch, match=r"tensor 'lm_head\.weight' is missing from the weights, and "
                     r"model_type 'qwen2' needs it"):
    hf.load_pretrained(path)


def test_hub_id_is_downloaded_once_then_loaded(tmp_path, monkeypatch):
  import huggingface_hub
  path = _saved("tied_gqa2", tmp_path / "snapshot")
  calls = []

  def fake_snapshot_download(repo_id, allow_patterns=None):
    calls.append(repo_id)
    assert "*.safetensors" in allow_patterns and "*.json" in allow_patterns
    return path

  monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
  model, config = hf.load_pretrained("Qwen/Qwen2.5-0.5B")
  assert calls == ["Qwen/Qwen2.5-0.5B"]
  assert config.num_attention_heads == 4
