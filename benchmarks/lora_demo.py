"""The CPU demo (configs/tiny_cpu.py) trained with LoRA and with full fine-tuning side by side: the step at which
each one's 10-step mean reward first reaches 0.9 (issue 31, acceptance 4). Exits with status 1, naming the runs, when
one misses 0.9 within its steps.

  python benchmarks/lora_demo.py [--algorithm=pacs] [--rank=8] [--bases=random] [--workdir=/tmp/lora_demo]

random: the demo as it is, a random tiny model (train.lr 3e-3), its LoRA run `--config.lora.rank=8` alone: the
  config's `lora.modules_to_save` (embed_tokens,norm: frozen at their init, the tied embeddings and the norms cap a
  right answer's probability below 0.4, tests/train/test_lora_demo.py) and the default rate rule
  (`LoraSpec.lr_multiplier`: LoRA Without Regret's 10x, capped at hidden_size / (2 alpha) = 1 at width 64).
warm: the laptop study's base model (pacs_jax/study/warmup.py: the tiny model taught sum11's one- and two-term
  sums by a short supervised warm-up), as a pretrained base is what LoRA adapts; its LoRA runs save no module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW, TARGET = 10, 0.9

_ALGORITHM = flags.DEFINE_string("algorithm", "pacs", "pacs | grpo | ppo (configs/tiny_cpu.py:<algorithm>).")
_RANK = flags.DEFINE_integer("rank", 8, "The LoRA runs' lora.rank.")
_BASES = flags.DEFINE_list("bases", ["random"], "random (the demo's init) and/or warm (the study's base).")
_STEPS = flags.DEFINE_integer("steps", 500, "Training steps of each run from the random base (the demo's).")
_WARM_STEPS = flags.DEFINE_integer("warm_steps", 300, "Training steps of each run from the warm base.")
_WARM_LR = flags.DEFINE_float("warm_lr", 3e-3, "train.lr from the warm base (LoRA's: the rule's multiple of it).")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where the runs' workdirs go (default: a temporary folder).")
_FULL = flags.DEFINE_bool("full", True, "Also run full fine-tuning beside LoRA.")
_SAVE = flags.DEFINE_string("modules_to_save", None, "The LoRA runs' lora.modules_to_save (default: the config's "
                            "from the random base, none from the warm one; '' for none).")


def train(workdir: str, algorithm: str, steps: int, *overrides: str) -> tuple[list[dict], float]:
  """(metrics rows, seconds) of one demo run through the command line, with `overrides` (--config.x=y)."""
  config = os.path.join(ROOT, "configs", f"tiny_cpu.py:{algorithm}")
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  start = time.perf_counter()
  out = subprocess.run([sys.executable, "-m", "pacs_jax.train", "--config", config, "--workdir", workdir,
                        f"--config.steps={steps}", "--config.eval_every=0", *overrides],
                       env=env, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"the run in {workdir} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f], time.perf_counter() - start


def first_step_at(rows: list[dict], window: int = WINDOW, target: float = TARGET) -> tuple[int | None, float]:
  """(the first step whose mean reward over the `window` steps ending there is >= target, or None; the best such
  mean)."""
  steps = [r["step"] for r in rows if "reward/mean" in r]
  rewards = np.asarray([r["reward/mean"] for r in rows if "reward/mean" in r])
  means = np.convolve(rewards, np.ones(window) / window, mode="valid")  # means[i]: steps i .. i + window - 1
  hits = np.flatnonzero(means >= target)
  return (steps[hits[0] + window - 1] if hits.size else None), float(means.max(initial=0.0))


def warm_base(cache_dir: str) -> str:
  """The laptop study's base model directory (built once into `cache_dir`, a few seconds)."""
  from pacs_jax.study import warmup
  return warmup.base_model_dir(warmup.WarmupSettings(), cache_dir)


def main(argv):
  del argv
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="lora_demo_")
  print(f"{_ALGORITHM.value} on configs/tiny_cpu.py: the first step whose {WINDOW}-step mean reward reaches {TARGET}")
  missed = []
  for base in _BASES.value:
    save = _SAVE.value
    if base == "random":
      steps, overrides = _STEPS.value, []
    else:
      steps, save = _WARM_STEPS.value, "" if save is None else save
      overrides = [f"--config.model.hf_path={warm_base(os.path.join(root, 'warmup'))}", "--config.tokenizer=synthetic",
                   f"--config.train.lr={_WARM_LR.value}"]
    runs = [(f"LoRA rank {_RANK.value}", [f"--config.lora.rank={_RANK.value}",
                                          *([] if save is None else [f"--config.lora.modules_to_save={save}"])])]
    runs += [("full fine-tuning", [])] if _FULL.value else []
    print(f"{base} base, {steps} steps:")
    for name, extra in runs:
      workdir = os.path.join(root, base, name.replace(" ", "_"))
      rows, seconds = train(workdir, _ALGORITHM.value, steps, *overrides, *extra)
      step, best = first_step_at(rows)
      print(f"  {name:18s} lr {rows[-1]['lr']:.0e}: {'step ' + str(step) if step else 'not reached':>11s}  (best "
            f"{WINDOW}-step mean {best:.3f}, first {np.mean([r['reward/mean'] for r in rows[:WINDOW]]):.3f}; last "
            f"entropy {rows[-1]['entropy']:.2f}; {seconds:.0f} s)", flush=True)
      missed += [f"{name} from the {base} base"] if step is None else []
  if missed:
    sys.exit(f"not reached: {'; '.join(missed)} did not reach a {WINDOW}-step mean reward of {TARGET} within its steps")

if __name__ == "__main__":
  app.run(main)
