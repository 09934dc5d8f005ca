"""Conversations (rollout/conversation.py, issue 43): a multi-turn rollout's model-token log-probs equal one uncached
forward over the whole conversation (1e-5, fp32) and each token runs through the model once; the loss mask is 0 on
exactly the observations; turn and row limits end episodes with their reason; requests queue for slots; a slow
environment step holds only its own slot; without pauses the result is `scheduler.generate`'s, bitwise."""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax.envs import env as env_lib
from pacs_jax.envs.sandbox import Limits, Sandbox
from pacs_jax.models import families as registry
from pacs_jax.rollout import conversation, interface, sampling, scheduler
from pacs_jax.rollout import engine as engine_lib
from tests import uncached_forward

# Multi-turn log-probs against one uncached forward at 1e-5: both sides compiled at -O1 (conftest.py).
pytestmark = pytest.mark.xla_o1

PREFILL, DECODE, PAGE = 16, 48, 16  # 64 cache rows a slot: 4 pages of 16
ROWS = PREFILL + DECODE
# Sampling at the released recipe's temperature (configs/_released.py).
GREEDY, WARM = sampling.Greedy(), sampling.Temperature(1.0)
PROMPTS = [list(range(3, 10)), [5, 77, 200], list(range(30, 42))]
# Each prompt's observations, in order (token ids; the toy tokenizer writes them as words).
SCRIPT = {"p0": [[250, 251, 17], [18, 19, 20, 21, 22]], "p1": [[9, 8, 7, 6]], "p2": [[100, 101], [102], [103, 104]]}
# Turn ends that come every few tokens: the 2 tokens the model's greedy decoding of PROMPTS writes most often and the
# 2 its sampling at temperature 1 does (scheduler.generate, 40 tokens each). Fixed here: working them out compiled a
# decode program and inserts of each method without pauses, a third of the file's time.
PAUSE_IDS = (51, 162, 52, 33)
ROW_OF = [{"problem": f"p{i}", "answer": "", "data_source": "scripted"} for i in range(len(PROMPTS))]


def encode(text: str) -> list[int]:
  return [int(word) for word in text.split()]


def decode(tokens) -> str:
  return " ".join(map(str, tokens))


def score(data_source, response, answer):
  return float(len(response.split()))  # the last turn's tokens: a reward that tells turns apart


class Scripted(env_lib.Environment):
  """Answers turn i of an episode with observation i of its problem's script, and ends it when they run out (reason
  "answer") or at `max_turns` ("turns"). `hold`: the problem whose first episode to step waits there until the
  `total` - 1 other episodes it has seen are over (or `timeout_s` passes), recording whether they were."""

  def __init__(self, script, max_turns=8, hold=None, total=0, timeout_s=60.0):
    self.script, self.max_turns, self.score = script, max_turns, score
    self.hold, self.total, self.timeout_s = hold, total, timeout_s
    self.seen, self.held, self.held_until_others_were_over = {}, None, None
    self.lock = threading.Lock()

  def others_over(self, episode) -> bool:
    with self.lock:
      others = [e for e in self.seen.values() if e is not episode]
    return len(others) == self.total - 1 and all(e.done for e in others)

  def wait_for_others(self, episode) -> bool:
    deadline = time.monotonic() + self.timeout_s
    while not self.others_over(episode):
      if time.monotonic() > deadline:
        return False
      time.sleep(0.01)
    return True

  def step_many(self, episodes, turn_texts):
    env_lib.check_step(episodes, turn_texts)
    return [self.step_one(episode, text) for episode, text in zip(episodes, turn_texts)]

  def step_one(self, episode, text):
    with self.lock:
      self.seen[id(episode)] = episode
      hold = episode.problem == self.hold and self.held is None
      self.held = episode if hold else self.held
    if hold:
      self.held_until_others_were_over = self.wait_for_others(episode)
    episode.turns.append(text)
    episode.stats.turns += 1
    observations = self.script[episode.problem]
    turns = episode.stats.turns
    if turns > len(observations) or turns >= self.max_turns:
      return env_lib.finish(episode, "answer" if turns > len(observations) else "turns", score("", text, ""), None, {})
    observation = decode(observations[turns - 1])
    episode.observations.append(observation)
    return env_lib.StepResult(observation, 0.0, False, {})


@pytest.fixture(scope="module")
def model():
  """The tiny preset, fp32, its weights x3: a peaky random model whose greedy tokens vary."""
  base = registry.causal_lm(registry.preset("tiny", dtype=jnp.float32, param_dtype=jnp.float32), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(base)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x * 3.0, state))


