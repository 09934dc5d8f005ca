"""GRPO and PPO updates equal the released verl's (a torch port of its micro-batch accumulation), clip included.

The reference re-enacts ritzz-ai/PACS's verl (432f9e) on transformers' Qwen2 holding the same weights:
dp_actor.update_policy / dp_critic.update_critic (micro-batches of ppo_micro_batch_size_per_gpu rows, each
loss / gradient_accumulation, then clip_grad_norm_(1.0)), core_algos.compute_policy_loss, compute_value_loss,
agg_loss("seq-mean-token-sum-norm"), compute_grpo_outcome_advantage, compute_gae_advantage_return and
dp_critic.compute_values. This project splits the mini-batch differently (a memory knob); the gradient must not
depend on it.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from pacs_jax import config as config_lib
from pacs_jax.algos import algorithms as algo_registry, ppo
from pacs_jax.models import families as registry, hf, qwen2
from pacs_jax.trainer import train_state as state_lib
from pacs_jax.trainer import step as step_lib

N_GROUPS, N, P, R = 4, 4, 5, 6
VERL_MICRO = 8  # ppo_micro_batch_size_per_gpu: 2 micro-batches of 2 groups each
MODEL = qwen2.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


# ----------------------------------------------------------------------------------------------
# The released verl, ported to torch (function names as in verl)


def agg_loss(loss_mat, loss_mask, loss_agg_mode):
  assert loss_agg_mode == "seq-mean-token-sum-norm"
  seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
  return torch.sum(seq_losses) / loss_mask.shape[-1]


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                        clip_ratio_c, loss_agg_mode):
  negative_approx_kl = log_prob - old_log_prob
  ratio = torch.exp(negative_approx_kl)
  pg_losses1 = -advantages * ratio
  pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
  clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
  pg_losses3 = -advantages * clip_ratio_c
  clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
  pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
  return agg_loss(pg_losses, response_mask, loss_agg_mode)


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
  vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
  vf_losses1 = (vpreds - returns) ** 2
  vf_losses2 = (vpredclipped - returns) ** 2
  return agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, loss_agg_mode)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
  scores = token_level_rewards.sum(dim=-1)
  id2score = collections.defaultdict(list)
  for i in range(scores.shape[0]):
    id2score[index[i]].append(scores[i])
  mean = {k: torch.mean(torch.tensor(v)) for k, v in id2score.items()}
  std = {k: torch.std(torch.tensor([v])) for k, v in id2score.items()}
  scores = torch.stack([(scores[i] - mean[index[i]]) / (std[index[i]] + epsilon) for i in range(len(scores))])
  return scores.unsqueeze(-1) * response_mask


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
  lastgaelam = 0
  advantages_reversed = []
  gen_len = token_level_rewards.shape[-1]
  for t in reversed(range(gen_len)):
    nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
    delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
    lastgaelam = delta + gamma * lam * lastgaelam
    advantages_reversed.append(lastgaelam)
  advantages = torch.stack(advantages_reversed[::-1], dim=1)
  returns = advantages + values
  mean = (advantages * response_mask).sum() / response_mask.sum()
  var = (((advantages - mean) ** 2) * response_mask).sum() / response_mask.sum()
  var = var * response_mask.sum() / (response_mask.sum() - 1)
  return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


def forward(module, batch, critic=False):
  """dp_actor/dp_critic _forward_micro_batch (padded path): log-probs or values [b, R] of the response."""
  position_ids = torch.clip(torch.cumsum(batch["attention_mask"], dim=-1) - 1, min=0)
  out = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids,
               use_cache=False).logits
  if critic:
    return out[:, -R - 1:-1].squeeze(-1)
  logits = out[:, -R - 1:-1, :]
  return torch.gather(torch.log_softmax(logits.float(), -1), -1, batch["responses"][..., None])[..., 0]


def verl_update(module, batch, micro_loss, grad_clip=1.0):
  """update_policy / update_critic on one rank: micro-batches of VERL_MICRO rows, loss / GA, clip, -> grads."""
  module.zero_grad()
  rows = batch["input_ids"].shape[0]
  gradient_accumulation = rows // VERL_MICRO
  for start in range(0, rows, VERL_MICRO):
    micro = {k: v[start:start + VERL_MICRO] for k, v in batch.items()}
    (micro_loss(micro) / gradient_accumulation).backward()
  grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=grad_clip)
  return {name: p.grad.numpy().copy() for name, p in module.named_parameters()}, float(grad_norm)


# ----------------------------------------------------------------------------------------------
# Fixtures


def toy_batch(seed=0):
  rng = np.random.default_rng(seed)
  rows = N_GROUPS * N
  ids = rng.integers(1, MODEL.vocab_size, (rows, P + R)).astype(np.int64)
  attn = np.ones((rows, P + R), np.int64)
  for r in range(rows):
    attn[r, :rng.integers(0, 3)] = 0  # left padding of the prompt
    attn[r, P + rng.integers(1, R + 1):] = 0  # response length 1..R
  ids[:, :P] = np.repeat(ids[::N, :P], N, axis=0)  # a group shares its prompt
  rewards = rng.integers(0, 2, rows).astype(np.float32)
  rewards[:N] = 1.0  # a group whose labels all agree
  return ids, attn, rewards


def models(tmp_path):
  policy = registry.causal_lm(MODEL, rngs=nnx.Rngs(0))
  critic = ppo.Critic(MODEL, rngs=nnx.Rngs(1))
  nnx.update(critic.model, nnx.state(policy.model, nnx.Param))  # as the trainer builds it
  hf.save_pretrained(policy, str(tmp_path / "policy"))
  torch_policy = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path / "policy"), dtype=torch.float32,
                                                               attn_implementation="eager")
  critic_config = transformers.AutoConfig.from_pretrained(str(tmp_path / "policy"), num_labels=1)
  critic_config.classifier_dropout = 0.0  # as verl's critic (fsdp_workers._build_critic_model_optimizer)
  torch_critic = transformers.Qwen2ForTokenClassification.from_pretrained(
      str(tmp_path / "policy"), config=critic_config, dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    torch_critic.score.weight.copy_(torch.tensor(np.asarray(critic.value_kernel[...]).T))
    torch_critic.score.bias.copy_(torch.tensor(np.asarray(critic.value_bias[...])))
  return policy, critic, torch_policy, torch_critic


def hf_named(grads_model, tmp_path, name) -> dict[str, np.ndarray]:
  """A gradient pytree in transformers' names, through the (tested) export mapping."""
  hf.save_pretrained(grads_model, str(tmp_path / name))
  return load_file(str(tmp_path / name / "model.safetensors"))


