"""hidden_act and the attention pattern are family properties, read from config.json as transformers reads them:
each activation a family's MLP implements is transformers' function of that name, and each layer's attention kind
is the one transformers derives from the same config.json (only full attention in every layer loads)."""

import numpy as np
import pytest
import torch
import transformers
from transformers.activations import ACT2FN

from pacs_jax.models import families as registry

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# Qwen/Qwen2.5-0.5B's config.json as published: a window it does not use (use_sliding_window: false).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 151936}


def assert_transformers_activation(name: str, fn) -> None:
  """`fn` is transformers' `hidden_act` `name` (ACT2FN) in fp32, over the range a gate's values take (`layers.silu`
  takes its sigmoid through tanh: 1.1e-6 off at the most negative gates, where the sigmoid is 6e-6)."""
  x = np.linspace(-12, 12, 4801, dtype=np.float32)
  np.testing.assert_allclose(np.asarray(fn(x)), ACT2FN[name](torch.tensor(x)).numpy(), rtol=1e-6, atol=2e-6,
                             err_msg=name)


@pytest.mark.parametrize("model_type", sorted(registry.FAMILIES))
def test_every_activation_a_family_implements_is_transformers_own(model_type):
  family = registry.get(model_type)
  assert family.config.hidden_act in family.layer.mlp_cls.activations  # its presets' (and config.json's default)
  for name, fn in family.layer.mlp_cls.activations.items():
    assert_transformers_activation(name, fn)


@pytest.mark.parametrize("model_type", sorted(registry.FAMILIES))
def test_hidden_act_is_written_as_read(model_type):
  config = registry.config_from_hf({"model_type": model_type, **TINY})
  assert config.to_hf_dict()["hidden_act"] == config.hidden_act
  with pytest.raises(ValueError, match=rf"^hidden_act 'relu' is not supported for model_type '{model_type}'"):
    registry.config_from_hf({"model_type": model_type, **TINY, "hidden_act": "relu"})


def test_a_published_qwen25_config_with_an_unused_window_loads():
  assert registry.config_from_hf(QWEN25_05B) == registry.preset("qwen2.5-0.5b")


QWEN_WINDOWS = {  # name: the window fields of a config.json (2 layers)
    "none": {},
    "unused": {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24},
    "from_layer_2": {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2},  # no layer slides
    "no_size": {"use_sliding_window": True, "sliding_window": None},
    "default_size": {"use_sliding_window": True, "max_window_layers": 0},  # 4096, every layer
    "from_layer_1": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    "layer_types": {"layer_types": ["sliding_attention", "full_attention"]},
    "layer_types_full": {"layer_types": ["full_attention", "full_attention"]},
}


@pytest.mark.parametrize("window", sorted(QWEN_WINDOWS))
@pytest.mark.parametrize("model_type, config_cls", [("qwen2", transformers.Qwen2Config),
                                                    ("qwen3", transformers.Qwen3Config)])
def test_qwen_attention_pattern_is_transformers_own(model_type, config_cls, window):
  reference = config_cls(**TINY, **QWEN_WINDOWS[window])
  family = registry.get(model_type)
  # As written by hand, and as transformers 5 writes it (with its derived layer_types).
  for cfg in ({"model_type": model_type, **TINY, **QWEN_WINDOWS[window]}, reference.to_dict()):
    assert list(family.config.attention_pattern(cfg)) == reference.layer_types
    if set(reference.layer_types) == {"full_attention"}:
      registry.config_from_hf(cfg)
    else:
      with pytest.raises(ValueError, match=rf" (is|are) not supported for model_type '{model_type}'"):
        registry.config_from_hf(cfg)


@pytest.mark.parametrize("window, message", [
    ({"sliding_window": 4096}, r"^sliding_attention in every layer \(from sliding_window=4096\) is not supported "
                               "for model_type 'llama'"),
    ({"use_sliding_window": True}, r"^sliding_attention in every layer \(from use_sliding_window=true\)"),
    ({"layer_types": ["sliding_attention", "full_attention"]},
     r"^layers of different kinds \(1 sliding_attention, 1 full_attention, from layer_types\) are not supported for "
     "model_type 'llama': its layer stack runs one layer body for every layer"),
])
def test_a_window_in_a_family_without_one_is_refused(window, message):
  """Llama (and any family that keeps the shared reader) reads a window as Mistral does: every layer slides."""
  registry.config_from_hf({"model_type": "llama", **TINY, "sliding_window": None})
  with pytest.raises(ValueError, match=message):
    registry.config_from_hf({"model_type": "llama", **TINY, **window})