@pytest.fixture(scope="module")
def engine(model):
  """4 slots; one prefill bucket (16) and one decode page budget (the top, as the TPU kernel's engine has): a
  program per sampling method and pause variant, not one per budget, for the file's compile time."""
  engine = engine_lib.Engine(model, max_concurrent_decodes=4, max_prefill_length=PREFILL, max_decode_length=DECODE,
                             steps_per_call=8, min_prefill_bucket=16, page_size=PAGE)
  engine.policy = dataclasses.replace(engine.policy, page_budgets=engine.policy.page_budgets[-1:])
  return engine


@pytest.fixture(scope="module")
def params(engine, model):
  return engine.load_params(model)


@pytest.fixture(scope="module")
def pause_ids():
  return list(PAUSE_IDS)


@pytest.fixture(scope="module")
def uncached(engine):
  return uncached_forward.log_probs(engine, ROWS)


def talk(engine, params, pause_ids, env, n=2, **kw):
  return conversation.converse(engine, params, env, PROMPTS, ROW_OF, encode=encode, decode=decode,
                               pause_ids=pause_ids, n=n, **kw)


@pytest.fixture(scope="module", params=[GREEDY, WARM], ids=["greedy", "temperature"])
def scripted(request, engine, params, pause_ids):
  """(method, conversations): 2 samples of each prompt (6 requests on 4 slots) through the scripted environment."""
  return request.param, talk(engine, params, pause_ids, Scripted(SCRIPT), sampling=request.param)


def runs(mask) -> list[tuple[int, int, bool]]:
  """(start, end, is_model) of each run of equal mask values."""
  edges = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
  return [(a, b, bool(mask[a])) for a, b in zip(edges, edges[1:])]


