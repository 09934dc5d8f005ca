"""The decode state's per-field shardings (and prefill's KV cache's): declared by name, and what init, prefill,
insert and decode really return."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Spec

from pacs_jax import sharding
from pacs_jax.models import families as registry
from pacs_jax.rollout import engine as engine_lib
from pacs_jax.rollout import sampling, scheduler
from pacs_jax.rollout.single import SingleRequest
from pacs_jax.rollout import decode_state as state_lib
from pacs_jax.rollout.decode_state import DecodeState, field_shardings

BATCH = ("data", "fsdp")
DECLARED = {"tokens": Spec(BATCH), "keys": Spec(BATCH, None), "lengths": Spec(BATCH), "steps": Spec(BATCH),
            "budgets": Spec(BATCH), "active": Spec(BATCH)}
# pages [layers, A, page_size, 2 kv_heads, head_dim] and each shard's tables and free pages beside its slots.
PAGED = {"pages": Spec(None, BATCH, None, "tensor", None), "page_table": Spec(BATCH, None),
         "free_pages": Spec(BATCH, None), "free_count": Spec(BATCH)}
# Prefill's KV cache [layers, prompts, kv_heads, rows, head_dim]: prompts over the batch axes, kv heads over tensor.
PREFILL = {"k": Spec(None, BATCH, "tensor", None, None), "v": Spec(None, BATCH, "tensor", None, None)}


def _check_fields(fields, mesh) -> None:
  for name, x, want, spec in fields:
    assert want.spec == spec, (name, want.spec)
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (name, x.sharding)
    assert not x.sharding.is_fully_replicated, name


def _check(state: DecodeState, mesh) -> None:
  declared = field_shardings(state, mesh)
  fields = [(name, getattr(state, name), getattr(declared, name), spec) for name, spec in DECLARED.items()]
  fields += [(name, getattr(state.cache, name), getattr(declared.cache, name), spec) for name, spec in PAGED.items()]
  _check_fields(fields, mesh)


@pytest.fixture(scope="module")
def setup():
  assert jax.device_count() == 8
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  config = registry.preset("tiny")  # 2 kv heads: one per tensor shard
  model = registry.causal_lm(config, rngs=nnx.Rngs(0))
  engine = engine_lib.Engine(model, max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=8,
                             steps_per_call=4, mesh=mesh, eos_ids=[1], page_size=4)
  return mesh, engine, engine.load_params(model)


def test_prefill_cache_carries_its_declared_shardings(setup):
  mesh, engine, params = setup
  tokens = np.zeros((4, 16), np.int32)
  tokens[:, :5] = np.arange(1, 6)
  cache, logits = engine.prefill_batch(params, tokens, np.full(4, 5, np.int32))
  declared = state_lib.cache_shardings(cache, mesh)
  _check_fields([(name, getattr(cache, name), getattr(declared, name), spec) for name, spec in PREFILL.items()], mesh)
  assert logits.shape == (4, engine.config.vocab_size)


def test_decode_state_carries_its_declared_shardings(setup):
  mesh, engine, params = setup
  state = engine.init_decode_state()
  _check(state, mesh)
  abstract = engine.abstract_decode_state()
  for x, y in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim)

  prompts = [np.arange(1, n + 1).tolist() for n in (3, 9)]
  state, _ = scheduler.prefill_insert(engine, params, state, prompts, [0, 1], [0, 2], [0, 1], [0, 0], [8, 8], 0,
                                      sampling.Greedy(), ())
  _check(state, mesh)
  state, out = engine.decode(params, state, 5, sampling.Greedy(), ())
  assert np.asarray(out.emitted)[[0, 2]].all()  # the call decoded
  _check(state, mesh)
  state, _ = SingleRequest(engine).step(params, state)
  _check(state, mesh)
  # JetStream's prefix destination (the `jetstream` extra): the same declarations for one prompt (a batch of 1 is
  # not split).
  jetstream = pytest.importorskip("pacs_jax.rollout.jetstream")
  prefix = jetstream.JetStreamEngine(engine).get_prefix_destination_sharding()
  assert prefix.cache.k.spec == Spec(None, None, "tensor", None, None) and prefix.keys.spec == Spec(None, None)
