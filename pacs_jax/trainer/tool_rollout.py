"""The trainer's side of tool-integrated rollouts (`env.name` "python_tool", issue 43): the step's conversations
(envs/python_tool.py's session: the run's sandbox, the template's ids) as completions with the episodes' rewards as
scores, validation with the tool, and the step's tools/* metrics.

A response is a conversation: the model's turns and the tool's observations (envs/env.py's QWEN25 template), its
loss mask 0 on the observations; its reward is its episode's (the scorer on the final turn), in place of the
scorer's on the whole text. The single-turn path never comes here.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pacs_jax.envs import env as env_lib
from pacs_jax.envs import python_tool
from pacs_jax.rollout import interface
from pacs_jax.trainer import packing, stages


class ToolRollout(python_tool.ToolSession):
  """The run's `ToolSession` (opened at the run's start, closed at its teardown) with a step's rollout and
  validation."""

  def rollout(self, sampler, scorer, element: dict[str, Any], prompt_ids: list[list[int]], *, n: int,
              max_new_tokens: int, sampling, seed: int, on_finish=None):
    """The step's conversations over the pipeline's element (lists per field): (completions, `stages.Scored` with
    each episode's reward as its score and the conversation's text, the episodes)."""
    completions, texts, episodes, stats = self.scored(sampler, scorer, prompt_ids, env_lib.element_rows(element), n=n,
                                                     max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                                     on_finish=on_finish)
    scores = np.asarray([e.reward for e in episodes], np.float32)
    scored = stages.Scored(texts, [e.answer for e in episodes], [e.data_source for e in episodes], scores, stats)
    return completions, scored, episodes

  def validate(self, sampler, scorer, records: list[dict], prompt_ids: list[list[int]], *, max_new_tokens: int,
               sampling) -> dict[str, float]:
    """Validation with the tool: one greedy conversation per record, its episode's reward per data source."""
    talks = self.converse(sampler, python_tool.LockedScorer(scorer), prompt_ids, records, n=1,
                          max_new_tokens=max_new_tokens, sampling=sampling, seed=0)
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
  records = [python_tool.record(e) for e in episodes]
  return {key: [r[key] for r in records] for key in python_tool.RECORD_KEYS}
