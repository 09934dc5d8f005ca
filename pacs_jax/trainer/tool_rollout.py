"""The trainer's side of tool-integrated rollouts (`env.name` "python_tool", issue 43): the run's sandbox, the step's
environment, its conversations as completions with the episodes' rewards as scores, and the step's tools/* metrics.

A response is a conversation: the model's turns and the tool's observations (envs/env.py's QWEN25 template), its
loss mask 0 on the observations; its reward is its episode's (the scorer on the final turn), in place of the
scorer's on the whole text. The single-turn path never comes here.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from pacs_jax.envs import env as env_lib
from pacs_jax.envs import sandbox as sandbox_lib
from pacs_jax.rollout import interface
from pacs_jax.trainer import packing, stages


class LockedScorer:
  """The run's scorer as the environment's worker threads call it: one `score_batch` at a time (a `RewardScorer`'s
  worker processes serve one batch), its error and timeout counts added up until `take_stats`."""

  def __init__(self, scorer):
    self.scorer, self._lock = scorer, threading.Lock()
    self._stats: dict[str, int] = {"errors": 0, "timeouts": 0}

  def score_batch(self, responses, answers, data_sources):
    with self._lock:
      scores, stats = self.scorer.score_batch(responses, answers, data_sources)
      for key, value in stats.items():
        self._stats[key] = self._stats.get(key, 0) + int(value)
    return scores, stats

  def take_stats(self) -> dict[str, int]:
    with self._lock:
      out, self._stats = self._stats, {"errors": 0, "timeouts": 0}
    return out


def sandbox_limits(env_cfg) -> sandbox_lib.Limits:
  """The `env` block's limits on one program."""
  return sandbox_lib.Limits(cpu_seconds=float(env_cfg.cpu_seconds), wall_seconds=float(env_cfg.wall_seconds),
                            memory_bytes=int(env_cfg.memory_mb) * 2**20, output_bytes=int(env_cfg.output_bytes))


class ToolRollout:
  """A run's conversations with the Python tool: the sandbox (`open` at the run's start, `close` at its teardown),
  the token ids a turn pauses at (the template's turn end) and those a response stops at for good (the run's other
  stop ids), and the text <-> token functions the environment sees the turns through."""

  def __init__(self, env_cfg, tokenizer, eos_ids: Sequence[int], template: env_lib.ToolTemplate = env_lib.QWEN25):
    turn_end = tokenizer.convert_tokens_to_ids(template.turn_end)
    if turn_end is None or turn_end == tokenizer.unk_token_id:
      raise ValueError(f"env.name={env_cfg.name!r}: the tokenizer has no {template.turn_end!r} token to end a turn")
    self.pause_ids = (int(turn_end),)
    self.eos_ids = tuple(int(e) for e in eos_ids if int(e) not in self.pause_ids)
    self.limits, self.max_turns, self.workers = sandbox_limits(env_cfg), int(env_cfg.max_turns), int(env_cfg.workers)
    self.tokenizer, self.template = tokenizer, template
    self.sandbox: sandbox_lib.Sandbox | None = None

  def open(self) -> None:
    if self.sandbox is None:
      self.sandbox = sandbox_lib.Sandbox(self.limits, max_workers=self.workers)

  def close(self) -> None:
    if self.sandbox is not None:
      self.sandbox.close()
      self.sandbox = None

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode(self, tokens) -> str:
    return self.tokenizer.decode(tokens, skip_special_tokens=True)

  def converse(self, sampler, scorer: LockedScorer, prompt_ids: list[list[int]], rows: list[dict], *, n: int,
               max_new_tokens: int, sampling, seed: int, on_finish=None) -> list[Any]:
    """`n` conversations per prompt by the weights `sampler` holds (an `interface.Conversing` rollout); `on_finish`
    a progress bar's (`interface.Progress`)."""
    if self.sandbox is None:
      raise RuntimeError("ToolRollout.converse before open(): the run's sandbox is not open")
    if not interface.runs_conversations(sampler):
      raise ValueError(f"{type(sampler).__name__} runs no conversations (no `converse`): env.name python_tool "
                       "needs rollout.engine 'local'")
    env = env_lib.PythonTool(self.sandbox, scorer, limits=env_lib.EpisodeLimits(max_turns=self.max_turns),
                             template=self.template)
    return sampler.converse(prompt_ids, rows, env, encode=self.encode, decode=self.decode, pause_ids=self.pause_ids,
                            eos_ids=self.eos_ids, n=n, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                            env_workers=self.workers, on_finish=on_finish)

  def rollout(self, sampler, scorer, element: dict[str, Any], prompt_ids: list[list[int]], *, n: int,
              max_new_tokens: int, sampling, seed: int, on_finish=None):
    """The step's conversations over the pipeline's element (lists per field): (completions, `stages.Scored` with
    each episode's reward as its score and the conversation's text, the episodes)."""
    locked = LockedScorer(scorer)
    talks = self.converse(sampler, locked, prompt_ids, env_lib.element_rows(element), n=n,
                          max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, on_finish=on_finish)
    episodes = [t.episode for t in talks]
    texts = [env_lib.conversation_text(e.turns, e.observations, self.template) for e in episodes]
    scores = np.asarray([e.reward for e in episodes], np.float32)
    scored = stages.Scored(texts, [e.answer for e in episodes], [e.data_source for e in episodes], scores,
                           locked.take_stats())
    return [t.completion for t in talks], scored, episodes

  def validate(self, sampler, scorer, records: list[dict], prompt_ids: list[list[int]], *, max_new_tokens: int,
               sampling) -> dict[str, float]:
    """Validation with the tool: one greedy conversation per record, its episode's reward per data source."""
    talks = self.converse(sampler, LockedScorer(scorer), prompt_ids, records, n=1, max_new_tokens=max_new_tokens,
                          sampling=sampling, seed=0)
    episodes = [t.episode for t in talks]
    out = packing.per_source_mean([e.reward for e in episodes], [e.data_source for e in episodes], "val/accuracy")
    out.update({f"val/{k}": v for k, v in metrics(episodes, [t.completion for t in talks]).items()})
    return out


def metrics(episodes: Sequence[env_lib.Episode], completions: Sequence[interface.Completion]) -> dict[str, float]:
  """A step's tool metrics over its conversations (`env_lib.summarize`'s): model turns and tool calls per response,
  the share of responses that called the tool, tool failures by kind and endings by reason (counts), the
  observation tokens per response (inserted tokens, loss mask 0, as they went into the rows), and the share of
  solved responses (reward > 0) that called the tool."""
  s = env_lib.summarize(episodes)
  inserted = [float(np.sum(np.asarray(c.loss_mask) == 0)) for c in completions]
  row = {"tools/turns_mean": s["env/turns"], "tools/calls_mean": s["env/tool_calls"],
         "tools/call_rate": s["env/tool_call_rate"],
         "tools/observation_tokens_mean": float(np.mean(inserted)) if inserted else 0.0,
         "tools/solved_with_tool": s["env/solved_with_tool"]}
  row.update({f"tools/failures/{kind}": s[f"env/tool_failures/{kind}"] for kind in env_lib.FAILURE_KINDS})
  row.update({f"tools/end/{reason}": s[f"env/end/{reason}"] for reason in env_lib.REASONS})
  return row


def dump_fields(episodes: Sequence[env_lib.Episode]) -> dict[str, list]:
  """The rollout dump's extra columns of conversations: each one's model turns, observations and ending."""
  return {"turns": [list(e.turns) for e in episodes], "observations": [list(e.observations) for e in episodes],
          "end_reason": [e.reason for e in episodes]}
