"""A new objective with its own advantage estimator is one file (issue 41): this module registers an estimator (a
baseline at the group's median reward) and an objective using it (GRPO's clipped-ratio loss on those advantages),
then trains the tiny config 2 steps with it, touching no other module."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.algos import advantages, algorithms as registry, grpo
from pacs_jax.trainer import loop
from pacs_jax.services.metrics import METRICS_FILE, read_rows
from tests import tiny_config

ESTIMATOR, OBJECTIVE = "group_median", "median_grpo"
traced = []


def group_median(values: jax.Array, group_size: int) -> jax.Array:
  """A_i = x_i − median_j x_j over i's group; [B] -> [B]."""
  traced.append(values.shape)
  groups = values.reshape(-1, group_size)  # [U, n]
  return (groups - jnp.median(groups, axis=-1, keepdims=True)).reshape(-1)


class MedianGrpo(grpo.Grpo):
  """GRPO's loss with advantages against the group's median reward."""

  def advantage_estimator(self, settings):
    return ESTIMATOR


@pytest.fixture
def registered():
  advantages.register(ESTIMATOR)(group_median)
  registry.register(OBJECTIVE, MedianGrpo())
  yield
  registry._REGISTRY.pop(OBJECTIVE)  # other tests' configs must not carry its block
  advantages._ESTIMATORS.pop(ESTIMATOR)


def test_the_estimator_is_found_by_name_and_computes_the_median_baseline(registered):
  values = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
  np.testing.assert_allclose(advantages.get(ESTIMATOR)(values, 4), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, -1.0])


def test_a_new_objective_with_its_own_estimator_trains_two_steps(registered, tmp_path):
  cfg = tiny_config.two_steps(algorithm=OBJECTIVE)
  config_lib.validate(cfg, 1)
  assert registry.bind(cfg).advantage_estimator == ESTIMATOR
  traced.clear()
  loop.train(cfg, str(tmp_path), devices=jax.devices()[:1])
  rows = read_rows(os.path.join(tmp_path, METRICS_FILE))
  assert [row["step"] for row in rows] == [1, 2]
  assert traced, "the objective's loss never called its estimator"
  assert all(np.isfinite(row["actor/advantage_mean"]) and np.isfinite(row["loss"]) for row in rows)
