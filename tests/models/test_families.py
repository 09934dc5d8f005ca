"""Qwen3 and Llama 3 against transformers: tiny random models built and saved by transformers' own classes load
and match its logits (left padding), export back, sample on the paged KV cache as the uncached forward does, train
2 steps through `python -m pacs_jax.train`; the published full-size configs check by shape and parameter count (the
LM and PPO's critic on the family's backbone)."""

import json
import math
import os
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import config_shrink
from pacs_jax import config as config_lib
from pacs_jax.algos import ppo
from pacs_jax.models import decoder, families as registry, hf
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import scheduler
from pacs_jax.storage import hf_export as export_lib
from test_qwen2_hf import left_padded_batch, torch_logits_per_row
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 96  # at most twice the synthetic tokenizer's 64 ids: the trainer pairs them
TINY = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
# Each family's own parts switched on: Qwen3's head dim 16 != 48 / 4 and tied head; Llama 3's RoPE scaling with
# an original context of 64, so the wavelengths of a 12-wide head fall in all three bands (kept, interpolated,
# stretched), and an untied head.
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=16, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10_000.0})),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=False, rope_parameters={
                  "rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


def make_torch_model(family: str):
  config_cls, model_cls, own = FAMILIES[family]
  torch.manual_seed(0)
  model = model_cls(config_cls(**TINY, **own)).eval()
  with torch.no_grad():  # norm weights away from 1, so a misplaced norm (or q/k norm) shows
    for name, p in model.named_parameters():
      if "norm" in name:
        p.normal_(1, 0.2)
  return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_dir(request, tmp_path_factory):
  model = make_torch_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  return request.param, str(path), model


@pytest.fixture(scope="module")
def loaded(hf_dir):
  return hf.load_pretrained(hf_dir[1])[0]


def test_logits_match_transformers_left_padded(hf_dir, loaded):
  family, _, torch_model = hf_dir
  assert loaded.config.model_type == family
  ids, mask = left_padded_batch(VOCAB, [40, 5, 23])
  logits = np.asarray(loaded(jnp.asarray(ids), jnp.asarray(mask)))
  for b, ref in enumerate(torch_logits_per_row(torch_model, ids, mask)):
    np.testing.assert_allclose(logits[b][mask[b] > 0], ref, atol=1e-4, rtol=0)


def test_export_round_trip_through_transformers(hf_dir, loaded, tmp_path):
  family, _, torch_model = hf_dir
  # Perturbed, so the export carries JAX-side values rather than a copy of the source files.
  model = nnx.clone(loaded)
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), state))
  hf.save_pretrained(model, str(tmp_path))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert type(reloaded) is type(torch_model)
  assert hf.load_config(str(tmp_path)) == model.config
  ids, mask = left_padded_batch(VOCAB, [9, 30], seed=1)
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  for b, ref in enumerate(torch_logits_per_row(reloaded, ids, mask)):
    np.testing.assert_allclose(ours[b][mask[b] > 0], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", jnp.bfloat16, np.float32])
def test_the_public_api_loads_a_folder_without_a_tokenizer_in_any_dtype_spelling(hf_dir, dtype, caplog):
  import pacs_jax
  _, path, _ = hf_dir  # written by transformers' save_pretrained: weights and config.json, no tokenizer
  model, tokenizer = pacs_jax.load_pretrained(path, dtype=dtype)
  assert tokenizer is None and "no tokenizer files" in caplog.text
  assert model.config.param_dtype == np.dtype(dtype)
  assert np.isfinite(np.asarray(model(jnp.ones((1, 3), jnp.int32)), np.float32)).all()


def test_paged_cache_decode_equals_the_uncached_forward_and_transformers(hf_dir, loaded):
  _, _, torch_model = hf_dir
  engine = engine_lib.Engine(loaded, max_concurrent_decodes=4, max_prefill_length=8, max_decode_length=24,
                             steps_per_call=8, min_prefill_bucket=8, page_size=8)  # paged: the default cache
  params = engine.load_params(loaded)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, VOCAB, size=n).tolist() for n in (3, 8, 6)]
  completions = scheduler.generate(engine, params, prompts, max_new_tokens=24)  # greedy
  sequences = [p + c.tokens for p, c in zip(prompts, completions)]
  width = max(map(len, sequences))
  ids, mask = np.zeros((len(sequences), width), np.int32), np.zeros((len(sequences), width), np.int32)
  for i, seq in enumerate(sequences):  # left-padded
    ids[i, width - len(seq):], mask[i, width - len(seq):] = seq, 1
  full = nnx.merge(engine.graphdef, params)(jnp.asarray(ids), jnp.asarray(mask))  # [B, T, V], no cache
  for r, c in enumerate(completions):
    rows = full[r, -len(c.tokens) - 1:-1]  # the logits that chose each response token
    assert c.tokens == np.argmax(rows, axis=-1).tolist()
    np.testing.assert_allclose(c.logprobs, jax.nn.log_softmax(rows)[np.arange(len(c.tokens)), c.tokens], atol=1e-4)
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([prompts[r]]), do_sample=False, max_new_tokens=24, eos_token_id=None,
                                 pad_token_id=0)
    assert c.tokens == out[0, len(prompts[r]):].tolist()


