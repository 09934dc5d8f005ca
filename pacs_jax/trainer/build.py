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
from pacs_jax.algos import algorithms
from pacs_jax.data import synthetic_tasks, tokenizers
from pacs_jax.models import decoder, hf
from pacs_jax.models import families
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import programs as programs_lib


def load_tokenizer(cfg: ml_collections.ConfigDict):
  name = cfg.tokenizer or cfg.model.hf_path
  if not name or name == "synthetic":
    return synthetic_tasks.build_tokenizer()
  return tokenizers.load_tokenizer(hf.resolve_path(name))


def build_policy(cfg: ml_collections.ConfigDict, mesh) -> decoder.CausalLM:
  """The initial policy in its train-mode shardings: a HF checkpoint, or a seeded random init."""
  mc = config_lib.model_config(cfg)
  if cfg.model.hf_path:
    model, _ = hf.load_pretrained(cfg.model.hf_path, dtype=mc.param_dtype, mesh=mesh, compute_dtype=mc.dtype,
                                  remat=mc.remat, attention_chunk=mc.attention_chunk,
                                  attention_impl=mc.attention_impl, remat_policy=mc.remat_policy)
    return model
  return sharding.create_sharded(lambda: families.causal_lm(mc, rngs=nnx.Rngs(cfg.seed)), mesh, "train")


def build_critic(cfg: ml_collections.ConfigDict, policy: decoder.CausalLM, mesh) -> nnx.Module:
  """The algorithm's critic: its backbone (`.model`) starts from the policy's weights (as verl initialises
  PPO's), its head fresh."""
  make = lambda: algorithms.of(cfg).make_critic(policy.config, nnx.Rngs(cfg.seed + 1))
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
  base: nnx.State | None = None  # a LoRA run's frozen base weights
  frozen: adapters_lib.Frozen | None = None  # and what its programs know of them


def run_params(cfg: ml_collections.ConfigDict, policy: decoder.CausalLM, mesh) -> RunParams:
  """The parameters of a run starting from `policy` (built by `build_policy`): a full run trains all of them (and
  keeps a copy as its frozen reference); a LoRA run adds adapters and trains those (and a critic's own adapters and
  head), the base staying frozen: its reference is the base itself, without adapters."""
  algo, spec = algorithms.of(cfg), config_lib.lora_spec(cfg)
  needs_ref = programs_lib.needs_frozen_ref(cfg)
  if spec is None:
    graphdef, params = nnx.split(policy, nnx.Param)
    critic_graphdef = critic_params = None
    if algo.has_critic:
      with jax.set_mesh(mesh):
        critic_graphdef, critic_params = nnx.split(build_critic(cfg, policy, mesh), nnx.Param)
    # The frozen reference: a copy of the initial weights, same shardings, no optimizer state.
    return RunParams(graphdef, params, nnx.merge(graphdef, params), critic_graphdef, critic_params,
                     ref_params=jax.tree.map(jnp.copy, params) if needs_ref else None)
  graphdef, adapters, base, ref_graphdef = adapters_lib.add_to_policy(policy, spec, cfg.seed, mesh)
  critic_graphdef = critic_params = None
  if algo.has_critic:
    make = lambda: algo.make_critic(policy.config, nnx.Rngs(cfg.seed + 1))  # the head as a full run's
    critic_graphdef, critic_params = adapters_lib.critic(make, spec, cfg.seed, mesh, base)
  return RunParams(graphdef, adapters, nnx.merge(ref_graphdef, base), critic_graphdef, critic_params,
                   ref_params=base if needs_ref else None, base=base,
                   frozen=programs_lib.frozen_base(cfg, ref_graphdef, base, mesh))
