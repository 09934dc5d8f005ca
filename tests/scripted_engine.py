"""A second implementation of the rollout interface for the tests (`rollout.engine = "scripted_engine:make"`): no
model, no device work; it answers the synthetic `a mod m` task right for even sample indices and wrong for odd ones,
and puts one inserted token ("+", loss mask 0) between the answer and the EOS, as a tool's output would sit."""

import numpy as np

from pacs_jax.data import synthetic_tasks as synthetic
from pacs_jax.rollout import interface

ANSWER_OFFSET = synthetic.VOCAB.index("0")  # the id of the number 0; k is ANSWER_OFFSET + k
MOD = synthetic.VOCAB.index("mod")
INSERTED = synthetic.VOCAB.index("+")
EOS = synthetic.VOCAB.index(synthetic.IM_END)


class ScriptedRollout:
  """`interface.Rollout` by script: each response is [answer, "+", <|im_end|>], loss mask [1, 0, 1]."""

  def __init__(self, eos_ids=()):
    self.eos_ids = tuple(eos_ids)
    self.version = -1
    self.weights_set = 0  # set_weights calls, this rollout's and its forks' own

  @property
  def weight_shardings(self):
    return None

  def set_weights(self, params, version: int) -> None:
    self.version = int(version)
    self.weights_set += 1

  def release(self) -> None:
    pass

  def fork(self):
    return ScriptedRollout(self.eos_ids)

  def ahead_of_time(self):
    return None

  def generate(self, prompts, *, n=1, max_new_tokens=None, sampling=None, seed=0, prompt_ids=None, on_finish=None):
    out = []
    for p, prompt in enumerate(prompts):
      prompt = list(prompt)
      modulus = prompt[prompt.index(MOD) + 1] - ANSWER_OFFSET
      answer = (prompt[prompt.index(MOD) - 1] - ANSWER_OFFSET) % modulus
      for s in range(n):
        guess = answer if s % 2 == 0 else (answer + 1) % modulus
        tokens = [ANSWER_OFFSET + guess, INSERTED, EOS]
        out.append(interface.Completion(p, s, tokens, np.full(3, -0.5, np.float32), "eos", self.version,
                                        loss_mask=np.asarray([1.0, 0.0, 1.0], np.float32)))
        if on_finish is not None:
          on_finish()
    return out


def make(*, model, slots, max_prompt_length, max_new_tokens, mesh, eos_ids, page_size, kv_pages):
  """The factory `rollout.engine` names: `programs.make_rollout`'s keyword arguments, only `eos_ids` used."""
  return ScriptedRollout(eos_ids)


def not_a_rollout(**kwargs):
  """A factory whose result lacks the interface (no `fork`, no `generate`)."""
  return object()