def test_trains_two_steps_through_the_command_line(hf_dir, tmp_path):
  family, path, _ = hf_dir
  spec = os.path.join(ROOT, "configs", "tiny_cpu.py")
  overrides, devices = config_shrink.shrink(config_lib.load_config_file(spec))
  overrides.update({"model.hf_path": path, "model.preset": "", "data.val": ""})  # the model dir; no validation
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "pacs_jax.train", "--config", spec, "--workdir", str(workdir)]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_env.xla_flags(devices),
             PACS_JAX_COMPILATION_CACHE=os.environ.get("PACS_JAX_TEST_CACHE", os.path.join(ROOT, ".jax_cache")))
  result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
  assert f"{path}: {family} (2 layers" in result.stdout + result.stderr  # the banner names the family
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl") if line.strip()]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["skipped_updates"] == 0 for r in rows)
  with open(workdir / "model" / "config.json") as f:  # the model card export reads: the family's own config
    assert hf.load_config(path) == registry.config_from_hf(json.load(f))
  # The export keeps the source's special-token ids (the synthetic tokenizer has no BOS; Llama's config.json has 1)
  # and ordinary permissions: a serving process of another user reads it.
  out = tmp_path / "exported"
  export_lib.export(str(workdir), str(out))
  with open(os.path.join(path, "config.json")) as f:
    source = json.load(f)
  with open(out / "config.json") as f:
    exported = json.load(f)
  for field in ("bos_token_id", "eos_token_id"):
    if source.get(field) is not None:
      assert exported[field] == source[field], (field, exported[field], source[field])
  mask = os.umask(0o022)
  os.umask(mask)
  assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~mask
  for name in os.listdir(out):
    assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o666 & ~mask, name


# ----------------------------------------------------------------------------------------------
# Full size, by shape alone: the published config.json of each model (the fields that set its shapes).

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_theta=1_000_000, rope_scaling=None, attention_bias=False, use_sliding_window=False,
              hidden_act="silu")
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
               rope_theta=500_000.0, attention_bias=False, mlp_bias=False, hidden_act="silu")
_LLAMA32_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}
PUBLISHED = {  # name: (config.json, parameters as published)
    "Qwen3-1.7B": (dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, tie_word_embeddings=True), 1.7e9),
    "Qwen3-4B": (dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, tie_word_embeddings=True), 4.0e9),
    "Qwen3-8B": (dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, tie_word_embeddings=False), 8.2e9),
    "Llama-3.2-1B": (dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                          rope_scaling=_LLAMA32_ROPE), 1.23e9),
    "Llama-3.2-3B": (dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, head_dim=128,
                          num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
                          rope_scaling=_LLAMA32_ROPE), 3.21e9),
    "Llama-3.1-8B": (dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                          rope_scaling={**_LLAMA32_ROPE, "factor": 8.0}), 8.03e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_size_shapes_and_parameter_counts(name):
  hf_config, published = PUBLISHED[name]
  config = registry.config_from_hf(hf_config, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  abstract = nnx.eval_shape(lambda: registry.causal_lm(config, rngs=nnx.Rngs(0)))
  count = decoder.count_params(abstract)
  assert abs(count / published - 1) < 0.03, (count, published)
  with torch.device("meta"):  # transformers' own model of the same config.json, allocating nothing
    ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
  assert count == sum(p.numel() for p in ref.parameters())
  graphdef, state = nnx.split(abstract)
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  logits = jax.eval_shape(lambda s, ids: nnx.merge(graphdef, s)(ids, jnp.ones_like(ids)), state, tokens)
  assert logits.shape == (2, 16, hf_config["vocab_size"]) and logits.dtype == jnp.bfloat16
  # PPO's critic: the same family's backbone under a value head.
  critic = nnx.eval_shape(lambda: ppo.Critic(config, rngs=nnx.Rngs(0)))
  backbone_structure = lambda m: jax.tree.structure(nnx.state(m, nnx.Param))
  assert backbone_structure(critic.model) == backbone_structure(abstract.model)  # q/k norms and all
  assert decoder.count_params(critic) == decoder.count_params(abstract.model) + config.hidden_size + 1
  graphdef, state = nnx.split(critic)
  values = jax.eval_shape(lambda s, ids: nnx.merge(graphdef, s)(ids, jnp.ones_like(ids)), state, tokens)
  assert values.shape == (2, 16) and values.dtype == jnp.float32


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3' needs"),
    ({"sliding_window": 4096}, r"sliding_attention in every layer \(from sliding_window=4096\) is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported for model_type 'llama'"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_a_config_part_the_model_lacks_is_one_line_naming_the_file(change, message, tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({**PUBLISHED["Llama-3.2-1B"][0], **change}, f)
  with pytest.raises(config_lib.ConfigError, match=rf"^config\.model\.hf_path: .*config\.json: {message}"):
    config_lib.model_config(config_lib.load_config_file(os.path.join(ROOT, "configs", "own_model.py"),
                                                        {"model.hf_path": str(tmp_path)}))
