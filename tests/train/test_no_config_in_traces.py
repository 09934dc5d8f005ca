"""No traced function reads the run's ConfigDict (issue 41): an objective is bound once (`Algorithm.bind(cfg)`)
and the step, log-prob, value and step-input programs take that frozen object. Any ConfigDict read while JAX traces
raises here, so lowering each program of the tiny config's objectives fails if one closes over the config."""

import contextlib

import jax
import ml_collections
import pytest
from jax._src import core as jax_core

from pacs_jax import sharding
from pacs_jax.compile import aot
from pacs_jax.trainer import programs as programs_lib
from tests import tiny_config


class ConfigReadInTrace(AssertionError):
  pass


@contextlib.contextmanager
def no_config_in_traces():
  """Makes reading a ConfigDict's field (attribute, item, `get`) raise while JAX traces; reads on the host between
  traces go through."""
  cls = ml_collections.ConfigDict
  originals = {name: cls.__dict__[name] for name in ("__getattr__", "__getitem__")}

  def guarded(name):
    original = originals[name]

    def read(self, key):
      if not jax_core.trace_state_clean():
        raise ConfigReadInTrace(f"ConfigDict.{name}({key!r}) inside a JAX trace")
      return original(self, key)

    return read

  for name in originals:
    setattr(cls, name, guarded(name))
  try:
    yield
  finally:
    for name, original in originals.items():
      setattr(cls, name, original)


def test_the_guard_catches_a_config_read_inside_jit_and_lets_host_reads_through():
  cfg = ml_collections.ConfigDict({"scale": 2.0})
  with no_config_in_traces():
    assert cfg.scale == 2.0 and cfg["scale"] == 2.0 and cfg.get("scale") == 2.0
    with pytest.raises(ConfigReadInTrace):
      jax.jit(lambda x: x * cfg.scale).lower(1.0)
    with pytest.raises(ConfigReadInTrace):
      jax.jit(lambda x: x * cfg.get("scale")).lower(1.0)


@pytest.mark.parametrize("algorithm, overrides", [
    ("pacs", {}),
    ("pacs", {"pacs.reference_policy": "rollout", "pacs.exact_padding_replication": True,
              "rollout.tis_imp_ratio_cap": 2.0}),
    ("grpo", {"grpo.use_kl_loss": True, "grpo.entropy_coeff": 0.01, "rollout.tis_imp_ratio_cap": 2.0}),
    ("ppo", {}),
    ("dapo", {}),
    ("gspo", {}),
])
def test_no_program_reads_the_config_while_tracing(algorithm, overrides):
  cfg = tiny_config.two_steps(algorithm=algorithm, **overrides)
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  state, _, _, progs = aot.abstract_run(cfg, mesh)
  _, base = programs_lib.abstract_base(cfg, mesh)  # the frozen part every program takes: empty in a full run
  batch = programs_lib.minibatch_shapes(cfg, mesh)
  ends_step = programs_lib.ends_step_shape(mesh)
  with jax.set_mesh(mesh), no_config_in_traces():
    progs.train_step.lower(state, batch, ends_step, base)
    progs.logprob_fn.lower(state.params, batch, base)
    progs.ref_logprob_fn.lower(state.params, batch, base)
    if progs.value_fn is not None:
      progs.value_fn.lower(state.critic_params, batch, base)
    if progs.step_inputs is not None:
      progs.step_inputs.lower([batch, batch])
  assert (progs.value_fn is not None) == (algorithm == "ppo")
