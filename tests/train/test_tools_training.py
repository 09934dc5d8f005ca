"""Training with a tool (env.name "python_tool", issue 43): the tool demo (configs/tiny_tools_cpu.py) trains two
steps in-process, its responses conversations whose observations reach the batch with loss mask 0, its losses
finite and its tools/* metrics in each row; the modes a conversation rollout does not run in are refused in one
line."""

import glob
import json
import math
import os

import jax
import numpy as np
import pytest

from pacs_jax import config as config_lib
from pacs_jax.data import synthetic_tasks
from pacs_jax.envs import env as env_lib
from pacs_jax.envs import sandbox as sandbox_lib
from pacs_jax.services.metrics import METRICS_FILE, read_rows
from pacs_jax.rollout.interface import Completion
from pacs_jax.trainer import build, loop, packing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "configs", "tiny_tools_cpu.py")
TOOL_WORDS = {w: synthetic_tasks.TOOL_VOCAB.index(w) for w in synthetic_tasks.TOOL_WORDS}


def tools_config(**overrides):
  # The random init (no warm-up): it calls the tool in a fifth to a third of its responses, syntax errors and all,
  # so two steps hold observations of every kind it meets; the warmed-up base calls in a few percent.
  base = {"steps": 2, "eval_every": 2, "data.synthetic_val_size": 8, "train.batch_prompts": 8,
          "train.mini_batch_prompts": 4, "checkpoint.async_save": False, "reward_workers": 1, "mesh.fsdp": 2,
          "model.warmup": ""}
  return config_lib.load_config_file(TOOLS, {**base, **overrides})


def test_the_tool_demo_trains_two_steps_with_observations_masked(tmp_path, monkeypatch):
  batches = []
  update = loop.Trainer.update

  def recording_update(self, packed):
    batches.append(packed)
    return update(self, packed)

  monkeypatch.setattr(loop.Trainer, "update", recording_update)
  dump = str(tmp_path / "dump")
  trainer = loop.Trainer(tools_config(rollout_data_dir=dump), str(tmp_path / "run"), devices=jax.devices()[:2])
  trainer.run()
  assert trainer.tools.sandbox is None  # the run's sandbox is closed at its end
  rows = [r for r in read_rows(os.path.join(tmp_path / "run", METRICS_FILE)) if r["step"] > 0]
  assert [r["step"] for r in rows] == [1, 2]

  inserted_total, inserted_ids, calls_total = 0, set(), 0.0
  for packed, row in zip(batches, rows):
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["skipped_updates"] == 0, row
    P = packed.input_ids.shape[1] - packed.response_mask.shape[1]
    inserted = (packed.response_mask > 0) & (packed.loss_mask == 0)  # [rows, R]: in the response, out of the loss
    assert np.all(packed.loss_mask <= packed.response_mask)
    inserted_ids |= set(packed.input_ids[:, P:][inserted].tolist())
    per_row = inserted.sum(-1)
    np.testing.assert_allclose(row["tools/observation_tokens_mean"], per_row.mean(), rtol=1e-6)
    inserted_total += int(per_row.sum())
    # The sane ranges of the tool metrics.
    calls_total += row["tools/calls_mean"]
    assert 1 <= row["tools/turns_mean"] <= 3
    assert row["tools/turns_mean"] <= 1 + row["tools/calls_mean"] + 1e-6
    assert 0 <= row["tools/call_rate"] <= 1 and 0 <= row["tools/solved_with_tool"] <= 1
    calls = row["tools/calls_mean"] * packed.input_ids.shape[0]
    assert sum(row[f"tools/failures/{kind}"] for kind in env_lib.FAILURE_KINDS) <= calls + 1e-6
    ends = sum(row[f"tools/end/{reason}"] for reason in env_lib.REASONS)
    assert ends == packed.input_ids.shape[0]
    assert math.isfinite(row["reward/mean"]) and 0 <= row["reward/mean"] <= 1
  # The random policy calls the tool now and then; what the tool returned went in as the tool's turn.
  assert calls_total > 0 and inserted_total > 0
  assert inserted_ids >= {TOOL_WORDS["<tool_response>"], TOOL_WORDS["</tool_response>"], TOOL_WORDS["```output"]}
  assert "val/accuracy/synthetic/mul53" in rows[-1] and "val/tools/calls_mean" in rows[-1]
  # The rollout dump records each conversation's turns, observations (one fewer or as many) and ending.
  lines = [json.loads(line) for path in sorted(glob.glob(os.path.join(dump, "*.jsonl"))) for line in open(path)]
  assert len(lines) == sum(p.input_ids.shape[0] for p in batches)
  assert all(len(x["turns"]) - 1 <= len(x["observations"]) <= len(x["turns"]) for x in lines)
  assert all(x["end_reason"] in env_lib.REASONS for x in lines)
  assert any(x["observations"] for x in lines)


