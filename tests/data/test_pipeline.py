"""Grain prompt pipeline: rendering, seeded per-epoch order, process shards, overlong filter, state."""

import json
import logging
import os

import numpy as np
import pytest

from pacs_jax.data import pipeline, prompts, sources, synthetic_tasks as synthetic

# Qwen2.5's chat template (tokenizer_config.json of the Qwen2.5 models).
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def tokenizer():
  return synthetic.build_tokenizer()


@pytest.fixture(scope="module")
def qwen_style_tokenizer():
  tok = synthetic.build_tokenizer()
  tok.chat_template = QWEN25_CHAT_TEMPLATE
  return tok


def _records(n, seed=0):
  return synthetic.get_task("mod3").records(n, seed)


def _pipeline(tokenizer, records, **kw):
  kw = {"batch_size": 8, "max_prompt_length": 64, "seed": 3, "instruction": "", "process_index": 0,
        "process_count": 1, **kw}
  return pipeline.PromptPipeline(records, tokenizer, **kw)


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def test_rendered_prompt_with_qwen25_template(qwen_style_tokenizer):
  problem = "What is $1+1$?"
  [text] = prompts.render_prompts(qwen_style_tokenizer, [problem])
  assert text == (
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\nWhat is $1+1$? Please reason step by step, and put your final answer within \\boxed{}."
      "<|im_end|>\n<|im_start|>assistant\n")


def test_rendered_prompt_without_instruction(tokenizer):
  assert prompts.render_prompts(tokenizer, ["7 mod 3"], instruction=synthetic.INSTRUCTION) == [
      "<|im_start|>user\n7 mod 3<|im_end|>\n<|im_start|>assistant\n"]
  assert prompts.user_message("p", "Do it.") == "p Do it." and prompts.user_message("p", None) == "p"


def test_batches_carry_the_tokenized_prompts(tokenizer):
  records = _records(40)
  batch = next(iter(_pipeline(tokenizer, records)))
  assert set(batch) == {"prompt_ids", "answer", "data_source", "problem", "index", "step", "epoch"}
  assert (batch["step"], batch["epoch"]) == (0, 0)
  assert len(batch["prompt_ids"]) == 8 and batch["index"].dtype == np.int64
  for ids, index, answer, problem in zip(batch["prompt_ids"], batch["index"], batch["answer"], batch["problem"]):
    assert ids.dtype == np.int32
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"user {records[index]['problem']} assistant"
    assert (answer, problem) == (records[index]["answer"], records[index]["problem"])


def test_same_seed_same_order_new_order_each_epoch(tokenizer):
  records = _records(40)
  first = [b["index"].tolist() for b in _pipeline(tokenizer, records, num_epochs=3)]
  again = [b["index"].tolist() for b in _pipeline(tokenizer, records, num_epochs=3)]
  other_seed = [b["index"].tolist() for b in _pipeline(tokenizer, records, num_epochs=3, seed=4)]
  assert first == again
  assert first != other_seed
  epochs = [sum(first[e * 5:(e + 1) * 5], []) for e in range(3)]  # 40 prompts, batches of 8: 5 a epoch
  assert all(sorted(epoch) == list(range(40)) for epoch in epochs)
  assert len({tuple(epoch) for epoch in epochs}) == 3
  assert epochs[0] != list(range(40))


def test_remainder_is_left_out_of_each_epoch(tokenizer):
  pipe = _pipeline(tokenizer, _records(43), num_epochs=2)
  assert (pipe.steps_per_epoch, len(pipe)) == (5, 10)
  batches = list(pipe)
  assert len(batches) == 10 and [b["epoch"] for b in batches] == [0] * 5 + [1] * 5
  assert all(len(b["index"]) == 8 for b in batches)
  epoch0 = sum((b["index"].tolist() for b in batches[:5]), [])
  assert len(set(epoch0)) == 40


def test_unshuffled_with_remainder(tokenizer):
  pipe = _pipeline(tokenizer, _records(20), num_epochs=1, shuffle=False, drop_remainder=False)
  assert [b["index"].tolist() for b in pipe] == [list(range(8)), list(range(8, 16)), list(range(16, 20))]


