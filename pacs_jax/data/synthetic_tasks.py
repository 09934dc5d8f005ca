"""Built-in verifiable tasks (modular arithmetic) and a tiny word-level tokenizer for CPU runs (the verifier is
`pacs_jax.rewards.synthetic`)."""

# Why this design: a randomly initialised tiny Qwen2 samples its first tokens almost uniformly over its
# vocabulary, so a task whose answer is one fixed token would rarely succeed and RL would get no signal.
# The answer is therefore a residue class: `a mod m` in Z/mZ, where every representative is correct (for
# `7 mod 3`, `1`, `4` and `7` are all right), and the numbers 0..54 are single tokens. The tokenizer has 64
# ids; a model's ids beyond them decode to nothing, so its first word is the first in-vocabulary token it
# samples, usually a number. What is learnt is small and depends on the prompt: fetch the operand with
# attention and move the probability onto the numbers of its class (an m-way split, not a vocabulary-wide one).

from __future__ import annotations

import dataclasses
import json
import os
import zlib

import numpy as np

from pacs_jax.rewards import synthetic as verifier
from pacs_jax.rewards.synthetic import DATA_SOURCE_PREFIX, ENDOFTEXT, EOS_TOKENS, IM_END, IM_START, UNK

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, UNK)
WORDS = ("system", "user", "assistant", "mod", "+")
MAX_NUMBER = 54  # numbers 0..54 are tokens: 4 special + 5 words + 55 numbers = 64 ids
VOCAB = SPECIAL_TOKENS + WORDS + tuple(str(i) for i in range(MAX_NUMBER + 1))
# Synthetic prompts carry no instruction suffix (its words are not in the tiny vocabulary).
INSTRUCTION = ""
# The tool task's tokenizer ("synthetic_tools"): the same 64 ids, then the words of a Python tool call and of its
# observation (envs/env.py's QWEN25 template and sandbox.format_observation). Decoding joins words with spaces, so
# the call's opening word carries the newline the code-block format needs and its closing one the newline before the
# fence: the turn `OPEN 7 * 9 % 53 CLOSE` decodes to "```python\nprint( 7 * 9 % 53 )\n```", a program printing 10.
TOOL_OPEN, TOOL_CLOSE = "```python\nprint(", ")\n```"
TOOL_WORDS = (TOOL_OPEN, TOOL_CLOSE, "*", "%", "<tool_response>", "</tool_response>", "```output", "```")
TOOL_VOCAB = VOCAB + TOOL_WORDS

# Qwen-style chat template without the default system prompt (its words are not in the vocabulary).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(vocab: tuple[str, ...] = VOCAB):
  """The 64-token word-level tokenizer (or the tool task's, `vocab=TOOL_VOCAB`) as a `PreTrainedTokenizerFast`."""
  # Imported here so that the verifier (run in reward worker processes) does not load transformers.
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  backend = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=UNK))
  backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # decoding joins words with single spaces
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
  tokenizer = PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=UNK,
      extra_special_tokens=[IM_START], model_max_length=2048, padding_side="left", chat_template=CHAT_TEMPLATE)
  return tokenizer


def portable_tokenizer():
  """The same 64 ids in a form `transformers.AutoTokenizer` loads as it is beside a qwen2 config.json.

  transformers (5.x) turns any tokenizer of a `model_type: qwen2` directory into a Qwen2Tokenizer, which rebuilds a
  byte-level BPE from the vocabulary (and splits numbers into digits), garbling the word-level one. Here every word
  is an added token that eats the whitespace around it, over an empty BPE: encoding gives the demo's ids; decoding
  joins the words without spaces (this project's loaders use `build_tokenizer()`, see `is_synthetic_vocab`).
  """
  from tokenizers import AddedToken, Tokenizer, models
  from transformers import PreTrainedTokenizerFast

  backend = Tokenizer(models.BPE({tok: i for i, tok in enumerate(VOCAB)}, merges=[]))
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=True, rstrip=True)
                              for t in SPECIAL_TOKENS])
  backend.add_tokens([AddedToken(t, special=False, normalized=False, lstrip=True, rstrip=True)
                      for t in VOCAB if t not in SPECIAL_TOKENS])
  return PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=UNK,
      extra_special_tokens=[IM_START], model_max_length=2048, padding_side="left", chat_template=CHAT_TEMPLATE)


