"""The loss mask (issue 41): a response position the rollout inserted (`Completion.loss_mask` 0, so `loss_mask` 0 in
the batch while the attention mask keeps it) gets exactly zero gradient in every objective, with and without the
rollout correction, and the log-probs at such a position (the policy's, π_old's, the reference's, the behaviour
policy's) do not move the loss; the model's own positions still get a gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.algos import batch as batch_lib
from pacs_jax.algos import algorithms as registry

N, GROUPS, P, R = 4, 2, 3, 6
ROWS = N * GROUPS
# The per-response log-prob inputs of a loss: a value at an inserted position must not reach it.
LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "behaviour_logprobs")

CASES = [("pacs", {}), ("pacs", {"pacs.reference_policy": "rollout"}), ("pacs", {"pacs.reward_method": "2"}),
         ("pacs", {"pacs.exact_padding_replication": True, "train.verl_micro_batch_rows": ROWS}),
         ("grpo", {"grpo.use_kl_loss": True, "grpo.kl_coef": 0.1, "grpo.entropy_coeff": 0.01}), ("ppo", {}),
         ("dapo", {}), ("drgrpo", {}), ("gspo", {})]
CORRECTED = [(name, {**o, "rollout.tis_imp_ratio_cap": 2.0, "rollout.tis_level": level})
             for name, o, level in [("pacs", {}, "sequence"), ("grpo", {}, "token"), ("grpo", {}, "sequence"),
                                    ("ppo", {}, "token")]]


def config(name, overrides):
  cfg = config_lib.default_config()
  cfg.algorithm = name
  cfg.rollout.n = N
  cfg.rollout.max_new_tokens = R
  cfg.data.max_prompt_length = P
  cfg.update_from_flattened_dict(overrides)
  return cfg


def micro_batch(cfg, seed=0):
  """One micro-batch of every field the objective's run has: responses of 3..R tokens (their extent in the
  attention mask), each with one inserted position (loss mask 0) inside it, half of each group rewarded."""
  algo = registry.of(cfg)
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, R + 1, ROWS)
  extent = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)  # [ROWS, R]
  inserted = np.zeros((ROWS, R), np.float32)
  inserted[np.arange(ROWS), rng.integers(1, lengths - 1)] = 1.0  # never the last token (the reward's, in PPO)
  input_ids = rng.integers(4, 60, (ROWS, P + R)).astype(np.int32)
  attention = np.concatenate([np.ones((ROWS, P), np.int32), extent.astype(np.int32)], axis=1)
  arrays = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": extent - inserted,
            "rewards": np.tile([1.0, 0.0], ROWS // 2).astype(np.float32)}
  arrays.update(algo.bind(cfg).host_inputs(input_ids, attention, R))
  layout = batch_lib.BatchLayout.of(cfg, algo.batch_fields(cfg), 1, ROWS)
  for field in layout.fields:
    if field.name not in arrays and field.source != batch_lib.STEP:
      arrays[field.name] = rng.uniform(-2.0, -0.1, (ROWS,) + layout.row_shape(field)).astype(np.float32)
  micro = {k: jnp.asarray(v) for k, v in arrays.items()}
  step_inputs = algo.bind(cfg).step_inputs([{k: v[None] for k, v in micro.items()}])[0]
  micro.update({k: v[0] for k, v in step_inputs.items()})
  return micro, jnp.asarray(inserted > 0)


def loss_of(cfg, micro):
  algo = registry.of(cfg)
  return lambda logprobs, entropy: algo.bind(cfg).loss(logprobs, entropy, micro)[0]


@pytest.mark.parametrize("name,overrides", CASES + CORRECTED, ids=lambda x: str(x))
def test_an_inserted_token_gets_no_gradient_and_its_logprobs_do_not_move_the_loss(name, overrides):
  cfg = config(name, overrides)
  config_lib.validate(cfg, 1)
  micro, inserted = micro_batch(cfg)
  rng = np.random.default_rng(1)
  logprobs = micro.get("old_logprobs", jnp.asarray(rng.uniform(-2.0, -0.1, (ROWS, R)), jnp.float32))
  logprobs = logprobs + jnp.asarray(rng.normal(0.0, 0.2, (ROWS, R)), jnp.float32)
  entropy = jnp.asarray(rng.uniform(0.5, 3.0, (ROWS, R)), jnp.float32)
  loss = loss_of(cfg, micro)
  value, (g_logprobs, g_entropy) = jax.value_and_grad(loss, argnums=(0, 1))(logprobs, entropy)
  assert np.isfinite(float(value))
  model_tokens = np.asarray(micro["loss_mask"]) > 0
  for grad in (g_logprobs, g_entropy):
    assert np.all(np.asarray(grad)[np.asarray(inserted)] == 0.0)
  assert np.any(np.asarray(g_logprobs)[model_tokens] != 0.0)

  # Whatever the log-probs at the inserted positions, the loss is the same, bitwise (both computed the same way:
  # value_and_grad's primal may round differently from a plain call).
  far = lambda x: jnp.where(inserted, x - 7.0, x)  # noqa: E731
  moved = dict(micro, **{k: far(micro[k]) for k in LOGPROB_FIELDS if k in micro})
  assert float(loss_of(cfg, moved)(far(logprobs), far(entropy))) == float(loss(logprobs, entropy))


def test_an_all_ones_completion_mask_leaves_the_response_mask_exactly():
  from pacs_jax.rollout import interface
  from pacs_jax.trainer import packing as batching
  response = np.asarray([[1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
  completions = [interface.Completion(0, 0, [5, 6], np.zeros(2, np.float32), "eos"),
                 interface.Completion(0, 1, [5, 6, 7, 8, 9], np.zeros(5, np.float32), "length")]
  out = batching.loss_mask(completions, response)
  assert out.dtype == np.float32 and np.array_equal(out, response) and out is not response
