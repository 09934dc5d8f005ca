"""Conversations with the Python tool (`env.name` "python_tool", docs/tools.md) as a training run and an evaluation
hold them: the sandbox's lifetime, the turn-end and stop ids, the text <-> token functions, and `converse` over a
rollout that runs conversations; `LockedScorer`, the reward scorer as the environment's worker threads call it."""

from __future__ import annotations

import threading
from typing import Any, Sequence

from pacs_jax.envs import env as env_lib
from pacs_jax.envs import sandbox as sandbox_lib


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


class ToolSession:
  """Conversations with the Python tool, as a training run or an evaluation holds them: the sandbox (`open` at the
  start, `close` at the end, whatever ends it), the token ids a turn pauses at (the template's turn end) and those a
  response stops at for good (the other stop ids), and the text <-> token functions the environment sees the turns
  through."""

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
               max_new_tokens: int, sampling, seed: int, seed_ids: Sequence[int] | None = None,
               on_finish=None) -> list[Any]:
    """`n` conversations per prompt by the weights `sampler` holds (a rollout with `converse`: rollout/interface.py's
    `Conversing`); `seed_ids`: each prompt's id in the randomness (the rollout's `prompt_ids`; default its
    position); `on_finish` a progress bar's (`interface.Progress`)."""
    if self.sandbox is None:
      raise RuntimeError("ToolSession.converse before open(): the sandbox is not open")
    if not callable(getattr(sampler, "converse", None)):  # (rollout/interface.py's `runs_conversations`)
      raise ValueError(f"{type(sampler).__name__} runs no conversations (no `converse`): env.name python_tool "
                       "needs rollout.engine 'local'")
    env = env_lib.PythonTool(self.sandbox, scorer, limits=env_lib.EpisodeLimits(max_turns=self.max_turns),
                             template=self.template)
    return sampler.converse(prompt_ids, rows, env, encode=self.encode, decode=self.decode, pause_ids=self.pause_ids,
                            eos_ids=self.eos_ids, n=n, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                            prompt_ids=seed_ids, env_workers=self.workers, on_finish=on_finish)

  def scored(self, sampler, scorer, prompt_ids: list[list[int]], rows: list[dict], **kwargs):
    """`converse` (its keyword arguments) with the run's scorer behind a `LockedScorer`: (completions, each
    conversation's text, its episode (reward, turns, ...), the scorer's error and timeout counts)."""
    locked = LockedScorer(scorer)
    talks = self.converse(sampler, locked, prompt_ids, rows, **kwargs)
    episodes = [t.episode for t in talks]
    texts = [env_lib.conversation_text(e.turns, e.observations, self.template) for e in episodes]
    return [t.completion for t in talks], texts, episodes, locked.take_stats()


# A conversation's record beside its text (rollout dumps, evaluation samples): the model's turns, the tool's
# observations, and why it ended (env_lib.REASONS).
RECORD_KEYS = ("turns", "observations", "end_reason")


def record(episode: env_lib.Episode) -> dict[str, Any]:
  return dict(zip(RECORD_KEYS, (list(episode.turns), list(episode.observations), episode.reason)))
