"""The run's pieces built from its config: the tokenizer, the prompt pipeline, the validation set, the initial policy
(a HF checkpoint or a seeded random init, through models/families.py) and the algorithm's critic, in their
train-mode shardings; and how a run's parameters split into what it trains and what stays frozen (`run_params`)."""

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
from pacs_jax.data import pipeline as pipeline_lib
from pacs_jax.data import prompts as prompts_lib
from pacs_jax.data import sources, synthetic_tasks, tokenizers
from pacs_jax.models import decoder, hf
from pacs_jax.models import families
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import programs as programs_lib


def load_tokenizer(cfg: ml_collections.ConfigDict):
  name = cfg.tokenizer or cfg.model.hf_path
  if not name or name == "synthetic":
    return synthetic_tasks.build_tokenizer()
  if name == "synthetic_tools":  # the tool task's: the same 64 ids and the words of a tool call
    return synthetic_tasks.build_tokenizer(synthetic_tasks.TOOL_VOCAB)
  return tokenizers.load_tokenizer(hf.resolve_path(name))


def prompt_pipeline(cfg: ml_collections.ConfigDict, tokenizer, records: list[dict],
                    instruction: str | None) -> pipeline_lib.PromptPipeline:
  """The training prompts' pipeline (this process's share of each batch); a ConfigError if too few prompts fit."""
  P = cfg.data.max_prompt_length
  try:
    return pipeline_lib.PromptPipeline(records, tokenizer, batch_size=cfg.train.batch_prompts, seed=cfg.seed,
                                       max_prompt_length=P, instruction=instruction,
                                       process_index=jax.process_index(), process_count=jax.process_count())
  except pipeline_lib.TooFewPrompts as e:
    raise config_lib.ConfigError(f"config.data.max_prompt_length={P}, config.train.batch_prompts="
                                 f"{cfg.train.batch_prompts}: {e} (data.train={cfg.data.train!r})") from e


def validation_set(cfg: ml_collections.ConfigDict, tokenizer, instruction: str | None,
                   max_prompt_length: int) -> tuple[list[dict], list[list[int]]]:
  """The run's validation records and their prompts' ids (none without `eval_every`): `data.val`, or the released
  runs' five sets (`data.val_dir`), at most `data.val_max_examples`; prompts over `max_prompt_length` are dropped
  like training ones."""
  spec = ",".join(sources.released_eval_files(cfg.data.val_dir)) if cfg.data.val_dir else cfg.data.val
  if not (spec and cfg.eval_every):
    return [], []
  records, _ = sources.load_split(spec, cfg.data.skip_bad_rows, cfg.data.synthetic_val_size, cfg.seed + 12345,
                                  held_out=True)
  if cfg.data.val_max_examples:
    records = records[:cfg.data.val_max_examples]
  ids = prompts_lib.encode_prompts(tokenizer, [r["problem"] for r in records], instruction)
  keep = [i for i, prompt in enumerate(ids) if len(prompt) <= max_prompt_length]
  return [records[i] for i in keep], [ids[i].tolist() for i in keep]


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
  base: nnx.State = dataclasses.field(default_factory=lambda: adapters_lib.NO_BASE)  # frozen: LoRA's base, or empty
  frozen: adapters_lib.Frozen | None = None  # and what its programs know of it


def run_params(cfg: ml_collections.ConfigDict, policy: decoder.CausalLM, mesh) -> RunParams:
  """The parameters of a run starting from `policy` (built by `build_policy`), split by the run's filter
  (`adapters.trained`) into what it trains and its frozen part: a full run trains all of them (nothing frozen) and
  keeps a copy as its frozen reference; a LoRA run adds adapters and trains those (and a critic's own adapters and
  head), the base staying frozen: its reference is the base itself, without adapters. The rollout is built on
  `policy`, which has no adapters."""
  algo, spec = algorithms.of(cfg), config_lib.lora_spec(cfg)
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
  make = lambda: algorithms.of(cfg).make_critic(policy.config, nnx.Rngs(cfg.seed + 1))  # the head as a full run's
  return adapters_lib.critic(make, spec, cfg.seed, mesh, base)
