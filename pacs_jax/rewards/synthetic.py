"""Verifier of the built-in synthetic tasks (`synthetic/<task>`, drawn by `pacs_jax.data.synthetic_tasks`): the
response's first word must be a number congruent to the answer modulo the task's modulus."""

from __future__ import annotations

import re

DATA_SOURCE_PREFIX = "synthetic/"
# Qwen2.5's special tokens; <|im_end|> ends a chat turn, <|endoftext|> ends a document (both stop).
ENDOFTEXT, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
EOS_TOKENS = (IM_END, ENDOFTEXT)
# The built-in tasks' moduli by name: `a mod m` (or `a + b mod m`) in Z/mZ; `sum11`: sums of 1 to 4 terms mod 11
# (the laptop study's graded task); `mul53`: `a * b mod 53` (the tool task).
MODULI = {"mod3": 3, "mod4": 4, "mod2": 2, "sum11": 11, "mul53": 53}

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in (IM_START, UNK)))
_STOP_RE = re.compile("|".join(re.escape(t) for t in EOS_TOKENS))


def is_synthetic(data_source: str) -> bool:
  return data_source.startswith(DATA_SOURCE_PREFIX)


def task_name(name_or_data_source: str) -> str:
  """A built-in task's name from its name (`mod4`) or data source (`synthetic/mod4`); ValueError if unknown."""
  name = name_or_data_source.removeprefix(DATA_SOURCE_PREFIX)
  if name not in MODULI:
    raise ValueError(f"unknown synthetic task {name_or_data_source!r}; choose one of {sorted(MODULI)}")
  return name


def first_word(response_text: str) -> str:
  """The first word of a response: text before the first end marker, special tokens removed."""
  text = _STOP_RE.split(response_text, maxsplit=1)[0]
  words = _SPECIAL_RE.sub(" ", text).split()
  return words[0] if words else ""


def score_residue(response_text: str, answer: str, modulus: int) -> float:
  """1.0 when the response's first word is a number congruent to `answer` mod `modulus`, else 0.0."""
  word = first_word(response_text)
  if not word.isdecimal() or not word.isascii():
    return 0.0
  return 1.0 if (int(word) - int(answer)) % modulus == 0 else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: str) -> float:
  """Scores a response to a built-in task named by its data source (`synthetic/<name>`)."""
  return score_residue(solution_str, ground_truth, MODULI[task_name(data_source)])
