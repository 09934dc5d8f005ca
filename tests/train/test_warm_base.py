"""`model.warmup` (trainer/warmup.py): the tool demo's base is taught conversations exactly as the tool rollout
holds them, is built once into <workdir>/base_model and then loaded as a plain model path; a bad setting is one
line."""

import dataclasses
import json

import pytest

from pacs_jax import config as config_lib
from pacs_jax.config import files as config_files
from pacs_jax.data import prompts, synthetic_tasks
from pacs_jax.envs import env as env_lib
from pacs_jax.envs import sandbox
from pacs_jax.trainer import warm_base as warmup


@pytest.fixture(scope="module")
def tokenizer():
  return synthetic_tasks.build_tokenizer(synthetic_tasks.TOOL_VOCAB)


def tool_config(**fields):
  c = config_lib.default_config()
  c.model.vocab_size, c.tokenizer = len(synthetic_tasks.TOOL_VOCAB), "synthetic_tools"
  c.model.warmup = "mul53_tools"
  for name, value in fields.items():
    config_files.set_field(c, name, value)
  return c


def test_a_call_row_is_the_conversation_the_rollout_holds_and_only_the_models_tokens_are_targets(tokenizer):
  settings = warmup.ToolWarmup(task_call_rate=0.5)
  rows = warmup.tool_rows(tokenizer, settings, 64)
  records = synthetic_tasks.get_task("mul53").records(64, settings.data_seed)
  end = tokenizer.convert_tokens_to_ids(synthetic_tasks.IM_END)
  forms = {"call": 0, "guess": 0}
  for (ids, targets), record in zip(rows, records):
    a, _, b, _, m = record["problem"].split()
    own, sisters = (list(p) for p in prompts.encode_prompts(tokenizer, [record["problem"], f"{a} * {b} % {m}"], None))
    sister = ids[:len(sisters)] == sisters
    prompt = sisters if sister else own
    assert ids[:len(prompt)] == prompt and not any(targets[:len(prompt)])
    if len(ids) - len(prompt) == 2:  # a guess: a residue and the end
      forms["guess"] += 1
      assert not sister and ids[-1] == end and targets[len(prompt):] == [1, 1]
      continue
    forms["call"] += 1
    # The rollout's tokens: the model's turn (sampled words: the call's opening and closing are one word each), its
    # stop token, the observation's text encoded, the answer and the end.
    turn = [tokenizer.convert_tokens_to_ids(w) for w in (synthetic_tasks.TOOL_OPEN, a, "*", b, "%", m,
                                                          synthetic_tasks.TOOL_CLOSE)]
    ran = sandbox.Result(output=str(int(a) * int(b) % int(m)) + "\n", kind="ok", seconds=0.0, exit_code=0)
    observation = env_lib.QWEN25.observation(sandbox.format_observation(ran).removesuffix("\n"))
    answer = tokenizer.convert_tokens_to_ids(record["answer"])
    expected = (turn + [end]
                + tokenizer.encode(observation, add_special_tokens=False) + [answer, end])
    assert ids[len(prompt):] == expected
    code = sandbox.extract_code(tokenizer.decode(ids[len(prompt):len(prompt) + 7]))
    assert code.strip() == f"print( {a} * {b} % {m} )"
    n_turn, n_obs = 8, len(tokenizer.encode(observation, add_special_tokens=False))
    assert targets[len(prompt):] == [1] * n_turn + [0] * n_obs + [1, 1]
  assert forms["call"] > 32 and forms["guess"] > 8  # half the rows are the sister form, half the rest call


def test_the_loss_mask_marks_the_positions_predicting_a_target():
  ids, attention, loss_mask = warmup.left_padded([([5, 6, 7, 8], [0, 0, 1, 1]), ([5, 9], [0, 1])], pad_id=0)
  assert ids.tolist() == [[5, 6, 7, 8], [0, 0, 5, 9]]
  assert attention.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
  assert loss_mask.tolist() == [[0, 1, 1, 0], [0, 0, 1, 0]]  # position t predicts token t + 1


def test_the_base_is_built_once_then_loaded_as_a_model_path(tokenizer, tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(warmup.WARMUPS, "mul53_tools", dataclasses.replace(warmup.ToolWarmup(), steps=2, batch=4))
  cfg = tool_config()
  warmup.resolve(cfg, str(tmp_path))
  out = tmp_path / warmup.BASE_DIR
  assert cfg.model.hf_path == str(out) and cfg.model.warmup == ""
  record = json.loads((out / warmup.DONE_FILE).read_text())
  assert record["warmup"] == "mul53_tools" and record["settings"]["steps"] == 2
  assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
  assert "warm-up: done" in capsys.readouterr().out
  built = (out / "model.safetensors").stat().st_mtime_ns
  again = tool_config()  # a resume: the same config, the same workdir
  warmup.resolve(again, str(tmp_path))
  assert again.model.hf_path == cfg.model.hf_path and again.to_dict() == cfg.to_dict()
  assert (out / "model.safetensors").stat().st_mtime_ns == built and "warm-up" not in capsys.readouterr().out


@pytest.mark.parametrize("fields, named", [({"model.warmup": "nope"}, "not a built-in warm-up"),
                                           ({"model.hf_path": "/some/model"}, "model.hf_path"),
                                           ({"lora.rank": 4}, "lora.rank")])
def test_a_bad_warmup_setting_is_one_line_and_builds_nothing(tokenizer, tmp_path, fields, named):
  cfg = tool_config(**fields)
  with pytest.raises(config_lib.ConfigError, match="config.model.warmup") as error:
    warmup.resolve(cfg, str(tmp_path))
  assert named in str(error.value) and "\n" not in str(error.value)
  assert not any(tmp_path.iterdir())
