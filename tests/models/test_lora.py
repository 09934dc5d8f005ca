"""LoRA adapters (pacs_jax.models.lora) against transformers + peft on tiny random Qwen2.5, Qwen3 and Llama 3 models:
PEFT folders (two with trained norms, peft's modules_to_save) load and give peft's logits, our exported folders load in peft to our logits, the merged export equals
base + adapter in transformers; B = 0 is the base model bitwise; adapter gradients match central differences in
fp64; the spec's refusals."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import families as registry, hf, lora
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import scheduler
from pacs_jax.storage import hf_export as export
from test_families import make_torch_model
from test_qwen2_hf import left_padded_batch, make_hf_model, torch_logits_per_row

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4
# Per family: (LoraConfig's alpha, use_rslora, modules_to_save): rsLoRA's alpha / sqrt(rank) scale on one of them;
# saved parameters on each: the tied embeddings (the LM head too, peft's ensure_weight_tying), every norm (Qwen3's
# q/k norms included: peft matches a name's end), and the final norm, the layers' second norms and an untied LM head.
ADAPTERS = {"qwen2": (8, False, ["embed_tokens"]), "qwen3": (6, False, ["norm"]),
            "llama": (4, True, ["model.norm", "post_attention_layernorm", "lm_head"])}


def torch_base(family: str):
  return make_hf_model() if family == "qwen2" else make_torch_model(family)


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def peft_case(request, tmp_path_factory):
  """(family, base folder, PEFT folder, transformers + peft model): a LoRA on all seven projections whose A and B
  are random and nonzero, and whose saved parameters are random too (norms around 1, embeddings and head perturbed)."""
  family = request.param
  root = tmp_path_factory.mktemp(f"lora_{family}")
  torch_base(family).save_pretrained(root / "base")
  alpha, rslora, saved = ADAPTERS[family]
  model = peft.get_peft_model(torch_base(family), peft.LoraConfig(
      r=RANK, lora_alpha=alpha, use_rslora=rslora, target_modules=HF_TARGETS, modules_to_save=saved,
      ensure_weight_tying="embed_tokens" in saved, task_type="CAUSAL_LM"))
  torch.manual_seed(1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.normal_(0, 0.2)
      elif "modules_to_save" in name and "norm" in name:
        p.normal_(1, 0.2)
      elif "modules_to_save" in name:
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(root / "peft")
  return family, str(root / "base"), str(root / "peft"), model.eval()


def assert_logits_match(model, torch_model, atol, seed=0):
  ids, mask = left_padded_batch(model.config.vocab_size, [9, 4, 7], seed=seed)
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  for b, ref in enumerate(torch_logits_per_row(torch_model, ids, mask)):
    np.testing.assert_allclose(ours[b][mask[b] > 0], ref, atol=atol, rtol=0)


def with_peft_folder(base_dir: str, peft_dir: str):
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
  return peft.PeftModel.from_pretrained(base, peft_dir).eval()


def test_a_peft_folder_gives_transformers_peft_logits(peft_case):
  family, base_dir, peft_dir, torch_model = peft_case
  model, _ = hf.load_pretrained(base_dir)
  spec = lora.from_peft(peft_dir, model)
  alpha, rslora, saved = ADAPTERS[family]
  assert (spec.rank, spec.alpha, spec.use_rslora) == (RANK, alpha, rslora) and set(saved) <= set(spec.modules_to_save)
  assert lora.validate(spec, model.config) == tuple(lora.TARGETS)
  assert_logits_match(model, torch_model, atol=1e-4)
  # The norms peft saves are the ones we save: its modules_to_save wrappers, ours the copies beside the weights.
  wrapped = {re.sub(r"layers\.\d+\.", "layers.", n.split(".modules_to_save.")[0].removeprefix(lora.PEFT_PREFIX))
             for n, _ in torch_model.named_parameters() if ".modules_to_save." in n}
  ours = {".".join(lora.base_path(p)).removesuffix(".weight") for p, _ in nnx.to_flat_state(
      nnx.state(model, nnx.LoRAParam)) if p[-1].startswith("saved_")}
  assert ours == wrapped, (ours, wrapped)
  # The adapters matter: the base model's logits are far from these.
  base, _ = hf.load_pretrained(base_dir)
  ids = jnp.asarray(left_padded_batch(model.config.vocab_size, [9])[0])
  assert float(jnp.abs(model(ids) - base(ids)).max()) > 0.1


def test_exported_adapters_load_in_peft_to_our_logits(peft_case, tmp_path):
  _, base_dir, peft_dir, _ = peft_case
  model, _ = hf.load_pretrained(base_dir)
  spec = lora.from_peft(peft_dir, model)
  # Perturbed, so the export carries JAX-side values rather than a copy of the PEFT folder.
  adapters = nnx.state(model, nnx.LoRAParam)
  nnx.update(model, jax.tree.map(lambda x: x + 0.05 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), adapters))
  export.export_adapter(nnx.state(model, nnx.LoRAParam), spec, model.config, str(tmp_path),
                        base_model_name_or_path=base_dir)
  with open(tmp_path / "adapter_config.json") as f:
    written = json.load(f)
  assert (written["r"], written["lora_alpha"], written["use_rslora"]) == (spec.rank, spec.alpha, spec.use_rslora)
  assert sorted(written["target_modules"]) == sorted(HF_TARGETS)
  assert written["modules_to_save"] == list(spec.modules_to_save)
  assert_logits_match(model, with_peft_folder(base_dir, str(tmp_path)), atol=1e-4, seed=2)


def test_the_merged_export_equals_base_plus_the_peft_folder(peft_case, tmp_path):
  _, base_dir, peft_dir, _ = peft_case
  model, _ = hf.load_pretrained(base_dir)
  spec = lora.from_peft(peft_dir, model)
  merged = lora.merged_model(model, spec)
  assert not nnx.state(merged, nnx.LoRAParam)
  hf.save_pretrained(merged, str(tmp_path))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  ids, mask = left_padded_batch(model.config.vocab_size, [8, 5], seed=3)
  reference = torch_logits_per_row(with_peft_folder(base_dir, peft_dir), ids, mask)
  for ours, ref in zip(torch_logits_per_row(reloaded, ids, mask), reference):
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------
# Our own adapters


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_zero_b_gives_the_base_models_logits_bitwise(dtype):
  config = registry.preset("tiny", param_dtype=dtype, dtype=dtype)
  model = registry.causal_lm(config, rngs=nnx.Rngs(0))
  ids, mask = left_padded_batch(config.vocab_size, [12, 6])
  forward = lambda m: jax.jit(lambda s: nnx.merge(nnx.graphdef(m), s)(ids, mask))(nnx.state(m))
  base_logits = forward(model)
  lora.add_adapters(model, lora.LoraSpec(rank=8, alpha=16), nnx.Rngs(1))
  np.testing.assert_array_equal(np.asarray(forward(model)), np.asarray(base_logits))
  # Initialised as peft: B = 0, A ~ U(±1/sqrt(fan_in)) and not 0.
  for (prefix, target), (a, b) in lora._adapter_pairs(nnx.state(model, nnx.LoRAParam)).items():
    a, b = np.asarray(a.get_value(), np.float32), np.asarray(b.get_value(), np.float32)
    bound = 1 / np.sqrt(np.prod(a.shape[1:-1]))
    assert not b.any() and 0.9 * bound < np.abs(a).max() <= bound, (target, np.abs(a).max(), bound)


def test_adapters_are_laid_out_by_their_logical_axes_on_a_mesh():
  config = registry.preset("tiny")
  spec = lora.LoraSpec(rank=4, alpha=8)
  make = lambda: lora.add_adapters(registry.causal_lm(config, rngs=nnx.Rngs(0)), spec, nnx.Rngs(1))
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  model = sharding.create_sharded(make, mesh)
  placed = lora.add_adapters(registry.causal_lm(config, rngs=nnx.Rngs(0)), spec, nnx.Rngs(1), mesh=mesh)
  for attn in (model.model.layers.self_attn, placed.model.layers.self_attn):  # created sharded; placed afterwards
    assert attn.q_lora_a.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
    assert attn.q_lora_b.get_value().sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert attn.o_lora_a.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None, None)
  graphdef, adapters, base = lora.split(model)
  adapters = jax.tree.map(lambda x: x + 0.1, adapters)
  ids = jnp.asarray(left_padded_batch(config.vocab_size, [8, 8, 5, 8])[0])
  with jax.set_mesh(mesh):
    sharded = jax.jit(lambda a, b: nnx.merge(graphdef, a, b)(ids))(adapters, base)
  single = nnx.merge(graphdef, *jax.device_get((adapters, base)))(ids)
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), atol=1e-5)


def test_sampling_with_unmerged_adapters_equals_sampling_the_merged_model():
  """Prefill and the paged decode step apply the adapters as the training forward does: the same greedy tokens and
  log-probs as the merged model's."""
  spec = lora.LoraSpec(rank=4, alpha=8)
  model = lora.add_adapters(registry.causal_lm(registry.preset("tiny"), rngs=nnx.Rngs(0)), spec, nnx.Rngs(1))
  graphdef, adapters, base = lora.split(model)
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x + 0.3 * jnp.sin(jnp.arange(x.size).reshape(x.shape)),
                                           adapters), base)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 256, size=n).tolist() for n in (3, 8, 6)]
  sampled = []
  for m in (model, lora.merged_model(model, spec)):
    engine = engine_lib.Engine(m, max_concurrent_decodes=4, max_prefill_length=8, max_decode_length=16,
                               steps_per_call=8, min_prefill_bucket=8, page_size=8)
    sampled.append(scheduler.generate(engine, engine.load_params(m), prompts, max_new_tokens=16))  # greedy
  base_tokens = scheduler.generate(engine, engine.load_params(lora.without_adapters(model)), prompts,
                                   max_new_tokens=16)
  assert [c.tokens for c in sampled[0]] == [c.tokens for c in sampled[1]] != [c.tokens for c in base_tokens]
  for unmerged, merged in zip(*sampled):
    np.testing.assert_allclose(unmerged.logprobs, merged.logprobs, atol=1e-5)


