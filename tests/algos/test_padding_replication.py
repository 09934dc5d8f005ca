"""pacs.exact_padding_replication: r̂ equals the released one computed through verl's remove-padding forward.

The reference re-enacts, in torch, ritzz-ai/PACS's dp_actor._forward_micro_batch with use_remove_padding
(flash_attn's unpad_input -> one packed row with per-row position ids -> torch.roll(-1) -> log-probs ->
pad_input -> slice [:, -R-1:-1]) and pacs_core_algos.compute_reward (an unmasked sum over the slice), one
micro-batch of `pack_rows` rows at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from pacs_jax.algos import pacs
from pacs_jax.models import families as registry, hf, qwen2
from pacs_jax.trainer import step as step_lib

P, R, ROWS, V, D = 6, 7, 8, 48, 16


def toy_batch(seed=0):
  """Left-padded prompts, right-padded responses; some fill R, most stop early; prompts' first tokens differ."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, V, (ROWS, P + R))
  attn = np.ones((ROWS, P + R), np.int64)
  for r in range(ROWS):
    attn[r, :rng.integers(0, 3)] = 0
    attn[r, P + rng.integers(1, R + 1):] = 0
  attn[1, P:] = 1  # a response that fills R: no padding term
  return ids * attn, attn  # padding positions hold id 0


# ----------------------------------------------------------------------------------------------
# verl's remove-padding path, re-enacted


def unpad_input(hidden_states, attention_mask):
  """flash_attn.bert_padding.unpad_input: the real positions, row after row."""
  indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
  return hidden_states.flatten(0, 1)[indices], indices


def pad_input(hidden_states, indices, batch, seqlen):
  """flash_attn.bert_padding.pad_input: scatter back into zeros."""
  out = torch.zeros((batch * seqlen,) + hidden_states.shape[1:], dtype=hidden_states.dtype)
  out[indices] = hidden_states
  return out.view(batch, seqlen, *hidden_states.shape[1:])


def verl_log_probs(packed_logits_fn, input_ids, attention_mask, temperature=1.0):
  """dp_actor._forward_micro_batch (use_remove_padding, no sp): [b, R] log-probs of the response slice."""
  batch_size, seqlen = input_ids.shape
  position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)  # compute_position_id_with_mask
  input_ids_rmpad, indices = unpad_input(input_ids.unsqueeze(-1), attention_mask)
  input_ids_rmpad = input_ids_rmpad.transpose(0, 1)  # (1, total_nnz)
  position_ids_rmpad = position_ids.flatten()[indices][None]
  input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1).squeeze(0)
  logits_rmpad = packed_logits_fn(input_ids_rmpad, position_ids_rmpad) / temperature  # (total_nnz, V)
  log_probs = torch.gather(torch.log_softmax(logits_rmpad, -1), -1, input_ids_rmpad_rolled[:, None])[:, 0]
  full_log_probs = pad_input(log_probs.unsqueeze(-1), indices, batch_size, seqlen)
  return full_log_probs.squeeze(-1)[:, -R - 1:-1]


def verl_reward(policy_fn, ref_fn, input_ids, attention_mask, pack_rows, beta=1.0):
  """compute_reward(reward_method="1") over micro-batches of pack_rows rows: β Σ (log_prob − old_log_prob)."""
  out = []
  for start in range(0, input_ids.shape[0], pack_rows):
    micro = input_ids[start:start + pack_rows], attention_mask[start:start + pack_rows]
    log_prob, old_log_prob = verl_log_probs(policy_fn, *micro), verl_log_probs(ref_fn, *micro)
    out.append(beta * (log_prob - old_log_prob).sum(dim=-1))
  return torch.cat(out).numpy()


def our_reward(policy, ref, ids, attn, pack_rows, beta=1.0):
  targets, sum_mask = pacs.padding_replication_inputs(ids.astype(np.int32), attn.astype(np.int32), R, pack_rows)
  args = (jnp.asarray(ids, jnp.int32), jnp.asarray(attn, jnp.int32), R, 1.0)
  logp = step_lib.response_logprobs(policy, *args, targets=jnp.asarray(targets))
  ref_logp = step_lib.response_logprobs(ref, *args, targets=jnp.asarray(targets))
  mask = jnp.asarray(attn[:, P:], logp.dtype)
  exact = pacs.reward_proxy(logp, ref_logp, mask, beta=beta, sum_mask=jnp.asarray(sum_mask, logp.dtype))
  masked = pacs.reward_proxy(logp, ref_logp, mask, beta=beta)
  return np.asarray(exact), np.asarray(masked)


# ----------------------------------------------------------------------------------------------
# 1. The index logic, exactly: a causal toy model in float64 on both sides


