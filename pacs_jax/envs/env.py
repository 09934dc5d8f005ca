"""Conversation environments of tool-integrated RL (issue 43): an episode starts from a data row, takes the model's
turns one at a time and answers each with an observation, a reward and whether it is over. `SingleTurn` is today's
task; `PythonTool` runs a turn's ```python``` block in the sandbox (envs/sandbox.py) and returns how it ended as the
chat template's tool turn. No JAX here: the rollout drives an environment with text."""

from __future__ import annotations

import abc
import collections
import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from pacs_jax.envs import sandbox as sandbox_lib
from pacs_jax.rewards import pool

REASONS = ("answer", "turns", "tokens")  # why an episode ended (info["reason"], Episode.reason)
FAILURE_KINDS = tuple(kind for kind in sandbox_lib.KINDS if kind != "ok")
ROW_FIELDS = ("problem", "answer", "data_source")  # of a record (data/sources.py) and of a pipeline element

# A reward function shaped like `pacs_jax.rewards.math.checked_score_for`: (data_source, response, ground truth) ->
# score, or (score, error or None); or anything with `score_batch` (a `RewardScorer`: worker processes, timeouts).
Score = Callable[[str, str, str], Any]


@dataclasses.dataclass(frozen=True)
class ToolTemplate:
  """How a tool's output enters the conversation, as the chat template renders a message of role "tool" after an
  assistant turn, with the generation prompt of the model's next turn after it.

  The default is Qwen2.5's template (tokenizer_config.json of the Qwen2.5 models; Qwen3's renders role "tool" the
  same way): `<|im_start|>assistant\\n{turn}<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{content}\\n
  </tool_response><|im_end|>\\n<|im_start|>assistant\\n`. The model writes `turn_end` (its stop token, `<|im_end|>`)
  to close its turn; everything after it, from the newline on, is inserted: `before` + content + `after`."""
  turn_end: str = "<|im_end|>"
  before: str = "\n<|im_start|>user\n<tool_response>\n"
  after: str = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

  def observation(self, content: str) -> str:
    """The text inserted after the model's turn: the tool turn holding `content`, then the next turn's opening."""
    return f"{self.before}{content}{self.after}"

  def closed_turn(self, turn_text: str) -> str:
    """A model turn that a tool turn follows, closed by its stop token (decoded text usually lacks it)."""
    return turn_text if turn_text.endswith(self.turn_end) else turn_text + self.turn_end


QWEN25 = ToolTemplate()


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """When a conversation ends without an answer. `max_turns`: the model's turns; `max_tokens`: the conversation's
  tokens after the prompt (model turns and observations: what its response row must hold), counted by the
  environment's `count_tokens`; None: no token limit."""
  max_turns: int = 4
  max_tokens: int | None = None

  def __post_init__(self):
    if self.max_turns <= 0 or self.max_tokens is not None and self.max_tokens <= 0:
      raise ValueError(f"max_turns ({self.max_turns}) and max_tokens ({self.max_tokens}) must be positive")


@dataclasses.dataclass
class EpisodeStats:
  """What an episode did, for the loop's metrics (`summarize`). `failures`: tool calls by sandbox kind, "ok" left
  out; `observation_tokens` and `tokens` stay 0 without a token counter."""
  turns: int = 0
  tool_calls: int = 0
  failures: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))
  observation_chars: int = 0
  observation_tokens: int = 0
  tokens: int = 0  # the conversation's after the prompt: model turns and observations


