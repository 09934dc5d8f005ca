"""The console of a run: the banner names what the run uses; in a terminal a bar counts each step's rollout tokens
as they are generated and names the step's phase (then clears, so the step's line follows as before); the first
step's phases (it compiles) are told with their times, in a terminal or not (issue 44 item 5)."""

import os
import re

import jax

from pacs_jax import config as config_lib
from pacs_jax.services import console
from pacs_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_banner_and_a_progress_bar_in_a_terminal(tmp_path, monkeypatch, capsys):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "steps": 2, "eval_every": 0, "train.batch_prompts": 8, "train.mini_batch_prompts": 8,
      "checkpoint.async_save": False})
  trainer = loop.Trainer(cfg, str(tmp_path / "run"), devices=jax.devices()[:1])
  banner = trainer.banner("configs/tiny_cpu.py")
  for line in ("pacs_jax.train: configs/tiny_cpu.py, algorithm pacs, 2 steps", f"workdir    {tmp_path / 'run'}",
               "model      preset tiny: qwen2 (2 layers, width 64, vocabulary 64, float32)",
               "tokenizer  synthetic (built in), 64 tokens", "data       train synthetic/mod3 (4096 problems); "
               "no validation", "prompts    8 x n=8 per step, <= 16 prompt and 4 new tokens; instruction none",
               "devices    1 x cpu (mesh data=1 fsdp=1 tensor=1)", "training   every parameter (full fine-tuning)",
               "rollout    sync (each step samples with its own weights, then updates), on the trainer's devices"):
    assert line in banner, banner
  monkeypatch.setattr(console, "watched", lambda: True)
  monkeypatch.setattr(console, "_announced", False)  # this process's first step, whichever test ran before
  trainer.run()
  out, err = capsys.readouterr()
  # The first step (it compiles) tells each phase's time as it ends, above the bar; later steps do not.
  took = [line.split(" took ")[0] for line in out.splitlines() if " took " in line and line.endswith(" s")]
  assert took == ["step 1: rollout", "step 1: reward", "step 1: update"], out
  # 8 prompts x 8 responses x 4 tokens: the bar counts the token budget, not the 64 responses.
  assert "step 1: rollout (the first step compiles its programs)" in err and "256/256" in err and "64/64" not in err
  assert "64 responses" in err and "token" in err
  for phase in ("rollout", "reward", "update"):
    assert f"step 2: {phase}: " in err, err
  assert ": :" not in err
  assert console.closing_line(trainer.workdir, 2).startswith(f"done at step 2: metrics {tmp_path / 'run'}")


def test_the_banner_names_lora_the_rollout_mode_and_the_rollouts_devices():
  """Issue 44: a LoRA run's banner says so (rank, scale, targets); an overlapped one its mode and staleness; a split
  one the rollout's own devices beside the trainer's."""
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "lora.rank": 8, "lora.alpha": 16.0, "lora.targets": "q,v", "rollout.mode": "async", "rollout.max_staleness": 2,
      "rollout.devices": 4})
  assert console.training_line(cfg) == "LoRA rank 8 (alpha 16) on q, v, the base frozen"
  assert console.rollout_line(cfg, 4) == ("async (2 steps sampled ahead; up to 2 versions stale), on its own 4 "
                                          "devices (the trainer's 4 above)")
  cfg.rollout.mode, cfg.rollout.max_staleness, cfg.rollout.devices = "one_step_off", 1, 0
  assert console.rollout_line(cfg, 8).startswith("one_step_off (the next step samples during this update; up to 1 "
                                                 "version stale), on the trainer's devices")


def test_without_a_terminal_the_first_step_names_its_phases(tmp_path, monkeypatch, capsys):
  cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", "tiny_cpu.py"), {
      "steps": 2, "eval_every": 0, "train.batch_prompts": 8, "train.mini_batch_prompts": 8,
      "checkpoint.async_save": False})
  monkeypatch.setattr(console, "watched", lambda: False)
  monkeypatch.setattr(console, "_announced", False)
  loop.Trainer(cfg, str(tmp_path / "run"), devices=jax.devices()[:1]).run()
  out, err = capsys.readouterr()
  lines = [re.sub(r"took \d+\.\d s", "took T s", line) for line in out.splitlines()
           if line.startswith("step 1: ") and (line.endswith(" ...") or line.endswith(" s"))]
  assert lines == ["step 1: rollout (the first step compiles its programs) ...", "step 1: rollout took T s; reward ...",
                   "step 1: reward took T s; update ...", "step 1: update took T s"], out
  assert "step 2: rollout" not in out
  assert "step 1: reward ..." not in err  # on stdout with the step lines: a failure's stderr holds the failure (test_failures.py)