def run_step(cfg, policy, critic, minibatch):
  """Our train step with the optimizer replaced by clip + SGD(1): the applied update is the clipped gradient."""
  graphdef, params = nnx.split(policy, nnx.Param)
  critic_graphdef = critic_params = None
  if critic is not None:
    critic_graphdef, critic_params = nnx.split(critic, nnx.Param)
  read_back = optax.chain(state_lib.gradient_clip(cfg.train), optax.sgd(1.0))
  state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=read_back.init(params),
                               rng=state_lib.initial_rng(0), critic_params=critic_params,
                               critic_opt_state=read_back.init(critic_params) if critic is not None else None)
  sgd_metrics = lambda s: {"skipped_updates": jnp.zeros((), jnp.float32), "lr": jnp.ones(())}  # SGD keeps neither
  fn = step_lib.make_train_step(algo_registry.bind(cfg), graphdef, read_back, critic_graphdef, read_back if critic else None,
                                optimizer_metrics=sgd_metrics)
  new_state, metrics = jax.jit(fn)(state, minibatch)
  grads = jax.tree.map(lambda a, b: a - b, params, new_state.params)
  critic_grads = None
  if critic is not None:
    critic_grads = jax.tree.map(lambda a, b: a - b, critic_params, new_state.critic_params)
  return nnx.merge(graphdef, grads), critic_grads, metrics


