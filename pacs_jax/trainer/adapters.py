"""A LoRA run's two kinds of parameters (docs/lora.md): the adapters it trains (the TrainState's params, checkpointed
with their optimizer state) and the frozen base weights, an argument of every program, shared by the policy, its
frozen reference (the base without adapters) and PPO's critic (its own adapters and value head on the same backbone).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pacs_jax import sharding
from pacs_jax.models import lora

# The adapters' initialisation keys: cfg.seed plus these (the seed draws a random base, seed + 1 the critic's head).
POLICY_SEED_OFFSET, CRITIC_SEED_OFFSET = 2, 3
# Adapters are trained in fp32 whatever the base's dtype: they are small, and Adam's steps on bf16 would round away.
ADAPTER_DTYPE = jnp.float32


@dataclasses.dataclass(frozen=True)
class Frozen:
  """What the programs of a LoRA run know of its frozen base (no arrays: the trainer and `--compile_only` share it)."""
  spec: lora.LoraSpec
  ref_graphdef: Any  # the policy without adapters, run on the base alone: the frozen reference and the decode model
  shardings: Any  # the base's train-mode shardings, a full tree (the programs' in_shardings)


def critic_trained(path: tuple, value: Any) -> bool:
  """The critic's trained parameters in a LoRA run (an nnx filter): its adapters and everything outside its
  backbone `.model` (the value head)."""
  return isinstance(value, nnx.LoRAParam) or path[0] != "model"


def critic_base(base: nnx.State) -> nnx.State:
  """The critic's frozen part: the policy's base backbone, the same arrays (no copy)."""
  return nnx.State({"model": base["model"]})


def merge(graphdef, params: nnx.State, base: nnx.State | None) -> nnx.Module:
  """The model of `params` (the trained state) and, in a LoRA run, its frozen `base`."""
  return nnx.merge(graphdef, params) if base is None else nnx.merge(graphdef, params, base)


def _with_adapters(make: Callable[..., nnx.Module], spec: lora.LoraSpec, seed: int) -> Callable[..., nnx.Module]:
  def made(*args):
    return lora.add_adapters(make(*args), spec, nnx.Rngs(seed), dtype=ADAPTER_DTYPE)
  return made


def abstract_policy(make_policy: Callable[[], nnx.Module], spec: lora.LoraSpec) -> tuple[Any, nnx.State, nnx.State, Any]:
  """(graphdef, adapters, base, reference graphdef) of the policy `make_policy()` with adapters, all abstract
  (nothing allocated)."""
  policy = nnx.eval_shape(_with_adapters(make_policy, spec, 0))
  graphdef, adapters, base = lora.split(policy)
  ref_graphdef, _ = nnx.split(lora.without_adapters(policy), nnx.Param)
  return graphdef, adapters, base, ref_graphdef


def add_to_policy(policy: nnx.Module, spec: lora.LoraSpec, seed: int, mesh) -> tuple[Any, nnx.State, nnx.State, Any]:
  """(graphdef, adapters, base, reference graphdef) of a loaded policy: the adapters created on device in their
  train-mode shardings (the base enters their init program as an argument: no copy of it)."""
  ref_graphdef, base = nnx.split(policy, nnx.Param)
  make = _with_adapters(lambda base: nnx.merge(ref_graphdef, base), spec, seed + POLICY_SEED_OFFSET)
  graphdef, abstract_adapters, _ = lora.split(nnx.eval_shape(make, base))
  shardings = sharding.state_shardings(abstract_adapters, mesh, "train")
  with jax.set_mesh(mesh):
    adapters = jax.jit(lambda base: lora.split(make(base))[1], out_shardings=shardings)(base)
  return graphdef, adapters, base, ref_graphdef


def critic(make_critic: Callable[[], nnx.Module], spec: lora.LoraSpec, seed: int, mesh=None, base=None
           ) -> tuple[Any, nnx.State]:
  """(graphdef, trained parameters) of a LoRA run's critic (`make_critic()`: the algorithm's, with a fresh backbone):
  only the adapters, the saved norms' copies (from the policy's `base`) and the head are created (on `mesh`, in their
  train-mode shardings; abstract without one); its backbone is the policy's base (`critic_base`)."""
  make = _with_adapters(make_critic, spec, seed + CRITIC_SEED_OFFSET)
  graphdef, abstract, _ = nnx.split(nnx.eval_shape(make), critic_trained, nnx.Param)
  if mesh is None:
    return graphdef, abstract

  def init(base):  # the fresh backbone is no output: the compiler drops its initialisation
    trained = nnx.split(make(), critic_trained, nnx.Param)[1]
    return trained if base is None else lora.with_saved_from(trained, critic_base(base))

  with jax.set_mesh(mesh):
    return graphdef, jax.jit(init, out_shardings=sharding.state_shardings(abstract, mesh, "train"))(base)