class ToyCausalLM:
  """h_t = tanh(E[x_t] + mean of E over the row's real tokens up to t); logits = h W. Row-causal, so the packed
  (per-row position ids) and the padded layouts give the same logits at real positions."""

  def __init__(self, seed):
    rng = np.random.default_rng(seed)
    self.E, self.W = rng.normal(0, 1, (V, D)), rng.normal(0, 1, (D, V))

  # The JAX face step_lib.response_logprobs needs: .model(ids, mask) -> hidden, .logits(hidden) -> logits.
  def model(self, input_ids, attention_mask):
    m = attention_mask.astype(jnp.float64)[..., None]
    e = jnp.asarray(self.E)[input_ids] * m
    return jnp.tanh(e + jnp.cumsum(e, axis=1) / jnp.maximum(jnp.cumsum(m, axis=1), 1.0))

  def logits(self, hidden):
    return jnp.einsum("BCD,DV->BCV", hidden, jnp.asarray(self.W))

  def packed(self, input_ids_rmpad, position_ids_rmpad):
    """The varlen forward: each packed row (position ids restart at 0) attends to itself only."""
    e = torch.tensor(self.E)[input_ids_rmpad[0]]
    starts = torch.cumsum((position_ids_rmpad[0] == 0).long(), 0) - 1  # row number of each packed position
    c = torch.stack([e[(starts == starts[k]) & (torch.arange(len(e)) <= k)].sum(0) for k in range(len(e))])
    h = torch.tanh(e + c / (position_ids_rmpad[0][:, None] + 1))
    return h @ torch.tensor(self.W)


@pytest.mark.parametrize("pack_rows", [ROWS, 4, 2])
def test_exact_replication_equals_verl_remove_padding(pack_rows):
  ids, attn = toy_batch()
  policy, ref = ToyCausalLM(0), ToyCausalLM(1)
  with jax.enable_x64(True):
    exact, masked = our_reward(policy, ref, ids, attn, pack_rows)
  assert exact.dtype == np.float64
  want = verl_reward(policy.packed, ref.packed, torch.tensor(ids), torch.tensor(attn), pack_rows)
  np.testing.assert_allclose(exact, want, rtol=0, atol=1e-6)
  early = attn[:, P:].sum(-1) < R
  assert early.sum() >= 4 and not early[1]
  # The masked (default) r̂ differs exactly where a response ended early: by the padding term.
  assert np.all(np.abs(exact - masked)[early] > 1e-3)
  np.testing.assert_array_equal(exact[~early], masked[~early])


def test_padding_term_is_the_next_packed_rows_first_token():
  ids, attn = toy_batch()
  targets, sum_mask = pacs.padding_replication_inputs(ids, attn, R, 4)
  lengths = attn[:, P:].sum(-1)
  first = [ids[r][attn[r] > 0][0] for r in range(ROWS)]
  for r in range(ROWS):
    if lengths[r] == R:
      np.testing.assert_array_equal(sum_mask[r], attn[r, P:])
      continue
    following = r + 1 if (r + 1) % 4 else r - 3  # the last row of each packed micro-batch wraps to its first
    assert targets[r, lengths[r]] == first[following]
    np.testing.assert_array_equal(sum_mask[r], (np.arange(R) <= lengths[r]).astype(np.float32))
  with pytest.raises(ValueError, match="micro-batches of 3"):
    pacs.padding_replication_inputs(ids, attn, R, 3)


# ----------------------------------------------------------------------------------------------
# 2. End to end on Qwen2: our fp32 model against transformers' packed forward (fp64), as verl runs it


def test_qwen2_exact_replication_against_transformers_packed_forward(tmp_path):
  config = qwen2.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
  policy = registry.causal_lm(config, rngs=nnx.Rngs(0))
  ref = registry.causal_lm(config, rngs=nnx.Rngs(1))
  torch_models = []
  for name, model in (("policy", policy), ("ref", ref)):
    hf.save_pretrained(model, str(tmp_path / name))
    torch_models.append(transformers.Qwen2ForCausalLM.from_pretrained(
        str(tmp_path / name), dtype=torch.float64, attn_implementation="sdpa").eval())

  def packed(model):  # attention_mask=None + restarting position ids: one sequence per packed row
    def fn(input_ids_rmpad, position_ids_rmpad):
      with torch.no_grad():
        return model(input_ids=input_ids_rmpad, attention_mask=None, position_ids=position_ids_rmpad,
                     use_cache=False).logits[0]
    return fn

  ids, attn = toy_batch()
  exact, _ = our_reward(policy, ref, ids, attn, ROWS)
  want = verl_reward(packed(torch_models[0]), packed(torch_models[1]), torch.tensor(ids), torch.tensor(attn), ROWS)
  # fp32 model against fp64 transformers: the model-equivalence tolerance (the index logic is exact above).
  np.testing.assert_allclose(exact, want, rtol=0, atol=1e-5)
  assert np.abs(want).max() > 1e-2
