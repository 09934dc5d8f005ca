"""The update's wall time on CPU with packed rows against padded ones (issue 42, acceptance 5).

  python benchmarks/packing.py [--max_new_tokens=128] [--repeats=5] [--algorithm=pacs]

The demo's model (configs/tiny_cpu.py: the tiny preset) at `rollout.max_new_tokens` 128, one trainer with
`train.packing` off and one with it on, from the same seed. Each runs the update stage (`Trainer.update`: the
log-prob passes and every optimizer update of a step) on the same rollout: the demo's 16 prompts x 8 responses,
prompts of 4-16 of 16 tokens, responses of mixed lengths (long-tailed: mean 0.3 x max, 5% at the cap, as
`rlvr`'s stand-in profile). The first update of each compiles and is not counted; the median of `--repeats`
after it is. Prints the share of real tokens in the padded rows, the packed rows' fill, both medians and their
ratio; exits 1 when real tokens are under 40% of the padded ones and packing is less than 2x faster.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "rollout.max_new_tokens: R, the padded responses' length.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed updates of each layout (after one that compiles).")
_ALGORITHM = flags.DEFINE_string("algorithm", "pacs", "The objective.")
_MEAN = flags.DEFINE_float("mean_fraction", 0.3, "Mean response length as a fraction of max_new_tokens.")
_AT_CAP = flags.DEFINE_float("at_cap", 0.05, "Fraction of responses that reach max_new_tokens.")


def rollout_rows(cfg, seed: int = 0):
  """A step's rows as `stages.pack` makes them: (input_ids, attention_mask, response mask) [rows, P + R]."""
  rng = np.random.default_rng(seed)
  P, R, n = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens, cfg.rollout.n
  rows = cfg.train.batch_prompts * n
  lengths = np.clip(rng.geometric(1.0 / (_MEAN.value * R), rows), 1, R)
  lengths[rng.random(rows) < _AT_CAP.value] = R
  ids = np.zeros((rows, P + R), np.int32)
  mask = np.zeros((rows, P + R), np.int32)
  for g in range(cfg.train.batch_prompts):
    p = int(rng.integers(4, P + 1))
    prompt = rng.integers(3, cfg.model.vocab_size, p)
    for r in range(g * n, (g + 1) * n):
      ids[r, P - p:P], mask[r, P - p:P] = prompt, 1
      ids[r, P:P + lengths[r]] = rng.integers(3, cfg.model.vocab_size, lengths[r])
      mask[r, P:P + lengths[r]] = 1
  rewards = (rng.random(rows) < 0.5).astype(np.float32)
  return ids, mask, mask[:, P:].astype(np.float32), rewards


def timed_updates(cfg, workdir: str) -> tuple[list[float], dict]:
  from pacs_jax.trainer import loop, packing
  trainer = loop.Trainer(cfg, workdir)
  ids, mask, response_mask, rewards = rollout_rows(cfg)
  rows = len(rewards)
  rollout = packing.PackedRollout(ids, mask, response_mask, rewards, ["synthetic"] * rows, ["stop"] * rows,
                                  extra=trainer.objective.host_inputs(ids, mask, cfg.rollout.max_new_tokens),
                                  behaviour_logprobs=np.zeros(response_mask.shape, np.float32))
  times, metrics = [], {}
  for i in range(1 + _REPEATS.value):
    start = time.perf_counter()
    metrics = trainer.update(rollout)  # blocks: its metrics are read back to the host
    times.append(time.perf_counter() - start)
    print(f"  update {i}: {times[-1]:.3f} s{' (compiles)' if i == 0 else ''}", flush=True)
  trainer.lock.release()
  return times[1:], metrics


def main(argv):
  del argv
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # the trainers' checkpoint managers log at INFO
  from pacs_jax import config as config_lib
  from pacs_jax.trainer import sequence_packing
  import importlib.util
  spec = importlib.util.spec_from_file_location("tiny_cpu", os.path.join(ROOT, "configs", "tiny_cpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  results = {}
  for packed in (False, True):
    cfg = module.get_config(_ALGORITHM.value)
    for key, value in {"rollout.max_new_tokens": _MAX_NEW.value, "train.packing": packed, "eval_every": 0,
                       "checkpoint.async_save": False}.items():
      config_lib.set_field(cfg, key, value)
    name = "packed" if packed else "padded"
    print(f"{name}: {cfg.algorithm} on the tiny model, {cfg.train.batch_prompts} x {cfg.rollout.n} responses, "
          f"P + R = {cfg.data.max_prompt_length} + {cfg.rollout.max_new_tokens}", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
      results[name] = timed_updates(cfg, workdir)
  ids, mask, _, _ = rollout_rows(cfg)
  P, R = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
  real = float(mask.sum()) / mask.size
  m = cfg.rollout.n * cfg.train.mini_batch_prompts
  micro = [mask[i:i + m] for i in range(0, len(mask), m)]
  b = max(sequence_packing.rows_needed(x, R, P + R) for x in micro)
  rung = sequence_packing.rung(b, sequence_packing.ladder(m, 1, cfg.train.packing_rungs))
  padded, packed = (float(np.median(results[k][0])) for k in ("padded", "packed"))
  print(f"real tokens: {100 * real:.1f}% of the padded rows ({mask.sum()} of {mask.size}); packed: {rung} rows of "
        f"{P + R} per micro-batch of {m} ({100 * mask.sum() / (len(micro) * rung * (P + R)):.1f}% full)")
  print(f"update (median of {_REPEATS.value}): padded {padded:.3f} s, packed {packed:.3f} s: "
        f"{padded / packed:.2f}x faster packed")
  for key in ("loss", "grad_norm"):
    a, b_ = results["padded"][1][key], results["packed"][1][key]
    print(f"  last update's {key}: padded {a:.6g}, packed {b_:.6g}")
  if real < 0.4 and padded / packed < 2.0:
    print(f"FAIL: real tokens are {100 * real:.1f}% of the padded ones but packing is only {padded / packed:.2f}x faster")
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
