"""Prompt formatting: the released instruction, the user message, and the tokenizer's chat template."""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Appended to each problem (after one space) in the released runs' user message.
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def user_message(problem: str, instruction: str | None = MATH_INSTRUCTION) -> str:
  """The released user message: the problem, one space, the instruction (none for synthetic tasks)."""
  return f"{problem} {instruction}" if instruction else problem


def render_prompts(tokenizer, problems: Sequence[str], instruction: str | None = MATH_INSTRUCTION) -> list[str]:
  """Prompt texts: each user message through the tokenizer's chat template with the generation prompt."""
  conversations = [[{"role": "user", "content": user_message(p, instruction)}] for p in problems]
  if not conversations:
    return []
  return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)


def encode_prompts(tokenizer, problems: Sequence[str], instruction: str | None = MATH_INSTRUCTION) -> list[np.ndarray]:
  """Token ids [T_i] (int32) of each rendered prompt; the template already holds any special tokens."""
  texts = render_prompts(tokenizer, problems, instruction)
  if not texts:
    return []
  ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
  return [np.asarray(x, dtype=np.int32) for x in ids]
