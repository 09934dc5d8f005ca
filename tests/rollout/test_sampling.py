"""Sampling methods: chi-square against the intended distributions, exclusions, log-probs, hashability."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pacs_jax.models import chunked_logprobs as trainer_logprobs
from pacs_jax.rollout import sampling

PROBS = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
LOGITS = np.log(PROBS) + 1.7  # an offset: only differences of logits matter
DRAWS = 20_000


@functools.partial(jax.jit, static_argnums=(0, 2))
def _draw(method, seed, per_row_keys):
  logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (DRAWS, 1))
  key = jax.random.key(seed)
  return method.sample_with_logprobs(logits, jax.random.split(key, DRAWS) if per_row_keys else key)


def draw(method, seed=0, per_row_keys=True):
  """DRAWS samples from LOGITS, with one key per row as the engine uses (or one key for all rows)."""
  tokens, logprobs = _draw(method, seed, per_row_keys)
  return np.asarray(tokens), np.asarray(logprobs)


def tempered(temperature):
  p = PROBS ** (1.0 / temperature)
  return p / p.sum()


def assert_matches(tokens, expected, support):
  """Chi-square goodness of fit on the support; tokens outside it must never appear."""
  counts = np.bincount(tokens, minlength=len(PROBS))
  outside = np.setdiff1d(np.arange(len(PROBS)), support)
  assert counts[outside].sum() == 0, f"excluded tokens sampled: {counts}"
  target = expected[support] / expected[support].sum()
  result = stats.chisquare(counts[support], target * DRAWS)
  assert result.pvalue > 1e-3, (counts, target * DRAWS, result)


@pytest.mark.parametrize("temperature,per_row_keys", [(1.0, True), (0.6, True), (1.5, False)])
def test_temperature_distribution(temperature, per_row_keys):
  tokens, _ = draw(sampling.Temperature(temperature), per_row_keys=per_row_keys)
  assert_matches(tokens, tempered(temperature), np.arange(len(PROBS)))


@pytest.mark.parametrize("k,temperature", [(1, 1.0), (3, 1.0), (4, 0.7)])
def test_top_k_distribution(k, temperature):
  tokens, _ = draw(sampling.TopK(k=k, temperature=temperature))
  support = np.argsort(-PROBS)[:k]
  if k == 1:
    assert (tokens == support[0]).all()
  else:
    assert_matches(tokens, tempered(temperature), support)


@pytest.mark.parametrize("p,temperature,support_size", [
    (0.7, 1.0, 3),  # mass before each token: 0, .35, .60 (< .7 kept), .75 (dropped)
    (0.35, 1.0, 1),  # the most likely token alone already reaches p
    (0.9, 2.0, 5),  # p applies to the tempered distribution
])
def test_top_p_distribution(p, temperature, support_size):
  tokens, _ = draw(sampling.TopP(p=p, temperature=temperature))
  q = tempered(temperature)
  order = np.argsort(-q)
  mass_before = np.cumsum(q[order]) - q[order]
  support = order[mass_before < p]
  assert len(support) == support_size
  if support_size == 1:
    assert (tokens == support[0]).all()
  else:
    assert_matches(tokens, q, support)


def test_top_p_one_equals_temperature():
  a, _ = draw(sampling.TopP(p=1.0, temperature=0.8), seed=3)
  b, _ = draw(sampling.Temperature(0.8), seed=3)
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", [sampling.Greedy(), sampling.Temperature(0.7), sampling.TopK(3, 0.7),
                                    sampling.TopP(0.8, 1.3)])
def test_logprobs_are_of_the_untruncated_tempered_distribution(method):
  logits = jax.random.normal(jax.random.key(1), (16, 50)) * 3
  tokens, logprobs = jax.jit(method.sample_with_logprobs)(logits, jax.random.split(jax.random.key(2), 16))
  expected = jax.nn.log_softmax(logits / method.temperature)[jnp.arange(16), tokens]
  np.testing.assert_allclose(logprobs, expected, atol=1e-6)
  assert logprobs.dtype == jnp.float32 and tokens.dtype == jnp.int32


def test_logprobs_equal_the_trainers_recomputation():
  """The sampler and the trainer compute a token's log-prob by the same ops: equal to the last bit."""
  method = sampling.Temperature(0.7)
  logits = jax.random.normal(jax.random.key(3), (16, 50)) * 8
  tokens, logprobs = jax.jit(method.sample_with_logprobs)(logits, jax.random.split(jax.random.key(4), 16))
  trainer = jax.jit(trainer_logprobs.token_logprobs, static_argnums=2)(logits[:, None], tokens[:, None], 0.7)
  np.testing.assert_array_equal(logprobs, trainer[:, 0])


def test_greedy_is_argmax_at_temperature_one():
  logits = jax.random.normal(jax.random.key(0), (8, 30))
  tokens, logprobs = sampling.Greedy().sample_with_logprobs(logits, jax.random.key(5))
  np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))
  np.testing.assert_allclose(logprobs, jnp.max(jax.nn.log_softmax(logits), -1), atol=1e-6)


