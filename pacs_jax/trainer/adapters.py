"""What a run trains and what it keeps frozen, on one path for full and LoRA runs (docs/lora.md): the trained part,
chosen by an nnx filter (every parameter; a LoRA run's adapters), is the TrainState's params, checkpointed with their
optimizer state; the frozen part, an argument of every program, is empty in a full run and a LoRA run's base
weights, shared by the policy, its frozen reference (the base without adapters) and PPO's critic (its own adapters
and value head on the same backbone).
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


# A full run's frozen part: no leaves, so a program that takes it has the parameters it had without it.
NO_BASE = nnx.State({})


@dataclasses.dataclass(frozen=True)
class Frozen:
  """What a run's programs know of its frozen part (no arrays: the trainer and `--compile_only` share it)."""
  spec: lora.LoraSpec | None  # None: a full run (nothing frozen)
  ref_graphdef: Any  # the policy without adapters (a full run's own graph): the frozen reference and the decode model
  shardings: Any  # the frozen part's train-mode shardings, a full tree (the programs' in_shardings; empty: full run)


def trained(spec: lora.LoraSpec | None):
  """The nnx filter of the policy's trained parameters: every parameter of a full run (its frozen part is then
  empty), a LoRA run's `nnx.LoRAParam`s (the adapters and the saved copies)."""
  return nnx.Param if spec is None else nnx.LoRAParam


def critic_trained_filter(spec: lora.LoraSpec | None):
  """The nnx filter of the critic's trained parameters: every one in a full run, else `critic_trained`."""
  return nnx.Param if spec is None else critic_trained


def critic_trained(path: tuple, value: Any) -> bool:
  """The critic's trained parameters in a LoRA run (an nnx filter): its adapters and everything outside its
  backbone `.model` (the value head)."""
  return isinstance(value, nnx.LoRAParam) or path[0] != "model"


def critic_base(base: nnx.State) -> nnx.State:
  """The critic's frozen part: the policy's frozen backbone, the same arrays (no copy); empty in a full run."""
  return nnx.State({name: part for name, part in base.items() if name == "model"})


def merge(graphdef, params: nnx.State, base: nnx.State = NO_BASE) -> nnx.Module:
  """The model of `params` (the trained part) on its frozen `base` (empty in a full run: adds nothing)."""
  return nnx.merge(graphdef, params, base)


def _with_adapters(make: Callable[..., nnx.Module], spec: lora.LoraSpec | None, seed: int
                   ) -> Callable[..., nnx.Module]:
  """`make` with adapters added to what it makes (a LoRA run's), or `make` itself (a full run's)."""
  if spec is None:
    return make

  def made(*args):
    return lora.add_adapters(make(*args), spec, nnx.Rngs(seed), dtype=ADAPTER_DTYPE)
  return made


def abstract_policy(make_policy: Callable[[], nnx.Module], spec: lora.LoraSpec | None
                    ) -> tuple[Any, nnx.State, nnx.State, Any]:
  """(graphdef, trained part, frozen part, reference graphdef) of the policy `make_policy()` (with adapters in a LoRA
  run), all abstract (nothing allocated)."""
  policy = nnx.eval_shape(_with_adapters(make_policy, spec, 0))
  graphdef, params, base = nnx.split(policy, trained(spec), nnx.Param)
  ref_graphdef, _ = nnx.split(lora.without_adapters(policy), nnx.Param)
  return graphdef, params, base, ref_graphdef


def add_to_policy(policy: nnx.Module, spec: lora.LoraSpec | None, seed: int, mesh
                  ) -> tuple[Any, nnx.State, nnx.State, Any]:
  """(graphdef, trained part, frozen part, reference graphdef) of a loaded policy. A full run trains its weights
  themselves (no copy; nothing frozen); a LoRA run's adapters are created on device in their train-mode shardings
  (the base enters their init program as an argument: no copy of it)."""
  ref_graphdef, weights = nnx.split(policy, nnx.Param)
  if spec is None:
    return ref_graphdef, weights, NO_BASE, ref_graphdef
  make = _with_adapters(lambda base: nnx.merge(ref_graphdef, base), spec, seed + POLICY_SEED_OFFSET)
  graphdef, abstract_adapters, _ = nnx.split(nnx.eval_shape(make, weights), trained(spec), nnx.Param)
  shardings = sharding.state_shardings(abstract_adapters, mesh, "train")
  with jax.set_mesh(mesh):
    adapters = jax.jit(lambda base: nnx.split(make(base), trained(spec), nnx.Param)[1],
                       out_shardings=shardings)(weights)
  return graphdef, adapters, weights, ref_graphdef


def critic(make_critic: Callable[[], nnx.Module], spec: lora.LoraSpec | None, seed: int, mesh=None,
           base: nnx.State = NO_BASE) -> tuple[Any, nnx.State]:
  """(graphdef, trained parameters) of a LoRA run's critic (`make_critic()`: the algorithm's, with a fresh backbone):
  only the adapters, the saved norms' copies (from the policy's `base`) and the head are created (on `mesh`, in their
  train-mode shardings; abstract without one); its backbone is the policy's base (`critic_base`). A full run's
  critic (`spec` None) is abstract here; the trainer builds it with the policy's weights (`build.build_critic`)."""
  make = _with_adapters(make_critic, spec, seed + CRITIC_SEED_OFFSET)
  graphdef, abstract, _ = nnx.split(nnx.eval_shape(make), critic_trained_filter(spec), nnx.Param)
  if mesh is None:
    return graphdef, abstract

  def init(base):  # the fresh backbone is no output: the compiler drops its initialisation
    return lora.with_saved_from(nnx.split(make(), critic_trained, nnx.Param)[1], critic_base(base))

  with jax.set_mesh(mesh):
    return graphdef, jax.jit(init, out_shardings=sharding.state_shardings(abstract, mesh, "train"))(base)