def test_adapter_gradients_match_central_differences_in_fp64():
  with jax.enable_x64(True):
    config = registry.preset("tiny", param_dtype=jnp.float64, dtype=jnp.float64)
    model = lora.add_adapters(registry.causal_lm(config, rngs=nnx.Rngs(0)), lora.LoraSpec(rank=4, alpha=8),
                              nnx.Rngs(1))
    graphdef, adapters, base = lora.split(model)
    keys = iter(jax.random.split(jax.random.key(2), 64))
    # B random too: with B = 0 every A gradient is 0.
    adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    ids, mask = left_padded_batch(config.vocab_size, [10, 7])
    weights = jax.random.normal(next(keys), (2, 10, config.vocab_size), jnp.float64)
    loss = jax.jit(lambda a: jnp.sum(nnx.merge(graphdef, a, base)(ids, mask) * weights))
    grads = jax.grad(loss)(adapters)
    flat, flat_grads = dict(nnx.to_flat_state(adapters)), dict(nnx.to_flat_state(grads))
    assert len(flat) == 14  # A and B of seven projections
    h = 1e-6  # truncation error ~h² and rounding ~1e-16 / h both far below 1e-6 (1e-5 left o's A at 5e-7)
    for path, var in flat.items():  # the derivative along a random direction of each adapter
      direction = jax.random.normal(next(keys), var.get_value().shape, jnp.float64)
      shifted = lambda s: nnx.from_flat_state({**flat, path: var.replace(var.get_value() + s * h * direction)})
      numeric = (loss(shifted(1)) - loss(shifted(-1))) / (2 * h)
      analytic = jnp.vdot(flat_grads[path].get_value(), direction)
      assert abs(numeric - analytic) <= 1e-6 * abs(analytic), (path, float(numeric), float(analytic))