def test_per_row_keys_make_rows_independent_of_the_batch():
  """A row's draw depends only on its own logits and key (what makes slots order-independent)."""
  sample = jax.jit(sampling.TopP(0.9, 1.0).sample)
  logits = jax.random.normal(jax.random.key(0), (6, 40))
  keys = jax.random.split(jax.random.key(1), 6)
  batch = sample(logits, keys)
  alone = [int(sample(logits[i:i + 1], keys[i:i + 1])[0]) for i in range(6)]
  assert batch.tolist() == alone
  shuffled = sample(logits[::-1], keys[::-1])
  assert shuffled.tolist() == batch.tolist()[::-1]


def test_methods_are_hashable_jit_static_arguments():
  assert sampling.TopK(3, 0.5) == sampling.TopK(3, 0.5)
  assert hash(sampling.TopP(0.9)) == hash(sampling.TopP(0.9))
  assert len({sampling.Greedy(), sampling.Greedy(), sampling.Temperature(1.0)}) == 2
  f = jax.jit(lambda logits, key, method: method.sample(logits, key), static_argnums=2)
  assert f(jnp.zeros((2, 4)), jax.random.key(0), sampling.Greedy()).shape == (2,)


def test_from_config_and_validation():
  assert sampling.from_config(0.0) == sampling.Greedy()
  assert sampling.from_config(1.0) == sampling.Temperature(1.0)
  assert sampling.from_config(0.6, top_p=0.95) == sampling.TopP(0.95, 0.6)
  assert sampling.from_config(0.6, top_k=20) == sampling.TopK(20, 0.6)
  with pytest.raises(ValueError):
    sampling.from_config(1.0, top_k=5, top_p=0.9)
  with pytest.raises(ValueError):
    sampling.Temperature(0.0)
  with pytest.raises(ValueError):
    sampling.TopP(0.0)
  with pytest.raises(ValueError):
    sampling.TopK(0)


def sorted_nucleus(scaled, p):
  """The reference top-p support: a stable sort by descending logit, tokens kept while the mass before them
  (summed in float64) is < p. Returns (keep, mass_before) in vocabulary order."""
  order = np.argsort(-scaled, axis=-1, kind="stable")
  probs = np.asarray(jax.nn.softmax(jnp.asarray(np.take_along_axis(scaled, order, -1)), axis=-1), np.float64)
  mass_before = np.zeros_like(probs)
  np.put_along_axis(mass_before, order, np.cumsum(probs, -1) - probs, -1)
  return mass_before < p, mass_before


# float32 sums of ~150,000 probabilities (the sort's cumsum as much as the bisection's masked sums) are good to
# about 1e-7: a token whose float64 mass-before is that close to p may fall either side.
ROUND_OFF = 1e-6


def nucleus_cases():
  rng = np.random.default_rng(0)
  V = 151_936
  for scale in (0.02, 1.0, 4.0, 30.0):  # near uniform (most of the vocabulary kept) to one token
    yield f"normal*{scale}", (rng.normal(size=(4, V)) * scale).astype(np.float32)
  # bf16 logits, as the model gives them: hundreds of tokens share each value, so the cut falls inside ties.
  yield "bf16", rng.normal(size=(4, V)).astype(jnp.bfloat16).astype(np.float32)
  yield "few values", rng.integers(0, 5, size=(4, 1000)).astype(np.float32)
  yield "all equal", np.zeros((2, 1000), np.float32)
  yield "one masked vocab", np.where(np.arange(1000) % 3 == 0, -np.inf, rng.normal(size=(3, 1000))).astype(np.float32)
  yield "signed zeros", np.array([[0.0, -0.0, 0.0, -0.0, -1.0, 1.0]], np.float32)


def test_top_p_at_exact_masses():
  """Masses that are exact in binary: a token whose mass before is exactly p is dropped, one below kept (z
  favours one token: it is drawn iff it is in the nucleus, else token 0, the first)."""
  logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125]], np.float32))
  for p, kept in ((0.5, 1), (0.5000001, 2), (0.75, 2), (0.875, 3), (0.8751, 4), (1 - 1e-7, 4)):
    drawn = [int(sampling.nucleus_argmax(jnp.asarray(logits), jnp.asarray(np.eye(4, dtype=np.float32)[k][None]), p)[0])
             for k in range(4)]
    assert drawn == [k if k < kept else 0 for k in range(4)], (p, drawn)
    assert sorted_nucleus(logits, p)[0].sum() == kept


@pytest.mark.parametrize("p", [1e-6, 0.5, 0.95, 0.999])
def test_top_p_draw_is_the_gumbel_argmax_over_the_sorted_nucleus(p):
  """For the same Gumbel noise the draw is the argmax over the sort's support: Gumbel-max restricted to the
  nucleus, so the draws follow the nucleus distribution renormalised (a token within round-off of the cut aside)."""
  for name, scaled in nucleus_cases():
    z = scaled + np.asarray(jax.random.gumbel(jax.random.key(len(name)), scaled.shape))
    got = np.asarray(jax.jit(sampling.nucleus_argmax, static_argnums=2)(jnp.asarray(scaled), jnp.asarray(z), p))
    keep, mass_before = sorted_nucleus(scaled, p)
    want = np.argmax(np.where(keep, z, -np.inf), -1)
    for row in np.flatnonzero(got != want):  # only where the support itself is at round-off's mercy
      assert abs(mass_before[row, got[row]] - p) < ROUND_OFF or abs(mass_before[row, want[row]] - p) < ROUND_OFF, \
          (name, p, row)
    assert (got != want).sum() <= 1, (name, p, got, want)
