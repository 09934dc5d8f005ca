"""pass@k with the Python tool (issue 43): `evaluate` with `env="python_tool"` samples each response as a
conversation with the tool (the trainer's session: the sandbox, the template's turn end), scores it by its episode
(the reward on the final turn), and records each sample's turns, observations and ending in eval_rollout.jsonl;
eval_summary.json gives the tool-call rate beside pass@k. `--data synthetic/mul53` alone takes the tool demo's
sizes, and an evaluation folder never mixes samples with and without the tool."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from pacs_jax import api
from pacs_jax import config as config_lib
from pacs_jax.data import synthetic_tasks
from pacs_jax.envs import env as env_lib
from pacs_jax.eval import eval_settings, results, runner
from pacs_jax.models import families

TASK = "synthetic/mul53"


def tool_settings(**overrides) -> eval_settings.EvalSettings:
  cfg = eval_settings.eval_config()
  defaults = eval_settings.synthetic_defaults([TASK])
  assert defaults["env.name"] == "python_tool" and eval_settings.synthetic_defaults(["synthetic/mod3"]) == \
      eval_settings.SYNTHETIC_DEFAULTS
  for field, value in {**defaults, "rollout.n": 4, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
                       "env.workers": 1, **overrides}.items():
    config_lib.set_field(cfg, field, value)
  return eval_settings.EvalSettings.from_config(cfg, limit=8)


def test_pass_at_k_with_the_tool(tmp_path):
  tokenizer = synthetic_tasks.build_tokenizer(synthetic_tasks.TOOL_VOCAB)
  config = families.preset("tiny", vocab_size=len(tokenizer), num_hidden_layers=1, hidden_size=32,
                           intermediate_size=64)
  model_dir, out = str(tmp_path / "model"), str(tmp_path / "eval")
  api.save_pretrained(families.causal_lm(config, rngs=nnx.Rngs(0)), model_dir, tokenizer=tokenizer)
  summary = runner.evaluate(model_dir, TASK, tool_settings(), out_dir=out, reward_workers=1, progress=False)

  task = synthetic_tasks.get_task(TASK)
  with open(os.path.join(out, results.ROLLOUT_FILE)) as f:
    lines = [json.loads(line) for line in f]
  samples = [s for line in lines for s in line["rollout"]]
  assert len(lines) == 8 and len(samples) == 32
  for line in lines:
    for s in line["rollout"]:
      turns, observations = s["turns"], s["observations"]
      assert len(turns) - 1 <= len(observations) <= len(turns) <= 3 and s["end_reason"] in env_lib.REASONS
      assert s["output"] == env_lib.conversation_text(turns, observations, env_lib.QWEN25)
      # The episode's reward: the verifier on the final turn alone (an earlier turn's number does not count).
      assert s["score"]["score"] == task.score(turns[-1], line["reward_model"]["ground_truth"])
  called = [bool(s["observations"]) for s in samples]
  assert any(called) and any("```output" in o for s in samples for o in s["observations"])
  entry = summary["sources"][TASK]
  assert entry["tool_call_rate"] == pytest.approx(np.mean(called))
  assert entry["turns_mean"] == pytest.approx(np.mean([len(s["turns"]) for s in samples]))
  assert entry["pass@1"] == pytest.approx(np.mean([s["score"]["score"] > 0.5 for s in samples]))
  assert summary["settings"]["env"] == "python_tool" and summary["settings"]["max_turns"] == 3

  # Run again: nothing is left to sample (the same summary); with another environment the folder is refused.
  again = runner.evaluate(model_dir, TASK, tool_settings(), out_dir=out, reward_workers=1, progress=False)
  assert again["sources"] == summary["sources"]
  with pytest.raises(results.OtherEvaluation, match="env='python_tool', not 'single_turn'"):
    runner.evaluate(model_dir, TASK, tool_settings(**{"env.name": "single_turn"}), out_dir=out, progress=False)


def test_the_env_block_is_checked_by_name():
  with pytest.raises(config_lib.ConfigError, match=r"^config.env.name: must be one of single_turn \| python_tool"):
    tool_settings(**{"env.name": "calculator"})
  with pytest.raises(config_lib.ConfigError, match=r"^config.env.max_turns: "):
    tool_settings(**{"env.max_turns": 0})