@pytest.mark.parametrize("spec, message", [
    (lora.LoraSpec(rank=0, alpha=8), r"^lora\.rank: must be a positive integer, got 0$"),
    (lora.LoraSpec(rank=65, alpha=8, targets=("q",)), r"^lora\.rank: 65 is above the smaller side of the q "),
    (lora.LoraSpec(rank=33, alpha=8, targets=("k",)), r"^lora\.rank: 33 is above the smaller side of the k .*32\]"),
    (lora.LoraSpec(rank=4, alpha=0), r"^lora\.alpha: must be positive"),
    (lora.LoraSpec(rank=4, alpha=8, targets=()), r"^lora\.targets: empty"),
    (lora.LoraSpec(rank=4, alpha=8, targets=("q", "attn")), r"^lora\.targets: 'attn' is neither a projection"),
    (lora.LoraSpec(rank=4, alpha=8, targets=(r".*\.qkv_proj",)), r"^lora\.targets: '.*qkv_proj' is neither"),
    (lora.LoraSpec(rank=4, alpha=8, targets=(r"model\.layers\.0\..*",)), r"^lora\.targets: .* in some layers only"),
    (lora.LoraSpec(rank=4, alpha=8, targets=("(",)), r"^lora\.targets: '\(' is neither .* nor a valid pattern"),
    (lora.LoraSpec(rank=4, alpha=8, modules_to_save=("q_proj",)),
     r"^lora\.modules_to_save: 'q_proj' names model\.layers\.0\.self_attn\.q_proj, which is neither a norm nor"),
    (lora.LoraSpec(rank=4, alpha=8, modules_to_save=("norm", "mlp")),
     r"^lora\.modules_to_save: 'mlp' names model\.layers\.0\.mlp, which is neither a norm nor the embeddings"),
    (lora.LoraSpec(rank=4, alpha=8, modules_to_save=("lm_head",)), r"^lora\.modules_to_save: 'lm_head' names no "),
    (lora.LoraSpec(rank=4, alpha=8, modules_to_save=("ln_f",)), r"^lora\.modules_to_save: 'ln_f' names no module"),
    (lora.LoraSpec(rank=4, alpha=8, modules_to_save=("layers.1.input_layernorm",)),
     r"^lora\.modules_to_save: .* names model\.layers\.1\.input_layernorm in some layers only"),
])
def test_bad_specs_are_one_line_naming_the_field(spec, message):
  config = registry.preset("tiny")  # D 64, 4 heads and 2 kv heads of 16: k and v are [64, 32]
  with pytest.raises(ValueError, match=message):
    lora.validate(spec, config)
  with pytest.raises(ValueError, match=message):
    lora.add_adapters(registry.causal_lm(config, rngs=nnx.Rngs(0)), spec, nnx.Rngs(1))