def assert_grads_match(ours: dict, theirs: dict, atol=1e-5):
  assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
  for name in theirs:
    np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_update_equals_verl_micro_batch_accumulation(tmp_path, algorithm):
  cfg = config_lib.default_config()
  cfg.algorithm = algorithm
  cfg.rollout.n = N
  cfg.train.grad_clip = 1.0
  cfg.train.verl_micro_batch_rows = VERL_MICRO
  cfg.grpo.loss_agg_mode = "seq-mean-token-sum-norm"
  policy, critic, torch_policy, torch_critic = models(tmp_path)
  ids, attn, rewards = toy_batch()
  rng = np.random.default_rng(1)
  k = N_GROUPS  # our memory split: 4 micro-batches of one group (verl: 2 of 2 groups)
  split = lambda x: jnp.asarray(x).reshape((k, x.shape[0] // k) + x.shape[1:])
  mb = {"input_ids": split(ids.astype(np.int32)), "attention_mask": split(attn.astype(np.int32)),
        "loss_mask": split(attn[:, P:].astype(np.float32)), "rewards": split(rewards)}
  tb = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(attn), "responses": torch.tensor(ids[:, P:])}
  response_mask = tb["attention_mask"][:, -R:].float()

  # old log-probs: the policy's, moved a little so that the ratio clip acts on some tokens.
  logp = np.asarray(step_lib.make_logprob_fn(nnx.split(policy, nnx.Param)[0], 1.0)(
      nnx.state(policy, nnx.Param), mb)).reshape(-1, R)
  with torch.no_grad():
    np.testing.assert_allclose(logp * attn[:, P:], (forward(torch_policy, tb) * response_mask).numpy(), atol=1e-5)
  old = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)
  mb["old_logprobs"] = split(old)
  tb["old_log_probs"] = torch.tensor(old)

  if algorithm == "grpo":
    token_rewards = torch.zeros(len(ids), R)
    token_rewards[torch.arange(len(ids)), response_mask.sum(-1).long() - 1] = torch.tensor(rewards)
    tb["advantages"] = compute_grpo_outcome_advantage(token_rewards, response_mask, np.arange(len(ids)) // N)
  else:
    value_fn = step_lib.make_value_fn(nnx.split(critic, nnx.Param)[0], ppo.Ppo().critic_mask)
    values = np.asarray(value_fn(nnx.state(critic, nnx.Param), mb)).reshape(-1, R)
    with torch.no_grad():  # dp_critic.compute_values: values * attention_mask[:, -R-1:-1]
      want = (forward(torch_critic, tb, critic=True) * tb["attention_mask"][:, -R - 1:-1]).numpy()
    np.testing.assert_allclose(values, want, atol=1e-5)
    old_values = ((values + rng.normal(0, 0.5, values.shape)) * attn[:, P - 1:-1]).astype(np.float32)
    mb["old_values"] = split(old_values)
    tb["values"] = torch.tensor(old_values, dtype=torch.float64)
    token_rewards = torch.zeros(len(ids), R, dtype=torch.float64)
    token_rewards[torch.arange(len(ids)), response_mask.sum(-1).long() - 1] = torch.tensor(rewards).double()
    adv, ret = compute_gae_advantage_return(token_rewards, tb["values"], response_mask.double(), 1.0, 1.0)
    (ours,) = ppo.step_advantages([mb], gamma=cfg.ppo.gamma, lam=cfg.ppo.lam)
    our_adv, our_ret = ours["advantages"], ours["returns"]
    np.testing.assert_allclose(np.asarray(our_ret).reshape(-1, R), ret.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(our_adv).reshape(-1, R) * attn[:, P:], (adv * response_mask).numpy(),
                               atol=1e-5)
    mb["advantages"], mb["returns"] = our_adv, our_ret
    tb["advantages"], tb["returns"] = adv.float(), ret.float()
    tb["values"] = tb["values"].float()

  def actor_loss(micro):
    return compute_policy_loss(micro["old_log_probs"], forward(torch_policy, micro), micro["advantages"],
                               micro["attention_mask"][:, -R:], 0.2, 0.2, 3.0, "seq-mean-token-sum-norm")

  want_grads, want_norm = verl_update(torch_policy, tb, actor_loss)
  assert want_norm > 1.0  # the clip acts
  ours, our_critic, metrics = run_step(cfg, policy, critic if algorithm == "ppo" else None, mb)
  np.testing.assert_allclose(float(metrics["grad_norm"]), want_norm, rtol=1e-5)
  assert_grads_match(hf_named(ours, tmp_path, "actor_grads"), want_grads)

  if algorithm == "ppo":
    def critic_loss(micro):
      return compute_value_loss(forward(torch_critic, micro, critic=True), micro["returns"], micro["values"],
                                micro["attention_mask"][:, -R - 1:-1], 0.5, "seq-mean-token-sum-norm")

    want_critic, want_critic_norm = verl_update(torch_critic, tb, critic_loss)
    assert want_critic_norm > 1.0
    np.testing.assert_allclose(float(metrics["critic/grad_norm"]), want_critic_norm, rtol=1e-5)
    shell = nnx.merge(*nnx.split(policy, nnx.Param))  # the backbone's gradient in transformers' names
    nnx.update(shell.model, our_critic["model"])
    got = hf_named(shell, tmp_path, "critic_grads")
    got["score.weight"] = np.asarray(our_critic["value_kernel"].get_value()).T
    got["score.bias"] = np.asarray(our_critic["value_bias"].get_value())
    assert_grads_match(got, want_critic)