def test_two_processes_get_disjoint_shards_that_cover_each_batch(tokenizer):
  records = _records(48)
  whole = list(_pipeline(tokenizer, records, num_epochs=2))
  shards = [list(_pipeline(tokenizer, records, num_epochs=2, process_index=p, process_count=2)) for p in range(2)]
  assert len(shards[0]) == len(shards[1]) == len(whole) == 12
  for full, part0, part1 in zip(whole, *shards):
    assert len(part0["index"]) == len(part1["index"]) == 4
    assert not set(part0["index"].tolist()) & set(part1["index"].tolist())
    assert part0["index"].tolist() + part1["index"].tolist() == full["index"].tolist()
    assert part0["step"] == part1["step"] == full["step"]


def test_without_drop_remainder_uneven_shares_still_cover_every_prompt(tokenizer):
  records = _records(10)
  shards = [list(_pipeline(tokenizer, records, batch_size=5, num_epochs=1, drop_remainder=False,
                           process_index=p, process_count=2)) for p in range(2)]
  seen = [i for shard in shards for batch in shard for i in batch["index"].tolist()]
  assert sorted(seen) == list(range(10))


def test_uneven_processes_are_an_error(tokenizer):
  with pytest.raises(ValueError, match="not divisible by the 3 processes"):
    _pipeline(tokenizer, _records(40), process_index=0, process_count=3)


def test_state_restored_mid_epoch_gives_the_same_next_batches(tokenizer):
  records = _records(40)
  uninterrupted = _pipeline(tokenizer, records).iterator()
  expected = _take(uninterrupted, 12)

  interrupted = _pipeline(tokenizer, records).iterator()
  _take(interrupted, 7)  # mid-epoch (5 batches an epoch)
  state = json.loads(json.dumps(interrupted.get_state()))  # what a checkpoint stores
  resumed = _pipeline(tokenizer, records).iterator(state)
  for got, want in zip(_take(resumed, 5), expected[7:]):
    assert got["index"].tolist() == want["index"].tolist() and got["step"] == want["step"]
    assert all(np.array_equal(a, b) for a, b in zip(got["prompt_ids"], want["prompt_ids"]))


def test_overlong_prompts_are_dropped_and_counted(tokenizer, caplog):
  records = _records(40)
  for i in (3, 17, 30):  # 8 more words than the others' 8 tokens
    records[i] = {**records[i], "problem": records[i]["problem"] + " 1 2 3 4 5 6 7 8"}
  with caplog.at_level(logging.WARNING):
    pipe = _pipeline(tokenizer, records, max_prompt_length=8, num_epochs=1)
  assert (pipe.num_dropped, pipe.num_prompts) == (3, 37)
  assert "dropped 3 of 40 prompts longer than max_prompt_length=8" in caplog.text
  seen = sum((b["index"].tolist() for b in pipe), [])
  assert len(seen) == 32 and not {3, 17, 30} & set(seen)
  # The same filter on every process keeps the shards consistent.
  shards = [sum((b["index"].tolist() for b in _pipeline(tokenizer, records, max_prompt_length=8, num_epochs=1,
                                                          process_index=p, process_count=2)), []) for p in range(2)]
  assert sorted(shards[0] + shards[1]) == sorted(seen)
  with pytest.raises(ValueError, match="fewer than one batch"):
    _pipeline(tokenizer, records, max_prompt_length=7)


def test_pipeline_on_released_data(released_data, qwen_style_tokenizer):
  records, _ = sources.load_records(os.path.join(released_data, "deepscaler/train/aime.json"))
  pipe = pipeline.PromptPipeline(records, qwen_style_tokenizer, batch_size=8, max_prompt_length=150, seed=0,
                                 process_index=1, process_count=2)
  assert pipe.num_dropped > 0 and pipe.num_prompts + pipe.num_dropped == 40
  batch = next(iter(pipe))
  assert len(batch["prompt_ids"]) == 4 and set(batch["data_source"]) == {"deepscaler"}
  assert max(len(x) for x in batch["prompt_ids"]) <= 150


def test_pad_prompts():
  ids, mask = pipeline.pad_prompts([np.array([5, 6, 7]), np.array([8])], pad_id=0)
  np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 8]])
  np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])
  ids, mask = pipeline.pad_prompts([np.array([5])], pad_id=9, length=3)
  np.testing.assert_array_equal(ids, [[9, 9, 5]])
  with pytest.raises(ValueError, match="more than the padded length"):
    pipeline.pad_prompts([np.array([1, 2])], pad_id=0, length=1)