@dataclasses.dataclass
class Episode:
  """One conversation: its row's problem, ground truth and data source, the model's turns and the observations
  inserted after them (observations[i] follows turns[i]; the last turn has none), and how it ended."""
  problem: str
  answer: str
  data_source: str
  turns: list[str] = dataclasses.field(default_factory=list)
  observations: list[str] = dataclasses.field(default_factory=list)
  stats: EpisodeStats = dataclasses.field(default_factory=EpisodeStats)
  done: bool = False
  reward: float = 0.0
  reason: str | None = None  # one of REASONS once done


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What answers a turn: the text to insert before the model's next turn (None when done), the reward (0.0 until
  done), whether the episode is over, and `info` (reason, tool kind, counts so far, the scorer's error)."""
  observation: str | None
  reward: float
  done: bool
  info: dict[str, Any]


def episode_from_row(row: Mapping[str, Any]) -> Episode:
  """A fresh episode of a record `{data_source, problem, answer}` (data/sources.py); other fields are ignored."""
  missing = [name for name in ROW_FIELDS if name not in row]
  if missing:
    raise KeyError(f"a row needs {ROW_FIELDS}; this one lacks {missing}")
  return Episode(problem=row["problem"], answer=row["answer"], data_source=row["data_source"])


def element_rows(element: Mapping[str, Sequence]) -> list[dict[str, Any]]:
  """The rows of a pipeline element (data/pipeline.py: lists per field), one per prompt, in order."""
  return [dict(zip(ROW_FIELDS, values)) for values in zip(*(element[name] for name in ROW_FIELDS))]


def segments(turns: Sequence[str], observations: Sequence[str],
             template: ToolTemplate = QWEN25) -> list[tuple[str, bool]]:
  """The conversation after the prompt as (text, is_model) pieces in order: each model turn (closed by its stop
  token where an observation follows) and each observation (inserted, not the model's): what a loss mask is made
  of, 1 on the model's tokens and 0 on the rest."""
  if not len(turns) - 1 <= len(observations) <= len(turns):
    raise ValueError(f"{len(turns)} turns cannot have {len(observations)} observations")
  out = []
  for i, turn in enumerate(turns):
    if i < len(observations):
      out += [(template.closed_turn(turn), True), (observations[i], False)]
    else:
      out.append((turn, True))
  return out


def conversation_text(turns: Sequence[str], observations: Sequence[str], template: ToolTemplate = QWEN25) -> str:
  """The conversation after the prompt as one text, as the chat template renders it."""
  return "".join(text for text, _ in segments(turns, observations, template))


def score_all(score: Score | Any, items: Sequence[tuple[str, str, str]]) -> list[tuple[float, str | None]]:
  """(reward, error or None) of each (data_source, response, ground truth), as the trainer's scoring gives it: a
  scorer with `score_batch` scores them in one batch (its workers and timeouts); a function is called here, its
  result read as the worker pool reads it (`pool.checked_call`). Rewards are float32 values, as the trainer's."""
  if not items:
    return []
  if hasattr(score, "score_batch"):
    data_sources, responses, answers = map(list, zip(*items))
    scores, _ = score.score_batch(responses, answers, data_sources)
    return [(float(s), None) for s in np.asarray(scores, np.float32)]
  results = [pool.checked_call(score, item) for item in items]
  return [(float(np.float32(value)), error) for value, error in results]


def finish(episode: Episode, reason: str, reward: float, error: str | None, info: dict[str, Any]) -> StepResult:
  """Ends `episode` with `reward` and the reason it ended."""
  episode.done, episode.reward, episode.reason = True, reward, reason
  info = {**info, "reason": reason, "reward": reward}
  if error is not None:
    info["score_error"] = error
  return StepResult(None, reward, True, info)


def counts(episode: Episode) -> dict[str, Any]:
  """An episode's counts so far, for a step's info: turns, tool calls, tokens, tool failures by kind (non-zero)."""
  stats = episode.stats
  return {"turns": stats.turns, "tool_calls": stats.tool_calls, "tokens": stats.tokens,
          "failures": {kind: n for kind, n in stats.failures.items() if n}}


def summarize(episodes: Sequence[Episode]) -> dict[str, float]:
  """A loop's metrics over finished episodes: means per episode of turns, tool calls and observation tokens and
  characters; the share of episodes that called the tool; tool failures by kind and endings by reason (counts);
  the share of solved episodes (reward > 0) that called the tool (0.0 when none was solved)."""
  n = max(len(episodes), 1)
  used = [e.stats.tool_calls > 0 for e in episodes]
  solved = [u for e, u in zip(episodes, used) if e.reward > 0]
  metrics = {
      "env/turns": sum(e.stats.turns for e in episodes) / n,
      "env/tool_calls": sum(e.stats.tool_calls for e in episodes) / n,
      "env/tool_call_rate": sum(used) / n,
      "env/observation_tokens": sum(e.stats.observation_tokens for e in episodes) / n,
      "env/observation_chars": sum(e.stats.observation_chars for e in episodes) / n,
      "env/solved_with_tool": sum(solved) / len(solved) if solved else 0.0,
  }
  metrics.update({f"env/tool_failures/{kind}": float(sum(e.stats.failures[kind] for e in episodes))
                  for kind in FAILURE_KINDS})
  reasons = collections.Counter(e.reason for e in episodes)
  metrics.update({f"env/end/{reason}": float(reasons[reason]) for reason in REASONS})
  return metrics


class Environment(abc.ABC):
  """Answers the model's turns of many episodes. `reset(row)` starts one; `step(episode, turn_text)` takes the
  model's next turn (its decoded text, as today's path decodes a response: special tokens skipped) and records it
  and the answer in the episode; `step_many` steps many episodes at once (one turn each), so that their slow parts
  (tools, scoring) run together. Stepping a finished episode is an error."""

  def reset(self, row: Mapping[str, Any]) -> Episode:
    return episode_from_row(row)

  def step(self, episode: Episode, turn_text: str) -> StepResult:
    return self.step_many([episode], [turn_text])[0]

  @abc.abstractmethod
  def step_many(self, episodes: Sequence[Episode], turn_texts: Sequence[str]) -> list[StepResult]:
    """One StepResult per episode, in order."""

  def end(self, episode: Episode, result: StepResult, reason: str) -> None:
    """Ends an episode this environment would go on with (`result`: its last step's) but the rollout cannot (the
    observation has no room in the response, or the response stopped for good), as `PythonTool` ends one past its
    token limit: the observation that step added is dropped (with the characters and tokens counted for it) and the
    reward is the environment's scorer on the last turn (`self.score`; without one 0.0, its error says so)."""
    stats = episode.stats
    if result.observation is not None and episode.observations[-1:] == [result.observation]:
      episode.observations.pop()
      counted = int(result.info.get("observation_tokens", 0))
      stats.observation_chars = max(0, stats.observation_chars - len(result.observation))
      stats.observation_tokens = max(0, stats.observation_tokens - counted)
      stats.tokens = max(0, stats.tokens - counted)
    score = getattr(self, "score", None)
    if score is None:
      reward, error = 0.0, f"{type(self).__name__} has no scorer (`score`) for a conversation ended by the rollout"
    else:
      [(reward, error)] = score_all(score, [(episode.data_source, episode.turns[-1], episode.answer)])
    finish(episode, reason, reward, error, {**result.info, **counts(episode)})


def check_step(episodes: Sequence[Episode], turn_texts: Sequence[str]):
  if len(episodes) != len(turn_texts):
    raise ValueError(f"{len(episodes)} episodes, {len(turn_texts)} turns")
  if len({id(e) for e in episodes}) != len(episodes):
    raise ValueError("an episode appears twice in one step")
  if any(e.done for e in episodes):
    raise ValueError("an episode is over: reset a new one")


class SingleTurn(Environment):
  """Today's task: one turn, over at once, its reward the run's scorer on the turn's text; the same value today's
  scoring gives the same text (`score`: the run's reward function, or its `RewardScorer`)."""

  def __init__(self, score: Score | Any):
    self.score = score

  def step_many(self, episodes: Sequence[Episode], turn_texts: Sequence[str]) -> list[StepResult]:
    check_step(episodes, turn_texts)
    scored = score_all(self.score, [(e.data_source, text, e.answer) for e, text in zip(episodes, turn_texts)])
    out = []
    for episode, text, (reward, error) in zip(episodes, turn_texts, scored):
      episode.turns.append(text)
      episode.stats.turns += 1
      out.append(finish(episode, "answer", reward, error, counts(episode)))
    return out


class PythonTool(Environment):
  """Tool-integrated reasoning: a turn whose last closed ```python``` block holds code calls the tool. The code runs
  in `sandbox` (shared by many episodes; `step_many` submits every episode's code before it waits for any) and
  `sandbox.format_observation` of how it ended returns as `template`'s tool turn; a failed run (error, timeout,
  memory, output, forbidden, killed) is an observation like any other, counted by kind, and the episode goes on.

  A turn without a code block is the final answer: the episode ends, scored on that turn alone. The final turn is
  the answer by definition, and the released verifier (math-verify) reads the rightmost \\boxed{} (its first
  choice) of the text: when the final turn holds the boxed answer, scoring it or the model's turns joined gives
  the same reward, and where they differ (the final turn has no boxed answer, an earlier turn has one) the model
  should not be paid for an answer it moved past. The synthetic tasks' verifier reads the response's first word,
  which in joined turns would be the first turn's; and a shorter text is quicker to parse.

  Limits (`limits`): a turn that holds code ends the episode instead of running it when it is the `max_turns`-th
  (reason "turns") or when the conversation would then hold `max_tokens` tokens or more, its stop token counted
  (reason "tokens"); an observation that would fill the conversation to `max_tokens` ends it too (the tool ran,
  its output is dropped). Either way the reward is the scorer's on the last turn. Tokens are counted by
  `count_tokens(text)` (e.g. `lambda s: len(tokenizer.encode(s))`), required with `max_tokens`; with it, the
  observation tokens are counted too."""

  def __init__(self, sandbox: sandbox_lib.Sandbox, score: Score | Any, *, limits: EpisodeLimits = EpisodeLimits(),
               count_tokens: Callable[[str], int] | None = None, template: ToolTemplate = QWEN25):
    if limits.max_tokens is not None and count_tokens is None:
      raise ValueError("a token limit needs count_tokens (e.g. lambda text: len(tokenizer.encode(text)))")
    self.sandbox, self.score, self.limits, self.template = sandbox, score, limits, template
    self._count = count_tokens

  def count(self, text: str) -> int:
    return self._count(text) if self._count is not None else 0

  def over_tokens(self, tokens: int) -> bool:
    return self.limits.max_tokens is not None and tokens >= self.limits.max_tokens

  def step_many(self, episodes: Sequence[Episode], turn_texts: Sequence[str]) -> list[StepResult]:
    check_step(episodes, turn_texts)
    ending: dict[int, str] = {}  # episode's position -> why it ends at this turn
    running: dict[int, tuple[Any, int]] = {}  # position -> (the sandbox's future of its code, the turn's tokens)
    for i, (episode, text) in enumerate(zip(episodes, turn_texts)):
      episode.turns.append(text)
      episode.stats.turns += 1
      code = sandbox_lib.extract_code(text)
      turn_tokens = self.count(self.template.closed_turn(text)) if code is not None else 0
      if code is None:
        ending[i] = "answer"
      elif episode.stats.turns >= self.limits.max_turns:
        ending[i] = "turns"
      elif self.over_tokens(episode.stats.tokens + turn_tokens):
        ending[i] = "tokens"
      else:
        running[i] = self.sandbox.submit(code), turn_tokens
    out: dict[int, StepResult] = {}
    tool_info: dict[int, dict[str, Any]] = {}
    for i, (future, turn_tokens) in running.items():
      observation, tool_info[i] = self.observe(episodes[i], future.result(), turn_tokens)
      if observation is None:
        ending[i] = "tokens"
      else:
        out[i] = StepResult(observation, 0.0, False, {**tool_info[i], **counts(episodes[i])})
    last = sorted(ending)
    scored = score_all(self.score, [(episodes[i].data_source, turn_texts[i], episodes[i].answer) for i in last])
    for i, (reward, error) in zip(last, scored):
      episodes[i].stats.tokens += self.count(turn_texts[i])
      out[i] = finish(episodes[i], ending[i], reward, error, {**tool_info.get(i, {}), **counts(episodes[i])})
    return [out[i] for i in range(len(episodes))]

  def observe(self, episode: Episode, result: sandbox_lib.Result, turn_tokens: int) -> tuple[str | None, dict]:
    """Counts the tool call; (its observation, or None when that does not fit the token limit, and its info)."""
    stats = episode.stats
    stats.tool_calls += 1
    if result.kind != "ok":
      stats.failures[result.kind] += 1
    observation = self.template.observation(sandbox_lib.format_observation(result).removesuffix("\n"))
    observation_tokens = self.count(observation)
    info = {"tool": result.kind, "tool_seconds": result.seconds, "observation_tokens": observation_tokens}
    if self.over_tokens(stats.tokens + turn_tokens + observation_tokens):
      return None, info
    episode.observations.append(observation)
    stats.tokens += turn_tokens + observation_tokens
    stats.observation_chars += len(observation)
    stats.observation_tokens += observation_tokens
    return observation, info