def test_saved_parameters_train_a_copy_and_leave_the_base_to_the_reference():
  """peft's modules_to_save: a saved norm (or the embeddings, tied to the LM head here) computes with its trained
  copy (initially the base weight: the logits are the base model's bitwise), the base model without adapters with
  the base weight (the frozen reference), and the merged model with the copy in the weight's place."""
  config = registry.preset("tiny")
  names = lambda *entries: {".".join(p) for p in lora.saved_params(lora.LoraSpec(4, 8, modules_to_save=entries), config)}
  assert names("norm") == {"model.norm.weight", "model.layers.input_layernorm.weight",
                           "model.layers.post_attention_layernorm.weight"}
  assert names("model.norm", "input_layernorm") == {"model.norm.weight", "model.layers.input_layernorm.weight"}
  assert names("embed_tokens") == {"model.embed_tokens"}  # tied to the LM head in the tiny preset
  spec = lora.LoraSpec(rank=4, alpha=8, modules_to_save=("norm", "embed_tokens"))
  model = registry.causal_lm(config, rngs=nnx.Rngs(0))
  ids, mask = left_padded_batch(config.vocab_size, [12, 6])
  base_logits = np.asarray(model(ids, mask))
  lora.add_adapters(model, spec, nnx.Rngs(1))
  np.testing.assert_array_equal(np.asarray(model(ids, mask)), base_logits)
  graphdef, adapters, base = lora.split(model)
  flat = dict(nnx.to_flat_state(adapters))
  saved = [p for p in flat if p[-1].startswith("saved_")]
  assert len(saved) == 4 and flat[("model", "layers", "input_layernorm", "saved_weight")].get_value().shape == (2, 64)
  assert flat[("model", "saved_embed_tokens")].get_value().shape == (config.vocab_size, 64)
  flat.update({p: flat[p].replace(flat[p].get_value() * 3.0) for p in saved})  # only the copies change
  model = nnx.merge(graphdef, nnx.from_flat_state(flat), base)
  trained = np.asarray(model(ids, mask))
  assert np.abs(trained - base_logits).max() > 1.0
  np.testing.assert_array_equal(np.asarray(lora.without_adapters(model)(ids, mask)), base_logits)
  np.testing.assert_allclose(np.asarray(lora.merged_model(model, spec)(ids, mask)), trained, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(model.model.norm.weight[...]), 1.0)  # the base weights, untouched
  np.testing.assert_array_equal(np.asarray(model.model.embed_tokens[...]), np.asarray(base["model"]["embed_tokens"][...]))


def test_targets_by_name_and_by_pattern():
  config = registry.preset("tiny")
  assert lora.validate(lora.LoraSpec(4, 8, ("v_proj", "q")), config) == ("q", "v")
  assert lora.validate(lora.LoraSpec(4, 8, r".*\.(gate|up)_proj"), config) == ("gate", "up")
  assert lora.validate(lora.LoraSpec(4, 8, (r".*self_attn\..*", "down")), config) == ("q", "k", "v", "o", "down")


@pytest.mark.parametrize("field, value", [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                                          ("layers_to_transform", [0]), ("rank_pattern", {"q_proj": 8})])
def test_a_peft_folder_with_more_than_a_plain_lora_is_refused_naming_the_field(field, value, tmp_path):
  config = dict(lora.adapter_config(lora.LoraSpec(4, 8), ["q_proj"], None), **{field: value})
  (tmp_path / "adapter_config.json").write_text(json.dumps(config))
  model = registry.causal_lm(registry.preset("tiny"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=rf"adapter_config\.json: {field}=.* is not supported"):
    lora.from_peft(str(tmp_path), model)
