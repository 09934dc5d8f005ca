"""Synthetic task: determinism, verifier, tiny tokenizer, and a random tiny model's success rate."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pacs_jax.data import pipeline, prompts, synthetic_tasks as synthetic
from pacs_jax.models import families as registry
from pacs_jax.rewards import synthetic as synthetic_verifier


@pytest.fixture(scope="module")
def tokenizer():
  return synthetic.build_tokenizer()


def test_records_deterministic_for_a_seed():
  task = synthetic.get_task("mod3")
  assert task.records(100, seed=7) == task.records(100, seed=7)
  assert task.records(100, seed=7) != task.records(100, seed=8)
  for record in task.records(100, seed=7):
    operand = int(record["problem"].split()[0])
    assert record == {"data_source": "synthetic/mod3", "problem": f"{operand} mod 3", "answer": str(operand % 3)}


def test_two_operand_task():
  task = synthetic.SyntheticTask("add", modulus=5, num_operands=2, max_operand=9)
  for record in task.records(50, seed=0):
    a, plus, b, mod, m = record["problem"].split()
    assert (plus, mod, m) == ("+", "mod", "5")
    assert record["answer"] == str((int(a) + int(b)) % 5)


@pytest.mark.parametrize("response, answer, expected", [
    ("1", "1", 1.0),
    ("4", "1", 1.0),  # any representative of the class
    ("52 7 9", "1", 1.0),  # only the first word counts
    ("  7", "1", 1.0),
    ("2", "1", 0.0),
    ("7 1", "0", 0.0),
    ("user 1", "1", 0.0),  # a non-number first word fails
    ("", "1", 0.0),
    ("<|im_start|> 4", "1", 1.0),  # special tokens are not words (decode with or without skipping)
    ("<|im_end|> 4", "1", 0.0),  # the response ended before any answer
    ("4<|im_end|>", "1", 1.0),
    ("-2", "1", 0.0),
    ("1.0", "1", 0.0),
    ("\u0664", "1", 0.0),  # a non-ASCII digit is not one of the task's numbers
])
def test_score(response, answer, expected):
  task = synthetic.get_task("mod3")
  assert task.score(response, answer) == expected
  assert synthetic_verifier.compute_score("synthetic/mod3", response, answer) == expected


def test_unknown_task_is_an_error():
  with pytest.raises(ValueError, match="unknown synthetic task"):
    synthetic.get_task("synthetic/nope")


def test_tokenizer(tokenizer, tmp_path):
  assert len(tokenizer) <= 64
  assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
  assert synthetic.eos_token_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                                tokenizer.convert_tokens_to_ids("<|endoftext|>")]
  text = tokenizer.apply_chat_template([{"role": "user", "content": "7 mod 3"}], tokenize=False,
                                       add_generation_prompt=True)
  assert text == "<|im_start|>user\n7 mod 3<|im_end|>\n<|im_start|>assistant\n"
  ids = tokenizer(text, add_special_tokens=False)["input_ids"]
  assert tokenizer.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "7", "mod", "3", "<|im_end|>",
                                                  "<|im_start|>", "assistant"]
  assert tokenizer.unk_token_id not in ids
  # Ids past the tokenizer's vocabulary (the model has 256) decode to nothing.
  assert tokenizer.decode([200, 12, 255, 64], skip_special_tokens=True) == tokenizer.decode([12])
  assert tokenizer.decode([100, 150]) == ""

  synthetic.save_tokenizer(str(tmp_path))
  from transformers import AutoTokenizer

  reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
  assert reloaded.get_vocab() == tokenizer.get_vocab()
  assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
  assert reloaded.apply_chat_template([{"role": "user", "content": "7 mod 3"}], tokenize=False,
                                      add_generation_prompt=True) == text
  with open(os.path.join(tmp_path, "generation_config.json")) as f:
    assert json.load(f)["eos_token_id"] == synthetic.eos_token_ids(tokenizer)


def _sample_success_rate(task, tokenizer, model_seed, vocab_size, num_prompts=64, samples_per_prompt=4,
                         max_new_tokens=4):
  """Uncached temperature-1 sampling from a random tiny Qwen2; fraction of responses verified."""
  records = task.records(num_prompts, seed=0)
  prompt_ids = prompts.encode_prompts(tokenizer, [r["problem"] for r in records], instruction=synthetic.INSTRUCTION)
  ids, mask = pipeline.pad_prompts(prompt_ids, tokenizer.pad_token_id)
  ids, mask = np.repeat(ids, samples_per_prompt, 0), np.repeat(mask, samples_per_prompt, 0)
  model = registry.causal_lm(registry.preset("tiny", vocab_size=vocab_size), rngs=nnx.Rngs(model_seed))
  forward = nnx.jit(lambda m, x, a: m(x, a)[:, -1])
  tokens, attention = jnp.asarray(ids), jnp.asarray(mask)
  key = jax.random.key(model_seed)
  for step in range(max_new_tokens):
    next_token = jax.random.categorical(jax.random.fold_in(key, step), forward(model, tokens, attention))
    tokens = jnp.concatenate([tokens, next_token[:, None].astype(tokens.dtype)], axis=1)
    attention = jnp.concatenate([attention, jnp.ones_like(attention[:, :1])], axis=1)
  eos = synthetic.eos_token_ids(tokenizer)
  scores = []
  for row, response in enumerate(np.asarray(tokens[:, ids.shape[1]:]).tolist()):
    stops = [i for i, t in enumerate(response) if t in eos]
    text = tokenizer.decode(response[:stops[0]] if stops else response, skip_special_tokens=True)
    scores.append(task.score(text, records[row // samples_per_prompt]["answer"]))
  return float(np.mean(scores))


# The tiny preset's 256 ids (ids past the tokenizer's 64 decode to nothing) and a model cut to the tokenizer.
@pytest.mark.parametrize("vocab_size", [256, 64])
def test_random_tiny_model_succeeds_sometimes(tokenizer, vocab_size):
  rate = _sample_success_rate(synthetic.get_task(synthetic.DEFAULT_TASK), tokenizer, model_seed=0,
                              vocab_size=vocab_size)
  assert 0.05 <= rate <= 0.5, rate


def test_evaluation_and_validation_read_the_held_out_split(tokenizer):
  """`evaluate --data synthetic/sum11` and the trainer's validation score test problems, never training ones; a
  task without a test split (mod3) reads its usual draw."""
  from pacs_jax.data import sources
  from pacs_jax.eval import problems
  task = synthetic.get_task("synthetic/sum11")
  evaluated, _ = problems.load_problems(["synthetic/sum11"], tokenizer, max_prompt_length=64, limit=40)
  validated, _ = sources.load_split("synthetic/sum11", False, 40, seed=7, held_out=True)
  trained, _ = sources.load_split("synthetic/sum11", False, 40, seed=7)
  assert len(evaluated) == len(validated) == 40
  assert all(task.is_held_out(p.user_message) for p in evaluated)  # synthetic prompts: the problem alone
  assert all(task.is_held_out(r["problem"]) for r in validated)
  assert not any(task.is_held_out(r["problem"]) for r in trained)
  assert sources.load_split("synthetic/mod3", False, 8, seed=7, held_out=True) == \
      sources.load_split("synthetic/mod3", False, 8, seed=7)
