"""The run's pieces built from its config: the tokenizer, the initial policy (a HF checkpoint or a seeded random
init, through the model registry) and the algorithm's critic, in their train-mode shardings; and how a run's
parameters split into what it trains and what stays frozen (`run_params`)."""

from __future__ import annotations

import dataclasses
from typing import Any

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
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import programs as programs_lib


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


@dataclasses.dataclass(frozen=True)
class RunParams:
  """A run's parameters as its programs take them."""
  graphdef: Any  # the policy's
  params: nnx.State  # what it trains: every policy parameter, or a LoRA run's adapters
  decode_model: nnx.Module  # the model the rollout engine is built on (a LoRA run's: the base, no adapters)
  critic_graphdef: Any = None
  critic_params: nnx.State | None = None
  ref_params: nnx.State | None = None  # the frozen reference's: a copy of the initial weights, or a LoRA run's base
  base: nnx.State = dataclasses.field(default_factory=lambda: adapters_lib.NO_BASE)  # frozen: LoRA's base, or empty
  frozen: adapters_lib.Frozen | None = None  # and what its programs know of it


def run_params(cfg: ml_collections.ConfigDict, policy: decoder.CausalLM, mesh) -> RunParams:
  """The parameters of a run starting from `policy` (built by `build_policy`), split by the run's filter
  (`adapters.trained`) into what it trains and its frozen part: a full run trains all of them (nothing frozen) and
  keeps a copy as its frozen reference; a LoRA run adds adapters and trains those (and a critic's own adapters and
  head), the base staying frozen: its reference is the base itself, without adapters. The rollout is built on
  `policy`, which has no adapters."""
  algo, spec = registry.of(cfg), config_lib.lora_spec(cfg)
  graphdef, params, base, ref_graphdef = adapters_lib.add_to_policy(policy, spec, cfg.seed, mesh)
  critic_graphdef = critic_params = None
  if algo.has_critic:
    critic_graphdef, critic_params = _critic(cfg, policy, spec, base, mesh)
  ref_params = None
  if programs_lib.needs_frozen_ref(cfg):  # the weights without adapters: a LoRA run's base, a full run's own copy
    ref_params = jax.tree.map(jnp.copy, params) if spec is None else base
  return RunParams(graphdef, params, policy, critic_graphdef, critic_params, ref_params=ref_params, base=base,
                   frozen=programs_lib.frozen_base(cfg, ref_graphdef, base, mesh))


def _critic(cfg: ml_collections.ConfigDict, policy: decoder.CausalLM, spec, base: nnx.State, mesh):
  """(graphdef, trained params) of the critic: a full run's whole critic, its backbone a copy of the policy's
  weights (as verl initialises PPO's); a LoRA run's adapters and head, on the policy's frozen base."""
  if spec is None:
    with jax.set_mesh(mesh):
      return nnx.split(build_critic(cfg, policy, mesh), nnx.Param)
  make = lambda: registry.of(cfg).make_critic(policy.config, nnx.Rngs(cfg.seed + 1))  # the head as a full run's
  return adapters_lib.critic(make, spec, cfg.seed, mesh, base)