def assert_uncached(uncached, params, prompt, completion, temperature):
  """The model's tokens' recorded log-probs equal the uncached forward's over prompt + response, within 1e-5."""
  lp = uncached(params, list(prompt) + completion.tokens, temperature)
  mine = [i for i, m in enumerate(completion.loss_mask) if m]
  want = [lp[len(prompt) + i - 1, completion.tokens[i]] for i in mine]
  np.testing.assert_allclose(completion.logprobs[mine], want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------


def test_multi_turn_logprobs_equal_one_uncached_forward(scripted, params, uncached):
  method, out = scripted
  assert [(c.completion.prompt_index, c.completion.sample_index) for c in out] == [(p, s) for p in range(3)
                                                                                    for s in range(2)]
  for c in out:
    assert_uncached(uncached, params, PROMPTS[c.completion.prompt_index], c.completion,
                    getattr(method, "temperature", 1.0))
  # Not vacuous: half the conversations or more had an observation, and some had two or more.
  observations = [len(c.episode.observations) for c in out]
  assert sum(o > 0 for o in observations) >= len(out) // 2 and max(observations) >= 2


def test_the_loss_mask_is_zero_on_exactly_the_observations(scripted, pause_ids):
  _, out = scripted
  for c in out:
    completion, episode = c.completion, c.episode
    mask = completion.loss_mask
    assert mask.dtype == np.float32 and set(mask.tolist()) <= {0.0, 1.0} and len(mask) == len(completion.tokens)
    pieces = runs(mask)
    model = [completion.tokens[a:b] for a, b, own in pieces if own]
    inserted = [completion.tokens[a:b] for a, b, own in pieces if not own]
    # The response is the conversation after the prompt: turn, observation, turn, ... (the episode's, in order).
    assert [own for _, _, own in pieces] == [i % 2 == 0 for i in range(len(pieces))]
    assert [decode(t) for t in model] == episode.turns
    assert inserted == SCRIPT[episode.problem][:len(inserted)] and list(map(decode, inserted)) == episode.observations
    assert all(turn[-1] in pause_ids for turn in model[:-1])  # each turn a tool answered closed at its turn end
    assert all((completion.logprobs[a:b] == 0).all() for a, b, own in pieces if not own)
    assert all((completion.logprobs[a:b] < 0).all() for a, b, own in pieces if own)


def test_more_requests_than_slots_all_complete(scripted):
  method, out = scripted
  assert len(out) == 6 > 4  # 4 slots
  assert all(c.episode.done and c.episode.reason in env_lib.REASONS for c in out)
  assert all(c.episode.reward == score("", c.episode.turns[-1], "") for c in out)
  if method is WARM:  # the samples of a prompt differ (their own keys), reproducibly
    assert all(out[2 * p].completion.tokens != out[2 * p + 1].completion.tokens for p in range(3))


def test_a_progress_bar_moves_with_the_tokens_and_ends_full(engine, params, pause_ids):
  """The trainer's bar (an `interface.Progress`) hears the budget (6 conversations x 24 tokens), each conversation's
  tokens as they come (the model's and the observations'), the rest of its budget as it ends, and each end."""

  class Recorder(interface.Progress):
    def __init__(self):
      self.budget, self.told, self.finished = None, [], 0

    def __call__(self):
      self.finished += 1

    def begin(self, budget):
      self.budget = budget

    def tokens(self, count):
      self.told.append(count)

  bar = Recorder()
  out = talk(engine, params, pause_ids, Scripted(SCRIPT), max_new_tokens=24, on_finish=bar)
  assert bar.budget == 6 * 24 and sum(bar.told) == bar.budget and bar.finished == len(out) == 6
  assert all(count > 0 for count in bar.told) and len(bar.told) > 6  # in steps, not one lump per conversation


def test_each_token_runs_through_the_model_once(engine, params, pause_ids, uncached, monkeypatch):
  # One conversation: the prompt is prefilled once, each continuation runs its observation and the pending token
  # (never the prefix before them), and decode feeds each sampled token once: prompt + response - 1 positions.
  fed = {"prefill_batch": 0, "continue_slots": 0, "decode": 0}

  def counting(name, count):
    call = getattr(engine, name)

    def wrapped(*args, **kw):
      result = call(*args, **kw)
      fed[name] += count(args, result)
      return result
    monkeypatch.setattr(engine, name, wrapped)

  counting("prefill_batch", lambda args, _: int(np.sum(args[2])))  # (params, tokens, true lengths)
  real = lambda slots: slots < engine.max_concurrent_decodes  # padding requests target slot B
  counting("continue_slots", lambda args, _: int(np.sum((args[4] + 1)[real(args[2])])))  # (.., slots, tokens, k)
  counting("decode", lambda args, result: int(np.asarray(result[1].emitted).sum()))
  engine.positions_run.clear()
  [c] = conversation.converse(engine, params, Scripted(SCRIPT), [PROMPTS[0]], [ROW_OF[0]], encode=encode,
                              decode=decode, pause_ids=pause_ids)
  tokens, inserted = c.completion.tokens, [encode(o) for o in c.episode.observations]
  assert len(inserted) >= 2  # three turns or more, each after a longer prefix
  assert fed["prefill_batch"] == len(PROMPTS[0]) and fed["continue_slots"] == sum(len(o) + 1 for o in inserted)
  assert sum(fed.values()) == len(PROMPTS[0]) + len(tokens) - 1
  # Padded to their buckets: the prompt's 16, then 16 + 1 a continuation, whatever the prefix it attends to.
  assert engine.positions_run == {"prefill": 16, "continue": 17 * len(inserted)}
  assert_uncached(uncached, params, PROMPTS[0], c.completion, 1.0)


def test_turn_and_row_limits_end_episodes_with_their_reason(engine, params, pause_ids, uncached):
  long_script = {f"p{i}": [[60 + j] * 6 for j in range(10)] for i in range(3)}
  # Two turns at most: each episode ends with its second turn (at its turn end, or cut at the budget), the slot freed
  # for the queued ones.
  out = talk(engine, params, pause_ids, Scripted(long_script, max_turns=2))
  for c in out:
    tokens = c.completion.tokens
    assert c.episode.reason == "turns" and len(c.episode.turns) == 2
    assert [own for _, _, own in runs(c.completion.loss_mask)] == [True, False, True]
    assert c.completion.finish_reason == ("eos" if tokens[-1] in pause_ids else "length")
    assert c.completion.finish_reason == "eos" or len(tokens) == DECODE
  assert {c.completion.finish_reason for c in out} == {"eos", "length"}
  # 20 tokens a response: an observation that leaves no row for the model's next token, or a turn cut at the budget,
  # ends the episode ("tokens", "length"), scored on its last turn, the dropped observation not in the episode.
  out = talk(engine, params, pause_ids, Scripted(long_script), max_new_tokens=20)
  for c in out:
    completion, episode = c.completion, c.episode
    assert episode.reason == "tokens" and completion.finish_reason == "length" and len(completion.tokens) <= 20
    assert len(episode.observations) == len(episode.turns) - 1 == sum(not own for *_, own in runs(completion.loss_mask))
    assert episode.reward == score("", episode.turns[-1], "")
    assert_uncached(uncached, params, PROMPTS[completion.prompt_index], completion, 1.0)
  cut_mid_turn = [c for c in out if len(c.completion.tokens) == 20 and c.completion.tokens[-1] not in pause_ids]
  no_room = [c for c in out if c.completion.tokens[-1] in pause_ids]
  assert cut_mid_turn and no_room  # both ways occur


def test_a_slow_environment_step_holds_only_its_own_slot(engine, params, pause_ids):
  # A first step of prompt 0 waits until the 5 other conversations are over: they decode, turn after turn, meanwhile.
  env = Scripted(SCRIPT, hold="p0", total=6, timeout_s=30.0)
  out = talk(engine, params, pause_ids, env)
  assert env.held_until_others_were_over is True
  others = [c.episode for c in out if c.episode is not env.held]
  assert len(others) == 5 and all(c.episode.done for c in out) and sum(len(e.turns) for e in others) > 5


def test_without_pauses_it_is_generate_bitwise(engine, params, pause_ids):
  # SingleTurn: the response stops at an EOS id or its budget, and is scored once, as today.
  kw = dict(n=2, max_new_tokens=24, sampling=WARM, seed=5, eos_ids=pause_ids[2:])
  want = scheduler.generate(engine, params, PROMPTS, **kw)
  out = conversation.converse(engine, params, env_lib.SingleTurn(score), PROMPTS, ROW_OF, encode=encode,
                              decode=decode, pause_ids=(), **kw)
  assert {c.finish_reason for c in want} == {"eos", "length"}
  for c, w in zip(out, want):
    got = c.completion
    assert (got.prompt_index, got.sample_index, got.tokens, got.finish_reason) == (
        w.prompt_index, w.sample_index, w.tokens, w.finish_reason)
    np.testing.assert_array_equal(got.logprobs, w.logprobs)
    assert got.logprobs.dtype == w.logprobs.dtype and (got.loss_mask == 1).all()
    assert c.episode.turns == [decode(w.tokens)] and c.episode.reward == score("", decode(w.tokens), "")


def test_python_tool_through_the_sandbox(engine, params, pause_ids):
  # Every turn is a program printing the turn's length; its output returns as the tool turn (bytes as tokens), and
  # the second turn, at max_turns, ends the episode.
  template = env_lib.ToolTemplate(turn_end="<e>", before="", after="")  # observations of at most 16 tokens
  to_code = lambda tokens: f"```python\nprint({len(tokens)})\n```"
  with Sandbox(Limits(cpu_seconds=1, wall_seconds=5), max_workers=2) as box:
    env = env_lib.PythonTool(box, score, limits=env_lib.EpisodeLimits(max_turns=2), template=template)
    out = conversation.converse(engine, params, env, PROMPTS[::2], ROW_OF[::2], encode=lambda s: list(s.encode()),
                                decode=to_code, pause_ids=pause_ids, n=2)
  for c in out:
    episode, completion = c.episode, c.completion
    first, inserted, _ = [completion.tokens[a:b] for a, b, _ in runs(completion.loss_mask)]
    assert episode.reason == "turns" and episode.stats.tool_calls == 1 and not any(episode.stats.failures.values())
    assert episode.observations == [f"```output\n{len(first)}\n```"] == [bytes(inserted).decode()]


def test_a_rollout_whose_every_program_loops_forever_ends_within_its_bound(engine, params, pause_ids):
  """Every tool call loops forever: each ends as a counted timeout at the sandbox's limits and the rollout goes on;
  with a sandbox worker for each conversation, it takes at most (max_turns - 1) wall clocks (plus a margin for a
  busy machine) longer than the same rollout whose programs end at once (docs/tools.md)."""
  limits, max_turns, margin = Limits(cpu_seconds=1, wall_seconds=2), 2, 3.0
  template = env_lib.ToolTemplate(turn_end="<e>", before="", after="")
  short = lambda text: list(text.encode())[:8]  # every observation fits

  def timed(code):
    with Sandbox(limits, max_workers=4) as box:
      env = env_lib.PythonTool(box, score, limits=env_lib.EpisodeLimits(max_turns=max_turns), template=template)
      start = time.monotonic()
      out = conversation.converse(engine, params, env, PROMPTS[::2], ROW_OF[::2], encode=short,
                                  decode=lambda tokens: f"```python\n{code}\n```", pause_ids=pause_ids, n=2)
      return out, time.monotonic() - start

  timed("print(1)")  # compiles what the rollout runs
  _, instant = timed("print(1)")
  out, looping = timed("while True: pass")
  assert [c.episode.stats.tool_calls for c in out] == [1] * 4
  assert all(c.episode.stats.failures["timeout"] == 1 and c.episode.reason == "turns" for c in out)
  assert looping < instant + (max_turns - 1) * (limits.wall_seconds + margin), (looping, instant)
