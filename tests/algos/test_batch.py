"""`BatchLayout` names every mini-batch field once: which fields each algorithm's runs have, their abstract shapes,
and the host rows it packs (checked against the table)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as registry, batch as batch_lib

K, M, P, R = 2, 4, 5, 3
SHARED = ["input_ids", "attention_mask", "loss_mask", "rewards"]


def layout(algorithm, **overrides):
  cfg = config_lib.default_config()
  cfg.algorithm = algorithm
  cfg.data.max_prompt_length, cfg.rollout.max_new_tokens = P, R
  for field, value in overrides.items():
    section, name = field.split("__")
    cfg[section][name] = value
  return batch_lib.BatchLayout.of(cfg, registry.of(cfg).batch_fields(cfg), K, M)


@pytest.mark.parametrize("algorithm, overrides, passes, extra", [
    ("pacs", {"pacs__reference_policy": "frozen"}, ["ref_logprobs"], []),
    ("pacs", {"pacs__reference_policy": "rollout"}, ["old_logprobs", "ref_logprobs"], []),
    ("pacs", {"pacs__reference_policy": "rollout", "pacs__exact_padding_replication": True},
     ["old_logprobs", "ref_logprobs"], ["logprob_targets", "proxy_mask"]),
    ("grpo", {}, ["old_logprobs"], []),
    ("grpo", {"grpo__use_kl_loss": True}, ["old_logprobs", "ref_logprobs"], []),
    ("ppo", {}, ["old_logprobs", "old_values"], ["advantages", "returns"]),
])
def test_each_algorithm_has_the_shared_fields_its_passes_and_its_own(algorithm, overrides, passes, extra):
  b = layout(algorithm, **overrides)
  assert list(b.names(batch_lib.HOST))[:4] == SHARED
  assert list(b.names(batch_lib.PASS)) == passes
  assert sorted(b.names()) == sorted(SHARED + passes + extra)


def test_abstract_shapes_follow_the_per_row_axes():
  b = layout("pacs", pacs__exact_padding_replication=True)
  shapes = b.abstract(lambda ndim: jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  want = {"input_ids": ((K, M, P + R), jnp.int32), "attention_mask": ((K, M, P + R), jnp.int32),
          "loss_mask": ((K, M, R), jnp.float32), "rewards": ((K, M), jnp.float32),
          "ref_logprobs": ((K, M, R), jnp.float32), "logprob_targets": ((K, M, R), jnp.int32),
          "proxy_mask": ((K, M, R), jnp.float32)}
  assert {name: (s.shape, s.dtype) for name, s in shapes.items()} == want


def test_host_rows_are_the_tables_fields_in_their_dtypes():
  b = layout("grpo")
  rows = 8
  arrays = {"input_ids": np.ones((rows, P + R), np.int64), "attention_mask": np.ones((rows, P + R), np.int32),
            "loss_mask": np.ones((rows, R), np.float32), "rewards": np.zeros(rows, np.float64),
            "unused": np.zeros(rows)}
  out = b.host_rows(arrays)
  assert list(out) == SHARED
  assert out["input_ids"].dtype == np.int32 and out["rewards"].dtype == np.float32
  with pytest.raises(ValueError, match="'loss_mask' is missing"):
    b.host_rows({k: v for k, v in arrays.items() if k != "loss_mask"})
  with pytest.raises(ValueError, match=r"'loss_mask': rows of shape \(4,\), expected \(3,\)"):
    b.host_rows(dict(arrays, loss_mask=np.ones((rows, R + 1), np.float32)))


def test_a_field_is_named_once_and_declared_in_the_tables_terms():
  class Shadowing(registry.Algorithm):
    def extra_fields(self, cfg):
      return (batch_lib.per_response("rewards", jnp.float32, batch_lib.STEP),)

  cfg = config_lib.default_config()
  with pytest.raises(ValueError, match="named twice"):
    batch_lib.BatchLayout.of(cfg, Shadowing().batch_fields(cfg), K, M)
  with pytest.raises(ValueError, match="source one of"):
    batch_lib.Field("x", jnp.float32, ("R",), "elsewhere")
  with pytest.raises(ValueError, match="axes of"):
    batch_lib.Field("x", jnp.float32, ("V",), batch_lib.HOST)
