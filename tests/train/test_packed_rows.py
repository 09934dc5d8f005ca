"""Packed rows (issue 42, trainer/sequence_packing.py) equal the padded layout: the same per-response log-probs,
values, losses and gradients for every objective, on 8 CPU devices, with responses of 1 token to R, a group
whose responses all reach R, and prompts of every length; and the host packing itself (placement, ladder, the
index back to the responses) on its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import sharding
from pacs_jax.algos import algorithms, batch as batch_lib, ppo
from pacs_jax.models import families, qwen2
from pacs_jax.trainer import packing, sequence_packing, step as step_lib
from pacs_jax.trainer import programs as programs_lib
from pacs_jax.trainer import train_state as state_lib

N, GROUPS, P, R = 4, 4, 6, 10
ROWS = N * GROUPS
MODEL = qwen2.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
EOS = 1

# Every objective, and PACS's variants that read what the packed layout keeps of the padded rows (the rollout
# reference, verl's first-padding-position term through the attention mask's tail).
CASES = {
    "pacs": ("pacs", {}),
    "pacs_rollout_ref_replication": ("pacs", {"pacs.reference_policy": "rollout",
                                              "pacs.exact_padding_replication": True,
                                              "train.verl_micro_batch_rows": 8}),
    "grpo_kl_entropy": ("grpo", {"grpo.use_kl_loss": True, "grpo.kl_coef": 0.1, "grpo.entropy_coeff": 0.01}),
    "ppo": ("ppo", {}),
    "dapo": ("dapo", {}),
    "drgrpo": ("drgrpo", {}),
    "gspo": ("gspo", {}),
    # A row budget of every response's row: the two micro-batches packed as one (a token budget), whose update is
    # still the padded two's.
    "pacs_merged": ("pacs", {"train.packing_rows": ROWS}),
    "ppo_merged": ("ppo", {"train.packing_rows": ROWS}),
    # Four micro-batches of one group, packed two at a time: the groups dealt to balance the two packed ones' tokens
    # (`sequence_packing.balanced_order`), not in their order.
    "grpo_merged_balanced": ("grpo", {"train.micro_batch_prompts": 1, "train.packing_rows": 2 * N}),
}
MICRO_BATCHES = {"pacs_merged": 1, "ppo_merged": 1}  # packed micro-batches of the step's one mini-batch (else 2)
BATCH_SHARDS = {"grpo_merged_balanced": 4}  # a micro-batch of one group's 4 rows over 4 devices (else 8)


def rollout_rows(seed=0):
  """Host rows as `stages.pack` makes them: prompts of 1..P tokens left-padded, responses of 1..R tokens (the
  first group all R, unfinished) right-padded, each ending at its EOS; half of each group rewarded."""
  rng = np.random.default_rng(seed)
  input_ids = np.zeros((ROWS, P + R), np.int32)
  attention = np.zeros((ROWS, P + R), np.int32)
  prompt_lens = rng.integers(1, P + 1, GROUPS)
  lengths = rng.integers(1, R + 1, ROWS)
  lengths[:N] = R
  lengths[N] = 1
  for row in range(ROWS):
    p = prompt_lens[row // N]
    input_ids[row, P - p:P] = np.random.default_rng(row // N).integers(2, MODEL.vocab_size, p)
    attention[row, P - p:P] = 1
    input_ids[row, P:P + lengths[row]] = rng.integers(2, MODEL.vocab_size, lengths[row])
    if lengths[row] < R:
      input_ids[row, P + lengths[row] - 1] = EOS
    attention[row, P:P + lengths[row]] = 1
  response_mask = attention[:, P:].astype(np.float32)
  rewards = np.tile([1.0, 0.0], ROWS // 2).astype(np.float32)
  return input_ids, attention, response_mask, rewards


def config(name, overrides, packed):
  cfg = config_lib.default_config()
  cfg.algorithm = name
  cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.data.max_prompt_length = N, R, P
  cfg.train.batch_prompts = cfg.train.mini_batch_prompts = GROUPS
  cfg.train.micro_batch_prompts = 2  # 2 micro-batches of 2 groups
  cfg.train.logits_chunk = 4
  cfg.train.packing = packed
  cfg.update_from_flattened_dict(overrides)
  return cfg


def minibatch(cfg, mesh):
  """(The step's one mini-batch through the host path (`packing.arrange`, `packing.to_minibatches`), its layout,
  its rows' order: the rollout's row of each)."""
  input_ids, attention, response_mask, rewards = rollout_rows()
  objective = algorithms.bind(cfg)
  rollout = packing.PackedRollout(input_ids, attention, response_mask, rewards, ["a"] * ROWS, ["stop"] * ROWS,
                                  extra=objective.host_inputs(input_ids, attention, R),
                                  behaviour_logprobs=np.zeros((ROWS, R), np.float32),
                                  scores=np.arange(ROWS, dtype=np.float32))  # each row's own number
  layout = programs_lib.batch_layout(cfg, mesh)
  arranged, plan = packing.arrange(rollout, layout, 1)
  return packing.to_minibatches(arranged, layout, mesh, 1, plan)[0], layout, arranged.scores.astype(int)


@functools.cache
def logprob_program(graphdef, with_targets: bool):
  """One jitted log-prob pass for every case (padded and packed are two shapes of it): the objective's own
  log-prob targets (PACS's padding replication) or the responses' tokens."""
  targets = (lambda mb: mb["logprob_targets"]) if with_targets else None
  return jax.jit(step_lib.make_logprob_fn(graphdef, 1.0, 4, targets))


def run(cfg, mesh):
  """(old log-probs [k, m, R], values or None, the step's metrics, its gradient) of one mini-batch."""
  objective = algorithms.bind(cfg)
  model = families.causal_lm(MODEL, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  critic_graphdef = critic_params = None
  if cfg.algorithm == "ppo":
    critic_graphdef, critic_params = nnx.split(ppo.Critic(MODEL, rngs=nnx.Rngs(1)), nnx.Param)
  sgd = optax.sgd(1.0)
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=sgd.init(params),
                               rng=state_lib.initial_rng(0), critic_params=critic_params,
                               critic_opt_state=sgd.init(critic_params) if critic_params is not None else None)
  with jax.set_mesh(mesh):
    mb, layout, order = minibatch(cfg, mesh)
    assert (objective.temperature, objective.logits_chunk) == (1.0, 4)
    old = logprob_program(graphdef, objective.logprob_targets(mb) is not None)(params, mb)
    mb["old_logprobs"] = old
    if "ref_logprobs" in layout.names():  # the sampling policy's, or a frozen one of its own
      mb["ref_logprobs"] = old if objective.reference == batch_lib.Reference.ROLLOUT else old - 0.25
    values = None
    if critic_graphdef is not None:
      values = jax.jit(step_lib.make_value_fn(critic_graphdef, objective.critic_mask))(critic_params, mb)
      mb["old_values"] = values + 0.1
    if layout.names(batch_lib.STEP):
      mb.update(jax.jit(objective.step_inputs)([mb])[0])
    mb["old_logprobs"] = mb["old_logprobs"] + 0.05 * jnp.sin(jnp.arange(R, dtype=jnp.float32))  # ratios != 1
    step = step_lib.make_train_step(objective, graphdef, sgd, critic_graphdef, sgd if critic_graphdef else None,
                                    optimizer_metrics=lambda _: {})
    new_state, metrics = jax.jit(step)(state, mb)
    grads = jax.tree.map(lambda a, b: np.asarray(a - b), params, new_state.params)
    if critic_params is not None:
      grads = (grads, jax.tree.map(lambda a, b: np.asarray(a - b), critic_params, new_state.critic_params))
  return np.asarray(old), None if values is None else np.asarray(values), jax.device_get(metrics), grads, order


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh(data=2, fsdp=4, devices=jax.devices()[:8])


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_rows_give_the_padded_logprobs_losses_and_gradients(case, mesh):
  name, overrides = CASES[case]
  if case in BATCH_SHARDS:
    mesh = sharding.make_mesh(data=1, fsdp=BATCH_SHARDS[case], devices=jax.devices()[:BATCH_SHARDS[case]])
  padded = run(config(name, overrides, False), mesh)
  packed = run(config(name, overrides, True), mesh)
  _, attention, response_mask, _ = rollout_rows()
  assert packed[0].shape[0] == MICRO_BATCHES.get(case, 2)  # packed micro-batches
  order = packed[4]  # the rollout's row of each packed row: groups whole, dealt over the packed micro-batches
  assert np.array_equal(padded[4], np.arange(ROWS)) and sorted(order) == list(range(ROWS))
  assert ("balanced" in case) == (not np.array_equal(order, np.arange(ROWS)))
  assert np.all(order.reshape(GROUPS, N) // N == order.reshape(GROUPS, N)[:, :1] // N)
  # Every position an objective reads: the response, and the one after it (verl's padding term, PPO's values).
  read = (np.concatenate([np.ones((ROWS, 1)), response_mask[:, :-1]], axis=1) > 0)[order]
  rows = lambda x: x.reshape(ROWS, R)
  padded = (padded[0].reshape(ROWS, R)[order],) + tuple(padded[1:])
  if padded[1] is not None:
    padded = (padded[0], padded[1].reshape(ROWS, R)[order]) + padded[2:]
  np.testing.assert_allclose(rows(packed[0])[read], rows(padded[0])[read], atol=1e-5, rtol=0)
  assert np.all(rows(packed[0])[~read] == 0)  # nothing is computed past a response
  if padded[1] is not None:
    np.testing.assert_allclose(rows(packed[1])[read], rows(padded[1])[read], atol=1e-5, rtol=0)
  # Merged, the micro-batches are others (one of 16 responses, not two of 8): the loss and the gradient are the
  # whole mini-batch's either way, but a metric averaged per micro-batch with other weights than the loss's (PPO's
  # token-mean KL under a per-sequence loss) is the split's, as with micro_batch_prompts doubled.
  keys = [k for k in padded[2] if "merged" not in case or k in ("loss", "grad_norm", "critic/loss", "critic/grad_norm")]
  for key in keys:
    np.testing.assert_allclose(packed[2][key], padded[2][key], rtol=1e-5, atol=1e-6, err_msg=key)
  grads_padded, grads_packed = jax.tree.leaves(padded[3]), jax.tree.leaves(packed[3])
  scale = max(np.abs(g).max() for g in grads_padded)
  assert scale > 0
  for a, b in zip(grads_packed, grads_padded):
    np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)


def test_host_packing_places_each_sequence_whole_and_indexes_its_response():
  input_ids, attention, response_mask, _ = rollout_rows()
  T = P + R
  needed = sequence_packing.rows_needed(attention, R, T)
  out = sequence_packing.pack(input_ids, attention, R, T, needed, pad_id=0, row_offset=3)
  flat = out["tokens"].reshape(-1)
  prompt, response = sequence_packing.sequence_spans(attention, R)
  assert needed < ROWS and (out["segment_ids"] > 0).sum() == (prompt + response).sum()
  for i in range(ROWS):
    idx = out["response_index"][i, :response[i]] - 3 * T  # this process's rows start at row 3
    assert np.array_equal(flat[idx + 1], input_ids[i, P:P + response[i]])  # each predicts its response token
    assert np.all(out["response_index"][i, min(response[i] + 1, R):] == (3 + needed) * T)  # none: past the rows
    seg = out["segment_ids"].reshape(-1)[idx]
    assert np.all(seg == seg[0]) and np.all(out["positions"].reshape(-1)[idx + 1] == prompt[i] + np.arange(response[i]))
  with pytest.raises(ValueError, match="more than"):
    sequence_packing.pack(input_ids, attention, R, T, needed - 1, pad_id=0)


def test_the_ladder_is_few_sizes_in_multiples_of_the_shards_and_merges_fill_the_budget():
  assert sequence_packing.ladder(64, 8, 8) == (8, 16, 24, 32, 40, 48, 56, 64)
  assert sequence_packing.ladder(16, 8, 8) == (8, 16)
  assert sequence_packing.rung(17, (8, 16, 24)) == 24
  with pytest.raises(ValueError, match="top rung"):
    sequence_packing.rung(25, (8, 16, 24))
  # Micro-batches merged while their rows fit the budget: the most that fit, at the rung that holds them.
  assert sequence_packing.merges(8) == (8, 4, 2, 1) and sequence_packing.merges(6) == (2, 1)
  assert sequence_packing.choose({1: 8, 2: 15, 4: 30}, 16, (4, 8, 12, 16)) == (2, 16)
  assert sequence_packing.choose({1: 3, 2: 5}, 16, (4, 8, 12, 16)) == (2, 8)


def test_merged_micro_batches_get_groups_dealt_by_their_tokens():
  # Groups of 2 rows, one per padded micro-batch, 4 of them in a mini-batch: two long groups, then two short ones.
  lengths = np.asarray([10, 10, 10, 10, 1, 1, 1, 1])
  order = sequence_packing.balanced_order(lengths, n=2, m=2, k=4, f=2)
  assert list(order) == [0, 1, 4, 5, 2, 3, 6, 7]  # a long and a short group in each packed micro-batch
  assert sequence_packing.rows_by_merge(lengths, 2, 2, 4, T=22) == {4: 2, 2: 1, 1: 1}  # in order, f = 2 takes 2
  for f in (1, 4):  # a padded micro-batch's own groups; one packed micro-batch: nothing to deal
    assert list(sequence_packing.balanced_order(lengths, 2, 2, 4, f)) == list(range(8))
