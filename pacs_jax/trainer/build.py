"""The run's pieces built from its config: the tokenizer, the initial policy (a HF checkpoint or a seeded random
init, through the model registry) and the algorithm's critic, in their train-mode shardings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.algos import registry
from pacs_jax.data import synthetic, tokenizers
from pacs_jax.models import decoder, hf
from pacs_jax.models import registry as model_registry


def load_tokenizer(cfg: ml_collections.ConfigDict):
  name = cfg.tokenizer or cfg.model.hf_path
  if not name or name == "synthetic":
    return synthetic.build_tokenizer()
  return tokenizers.load_tokenizer(hf.resolve_path(name))


def build_policy(cfg: ml_collections.ConfigDict, mesh) -> decoder.CausalLM:
  """The initial policy in its train-mode shardings: a HF checkpoint, or a seeded random init."""
  mc = config_lib.model_config(cfg)
  if cfg.model.hf_path:
    model, _ = hf.load_pretrained(cfg.model.hf_path, dtype=mc.param_dtype, mesh=mesh, compute_dtype=mc.dtype,
                                  remat=mc.remat, attention_chunk=mc.attention_chunk,
                                  attention_impl=mc.attention_impl, remat_policy=mc.remat_policy)
    return model
  return sharding.create_sharded(lambda: model_registry.causal_lm(mc, rngs=nnx.Rngs(cfg.seed)), mesh, "train")


def build_critic(cfg: ml_collections.ConfigDict, policy: decoder.CausalLM, mesh) -> nnx.Module:
  """The algorithm's critic: its backbone (`.model`) starts from the policy's weights (as verl initialises
  PPO's), its head fresh."""
  make = lambda: registry.of(cfg).make_critic(policy.config, nnx.Rngs(cfg.seed + 1))
  critic = sharding.create_sharded(make, mesh, "train")
  backbone = jax.tree.map(jnp.copy, nnx.state(policy.model, nnx.Param))
  nnx.update(critic.model, backbone)
  return critic
