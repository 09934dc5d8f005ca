"""Adding a family is one module and one registry line: the family below (Llama's decoder with a GELU MLP), defined
in this file and registered, trains through the Trainer, and its checkpoint exports (config.json naming its
activation) and loads back as that family; config.json parts it lacks are refused naming it."""

import dataclasses
import functools
import json
import os
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import config_shrink
from pacs_jax import config as config_lib
from pacs_jax.models import families as registry, hf, layers
from pacs_jax.models.family import Family
from pacs_jax.models.model_config import ModelConfig
from pacs_jax.storage import hf_export as export
from pacs_jax.trainer import loop
from test_config_json import assert_transformers_activation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- the family: what its own module would hold ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GeluConfig(ModelConfig):
  model_type: ClassVar[str] = "toy_gelu"
  architecture: ClassVar[str] = "ToyGeluForCausalLM"
  hidden_act: str = "gelu_pytorch_tanh"


class GeluMLP(layers.MLP):
  activations = {"gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}  # transformers' name


class GeluLayer(layers.DecoderLayer):
  mlp_cls = GeluMLP


FAMILY = Family(GeluConfig, layer=GeluLayer, presets={
    "toy-gelu-tiny": GeluConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)})

# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def registered():
  registry.register(FAMILY)  # the one registry line (in pacs_jax/models/families.py for a shipped family)
  yield
  del registry.FAMILIES[GeluConfig.model_type]


def test_a_family_defined_here_trains_through_the_trainer_and_exports(registered, tmp_path):
  spec = os.path.join(ROOT, "configs", "tiny_cpu.py")
  overrides, _ = config_shrink.shrink(config_lib.load_config_file(spec))
  overrides.update({"model.preset": "toy-gelu-tiny", "data.val": ""})
  cfg = config_lib.load_config_file(spec, overrides)
  workdir = str(tmp_path / "run")
  trainer = loop.Trainer(cfg, workdir, devices=jax.devices()[:1])
  assert isinstance(nnx.merge(trainer.graphdef, trainer.state.params).model.layers.mlp, GeluMLP)  # its own layer
  trainer.run()
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]
  out = export.export(workdir, str(tmp_path / "hf"))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["hidden_act"] == "gelu_pytorch_tanh"
  model, config = hf.load_pretrained(out)
  assert type(config) is GeluConfig and isinstance(model.model.layers.mlp, GeluMLP)
  trained, _ = export.load_policy(workdir)
  ids = jnp.arange(1, 9)[None]
  np.testing.assert_allclose(model(ids), trained(ids), atol=1e-6)


TINY_JSON = {"model_type": "toy_gelu", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "silu"}, "hidden_act 'silu' is not supported for model_type 'toy_gelu' "
                             r"\(its MLP implements 'gelu_pytorch_tanh'\)"),
    # Mistral's config.json: a window and no use_sliding_window. A new family refuses it without a line of its own.
    ({"sliding_window": 4096}, r"sliding_attention in every layer \(from sliding_window=4096\) is not supported "
                               "for model_type 'toy_gelu'"),
    # Gemma 2 / 3: local and global layers alternate.
    ({"layer_types": ["sliding_attention", "full_attention"]},
     "layers of different kinds .* are not supported for model_type 'toy_gelu'"),
])
def test_a_config_part_the_family_lacks_is_refused_naming_it(registered, change, message):
  with pytest.raises(ValueError, match=message):
    registry.config_from_hf({**TINY_JSON, **change})


def test_its_activation_is_read_by_default_and_no_other_builds(registered):
  assert_transformers_activation(GeluConfig.hidden_act, GeluMLP.activations[GeluConfig.hidden_act])  # a true name
  assert registry.config_from_hf(TINY_JSON) == FAMILY.presets["toy-gelu-tiny"]  # no hidden_act: the family's own
  with pytest.raises(ValueError, match="hidden_act 'silu' is not supported for model_type 'toy_gelu'"):
    registry.causal_lm(FAMILY.presets["toy-gelu-tiny"].replace(hidden_act="silu"), rngs=nnx.Rngs(0))