def test_the_tool_task_call_runs_in_the_sandbox_and_its_observation_is_all_known_words():
  """One call of the tool task's tokenizer decodes to a program that prints the answer, and its observation
  encodes without <unk>; the first 64 ids are the demo's."""
  tokenizer = build.load_tokenizer(tools_config())
  assert synthetic_tasks.TOOL_VOCAB[:64] == synthetic_tasks.VOCAB
  [record] = synthetic_tasks.get_task("synthetic/mul53").records(1, seed=0)
  a, _, b, _, m = record["problem"].split()
  call = [synthetic_tasks.TOOL_OPEN, a, "*", b, "%", m, synthetic_tasks.TOOL_CLOSE, synthetic_tasks.IM_END]
  turn = tokenizer.decode(tokenizer.convert_tokens_to_ids(call), skip_special_tokens=True)
  result = sandbox_lib.run_program(sandbox_lib.extract_code(turn))
  assert (result.kind, result.output) == ("ok", record["answer"] + "\n")
  observation = env_lib.QWEN25.observation(sandbox_lib.format_observation(result).removesuffix("\n"))
  ids = tokenizer.encode(observation, add_special_tokens=False)
  assert tokenizer.unk_token_id not in ids and record["answer"] in tokenizer.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("overrides, field, why", [
    ({"rollout.mode": "one_step_off"}, "rollout.mode", "runs with 'sync' only"),
    ({"rollout.mode": "async"}, "rollout.mode", "runs with 'sync' only"),
    ({"rollout.devices": 1}, "rollout.devices", "shared devices only"),
    ({"algorithm": "dapo"}, "env.name", "samples dynamically"),  # filter_groups: refills
    ({"env.name": "calculator"}, "env.name", "must be one of single_turn | python_tool"),
    ({"env.max_turns": 0}, "env.max_turns", "must be an integer >= 1"),
    ({"env.cpu_seconds": 0.0}, "env.cpu_seconds", "must be positive"),
])
def test_modes_a_conversation_does_not_run_in_are_refused_in_one_line(overrides, field, why):
  with pytest.raises(config_lib.ConfigError) as raised:
    config_lib.validate(tools_config(**overrides), num_devices=8)
  message = str(raised.value)
  assert message.startswith(f"config.{field}: ") and why in message and "\n" not in message, message


def test_more_than_one_process_is_refused():
  with pytest.raises(config_lib.ConfigError, match=r"^config.env.name: .*runs on one process"):
    config_lib.validate(tools_config(), num_devices=8, num_processes=2)


def test_a_conversation_row_is_masked_over_its_whole_response_and_out_of_the_loss_on_its_observations():
  """`whole_responses`: the response mask runs over every token of a conversation, the turn ends inside it
  included (the released rule would end it at the first), and the loss mask takes out the inserted tokens."""
  end, pad = 2, 0
  turns = Completion(0, 0, [40, 41, end, 7, 8, 9, 42, end], np.zeros(8, np.float32), "eos",
                     loss_mask=np.array([1, 1, 1, 0, 0, 0, 1, 1], np.float32))
  short = Completion(0, 1, [43, end], np.zeros(2, np.float32), "eos")
  _, attention, mask = packing.pack_rows([[5, 6]], [turns, short], 3, 10, pad, [end], whole_responses=True)
  np.testing.assert_array_equal(mask, [[1] * 8 + [0] * 2, [1] * 2 + [0] * 8])
  np.testing.assert_array_equal(attention[:, 3:], mask)
  np.testing.assert_array_equal(packing.loss_mask([turns, short], mask),
                                [[1, 1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1] + [0] * 8])
  _, _, released = packing.pack_rows([[5, 6]], [turns, short], 3, 10, pad, [end])
  np.testing.assert_array_equal(released[0], [1] * 3 + [0] * 7)  # what the single-turn rule would train on
