"""The losses' masked sums and means: padding values (inf, NaN) neither leak into them nor give NaN gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from pacs_jax.algos import masked


def test_masked_sum_and_mean_ignore_padding_values():
  values = jnp.array([[1.0, 2.0, jnp.inf], [4.0, jnp.nan, 100.0]])
  mask = jnp.array([[1, 1, 0], [1, 0, 0]])
  np.testing.assert_allclose(masked.masked_sum(values, mask, axis=-1), [3.0, 4.0])
  np.testing.assert_allclose(masked.masked_mean(values, mask, axis=-1), [1.5, 4.0])
  np.testing.assert_allclose(masked.masked_mean(values, mask), 7.0 / 3.0)
  assert float(masked.masked_mean(values, jnp.zeros_like(mask))) == 0.0
  grad = jax.grad(lambda v: masked.masked_mean(v, mask))(values)
  third = np.float32(1) / np.float32(3)
  np.testing.assert_array_equal(grad, [[third, third, 0], [third, 0, 0]])