def is_synthetic_vocab(tokenizer) -> bool:
  """Whether a tokenizer holds exactly this task's 64 ids (either form)."""
  return tokenizer.get_vocab() == {tok: i for i, tok in enumerate(VOCAB)}


def generation_config(tokenizer) -> dict:
  """generation_config.json's content: both EOS ids (as Qwen2.5's) and the pad id."""
  return {"eos_token_id": eos_token_ids(tokenizer), "pad_token_id": tokenizer.pad_token_id}


def eos_token_ids(tokenizer) -> list[int]:
  """Ids that end a response: <|im_end|> and <|endoftext|> (as Qwen2.5's generation config)."""
  return [tokenizer.convert_tokens_to_ids(t) for t in EOS_TOKENS]


def save_tokenizer(directory: str):
  """Writes the tokenizer (HF layout) and a `generation_config.json` with both EOS ids; returns it."""
  tokenizer = build_tokenizer()
  tokenizer.save_pretrained(directory)
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump(generation_config(tokenizer), f, indent=2)
  return tokenizer


def check_numbers(modulus: int, max_operand: int) -> None:
  """ValueError unless the modulus and the operands are numbers of the vocabulary."""
  if not 2 <= modulus <= MAX_NUMBER:
    raise ValueError(f"modulus must be in [2, {MAX_NUMBER}], got {modulus}")
  if not 0 < max_operand <= MAX_NUMBER:
    raise ValueError(f"max_operand must be in [1, {MAX_NUMBER}], got {max_operand}")


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """`a mod m` (num_operands=1) or `a + b mod m` (2) in Z/mZ; any representative is correct."""
  name: str = "mod3"
  modulus: int = 3
  num_operands: int = 1
  max_operand: int = 8

  def __post_init__(self):
    check_numbers(self.modulus, self.max_operand)
    if self.num_operands not in (1, 2):
      raise ValueError(f"num_operands must be 1 or 2, got {self.num_operands}")

  @property
  def data_source(self) -> str:
    return DATA_SOURCE_PREFIX + self.name

  def records(self, n: int, seed: int) -> list[dict]:
    """`n` problems drawn with `seed` (same seed, same problems); answers are the least residues."""
    rng = np.random.default_rng(seed)
    operands = rng.integers(0, self.max_operand + 1, size=(n, self.num_operands))
    out = []
    for row in operands.tolist():
      problem = " + ".join(str(x) for x in row) + f" mod {self.modulus}"
      out.append({"data_source": self.data_source, "problem": problem, "answer": str(sum(row) % self.modulus)})
    return out

  def score(self, response_text: str, answer: str) -> float:
    """1.0 when the response's first word is a number congruent to `answer` mod m, else 0.0."""
    return verifier.score_residue(response_text, answer, self.modulus)


