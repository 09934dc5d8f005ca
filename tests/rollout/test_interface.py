"""The rollout interface (issue 33): `LocalRollout` is an `interface.Rollout`; it samples exactly what the engine's
scheduler samples with the same weights, stamps each completion with the policy version it was given, and refuses
to sample without weights."""

import numpy as np
import pytest
from flax import nnx

from pacs_jax.models import families as registry
from pacs_jax.rollout import interface, local, sampling, scheduler

PROMPTS = [[5, 9, 3], [7, 1, 8, 2, 6, 4, 11, 12, 13], [3, 3]]


@pytest.fixture(scope="module")
def model():
  return registry.causal_lm(registry.preset("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sampler(model):
  return local.LocalRollout(model, slots=4, max_prompt_length=16, max_new_tokens=12, eos_ids=(1, 2), page_size=8)


def test_the_in_process_engine_implements_the_interface(sampler):
  assert isinstance(sampler, interface.Rollout)
  assert isinstance(sampler.ahead_of_time(), interface.AheadOfTime)


def test_generate_is_the_schedulers_sampling_stamped_with_the_version(model, sampler):
  engine = sampler.ahead_of_time()
  expected = scheduler.generate(engine, engine.load_params(model), PROMPTS, n=2, max_new_tokens=12,
                                sampling=sampling.Temperature(1.0), seed=4, eos_ids=(1, 2))
  sampler.set_weights(nnx.state(model), version=7)
  got = sampler.generate(PROMPTS, n=2, max_new_tokens=12, sampling=sampling.Temperature(1.0), seed=4)
  assert [(c.prompt_index, c.sample_index) for c in got] == [(c.prompt_index, c.sample_index) for c in expected]
  for a, b in zip(expected, got):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_array_equal(b.logprobs, a.logprobs)  # bitwise: the same programs on the same weights
  assert {c.policy_version for c in got} == {7}
  sampler.set_weights(model, version=8)  # a module works too; the next responses carry the new version
  assert {c.policy_version for c in sampler.generate(PROMPTS[:1], max_new_tokens=3)} == {8}


def test_generate_without_weights_is_refused(model, sampler):
  sampler.set_weights(model, version=0)
  sampler.release()
  with pytest.raises(RuntimeError, match="before set_weights"):
    sampler.generate(PROMPTS)