@dataclasses.dataclass(frozen=True)
class GradedSumTask:
  """`a_1 + ... + a_k mod m` with k = 1 .. max_terms terms (k is the difficulty); any representative is correct.

  Every problem belongs to one split by a hash of its text (about one in `held_out_every` is held out), so training
  prompts (`records`) never hold a test problem (`held_out`), whatever the seeds and sizes.
  """
  name: str = "sum11"
  modulus: int = 11
  max_terms: int = 4
  max_operand: int = 10
  held_out_every: int = 4

  def __post_init__(self):
    check_numbers(self.modulus, self.max_operand)

  @property
  def data_source(self) -> str:
    return DATA_SOURCE_PREFIX + self.name

  def is_held_out(self, problem: str) -> bool:
    return zlib.crc32(problem.encode()) % self.held_out_every == 0

  def draw(self, n: int, seed: int, held_out: bool, terms: tuple[int, ...] | None = None,
           distinct: bool = False) -> list[dict]:
    """`n` problems of one split, each with a number of terms drawn uniformly from `terms` (default: all), drawn
    with `seed`; `distinct`: no problem twice (ValueError when the split has too few)."""
    terms = tuple(terms or range(1, self.max_terms + 1))
    rng = np.random.default_rng(seed)
    out, seen, tries = [], set(), 0
    while len(out) < n:
      tries += 1
      if tries > 1000 * n:
        raise ValueError(f"{self.name}: fewer than {n} distinct problems of {terms} terms in the split")
      k = int(rng.choice(terms))
      row = rng.integers(0, self.max_operand + 1, size=k).tolist()
      problem = " + ".join(map(str, row)) + f" mod {self.modulus}"
      if self.is_held_out(problem) != held_out or (distinct and problem in seen):
        continue
      seen.add(problem)
      out.append({"data_source": self.data_source, "problem": problem, "answer": str(sum(row) % self.modulus)})
    return out

  def records(self, n: int, seed: int) -> list[dict]:
    """`n` training problems (never held out) drawn with `seed`."""
    return self.draw(n, seed, held_out=False)

  def held_out(self, n: int, seed: int = 0, terms: tuple[int, ...] | None = None) -> list[dict]:
    """`n` distinct held-out problems."""
    return self.draw(n, seed, held_out=True, terms=terms, distinct=True)

  def score(self, response_text: str, answer: str) -> float:
    return verifier.score_residue(response_text, answer, self.modulus)


@dataclasses.dataclass(frozen=True)
class ProductTask:
  """`a * b mod m` (the tool task, configs/tiny_tools_cpu.py): a product table the tiny model cannot hold, which one
  tool call (`TOOL_OPEN a * b % m TOOL_CLOSE`) computes; any representative is correct."""
  name: str = "mul53"
  modulus: int = 53
  max_operand: int = MAX_NUMBER

  def __post_init__(self):
    check_numbers(self.modulus, self.max_operand)

  @property
  def data_source(self) -> str:
    return DATA_SOURCE_PREFIX + self.name

  def records(self, n: int, seed: int) -> list[dict]:
    """`n` problems drawn with `seed`; answers are the least residues."""
    rng = np.random.default_rng(seed)
    out = []
    for a, b in rng.integers(2, self.max_operand + 1, size=(n, 2)).tolist():
      out.append({"data_source": self.data_source, "problem": f"{a} * {b} mod {self.modulus}",
                  "answer": str(a * b % self.modulus)})
    return out

  def score(self, response_text: str, answer: str) -> float:
    return verifier.score_residue(response_text, answer, self.modulus)


def num_terms(problem: str) -> int:
  """The difficulty of a `GradedSumTask` problem: its number of terms."""
  return problem.count("+") + 1


TASKS = {
    "mod3": SyntheticTask("mod3", modulus=verifier.MODULI["mod3"], max_operand=8),  # the default
    "mod4": SyntheticTask("mod4", modulus=verifier.MODULI["mod4"], max_operand=7),
    "mod2": SyntheticTask("mod2", modulus=verifier.MODULI["mod2"], max_operand=MAX_NUMBER),
    "sum11": GradedSumTask("sum11", modulus=verifier.MODULI["sum11"]),  # the laptop study's task (docs/study.md)
    "mul53": ProductTask("mul53", modulus=verifier.MODULI["mul53"]),  # the tool task (TOOL_VOCAB's words)
}
DEFAULT_TASK = "mod3"


def get_task(name_or_data_source: str) -> SyntheticTask | GradedSumTask | ProductTask:
  """A built-in task by name (`mod4`) or data source (`synthetic/mod4`)."""
  return TASKS[verifier.task_name(name_or_data_source)]
