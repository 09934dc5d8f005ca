"""LoRA runs (issue 31, docs/lora.md): step 0 samples and scores exactly as the base model; a checkpoint holds the
adapters and their optimizer state only; bad lora settings, and a resume under other adapters or on another base,
are refused in one line naming the field; PACS, GRPO and PPO each train two steps, the base untouched."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from pacs_jax import config as config_lib
from pacs_jax import errors
from pacs_jax.models import hf
from pacs_jax.models import families as model_registry
from pacs_jax.storage import checkpoint as checkpoint_lib
from pacs_jax.trainer import loop, packing as batching, stages
from pacs_jax.trainer import train_state as state_lib
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
RUN = {"steps": 2, "eval_every": 0, "train.batch_prompts": 4, "train.mini_batch_prompts": 2,
       "checkpoint.async_save": False, "checkpoint.every": 1, "checkpoint.keep": 0}
LORA = {"lora.rank": 8, "lora.modules_to_save": ""}  # plain adapters (the demo config saves embeddings and norms)


def tiny(**overrides):
  return config_lib.load_config_file(TINY, {**RUN, **overrides})


def trainer(workdir, devices=1, **overrides) -> loop.Trainer:
  return loop.Trainer(tiny(**overrides), str(workdir), devices=jax.devices()[:devices])


def leaves(tree) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def state_bytes(workdir, step: int) -> int:
  folder = os.path.join(workdir, "checkpoints", str(step), "state")
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def saved_params(workdir, step: int) -> list[tuple]:
  """The paths under `params` of a checkpoint's saved state (its tree metadata)."""
  with open(os.path.join(workdir, "checkpoints", str(step), "state", "_METADATA")) as f:
    keys = json.load(f)["tree_metadata"]
  paths = [eval(k) for k in keys]  # "('params', 'model', ...)": Orbax writes tuple reprs
  return sorted(p for p in paths if p[0] == "params")


# ---------------------------------------------------------------------------------------------------------
# Step 0 is the base model: the same completions (tokens and behaviour log-probs) and the same policy and reference
# log-probs, bitwise, as a full run from the same base, on a 2-device fsdp mesh.

def test_step_0_samples_and_scores_exactly_as_the_base_model(tmp_path):
  full = trainer(tmp_path / "full", devices=2, **{"mesh.fsdp": 2})
  lora = trainer(tmp_path / "lora", devices=2, **{"mesh.fsdp": 2}, **LORA)
  assert [p[-1] for p, _ in nnx.to_flat_state(lora.state.params) if not p[-1].endswith(("_lora_a", "_lora_b"))] == []
  # The frozen reference is the base itself: the same arrays, no copy.
  assert all(a is b for a, b in zip(jax.tree.leaves(lora.ref_params), jax.tree.leaves(lora.base)))
  for x, y in zip(leaves(full.state.params), leaves(lora.base)):
    np.testing.assert_array_equal(x, y)

  prompts = next(full.data_iter)
  prompt_ids = [ids.tolist() for ids in prompts["prompt_ids"]]
  seed = state_lib.rollout_seed(full.state.rng)
  completions = [t.rollout(prompt_ids, seed) for t in (full, lora)]
  for a, b in zip(*completions):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_array_equal(a.logprobs, b.logprobs)

  rows = len(completions[0])
  scored = stages.Scored([""] * rows, [""] * rows, ["synthetic/mod3"] * rows, np.zeros(rows, np.float32), {})
  logprobs = []
  for t, done in zip((full, lora), completions):
    packed = stages.pack(prompt_ids, done, scored, P=t.P, R=t.R, n=t.cfg.rollout.n, pad_id=t.pad_id,
                         mask_eos_ids=t.mask_eos_ids, host_inputs=lambda ids, mask: {})
    with jax.set_mesh(t.mesh):
      mb = batching.to_minibatches(packed, t.batch_layout, t.mesh, 1)[0]
      logprobs.append((np.asarray(t.programs.logprob_fn(t.state.params, mb, *t.frozen_args)),
                       np.asarray(t.programs.ref_logprob_fn(t.ref_params, mb))))
  (full_old, full_ref), (lora_old, lora_ref) = logprobs
  np.testing.assert_array_equal(lora_old, full_old)  # the policy with B = 0 ...
  np.testing.assert_array_equal(lora_ref, full_ref)  # ... and the reference, the base without adapters
  np.testing.assert_array_equal(lora_old, lora_ref)


# ---------------------------------------------------------------------------------------------------------
# Two LoRA steps of each algorithm; the base stays as it was loaded.

@pytest.fixture(scope="module")
def hf_bases(tmp_path_factory):
  """Two tiny random Qwen2 checkpoints of one shape (seeds 0 and 1), as hf.save_pretrained writes them."""
  out = []
  for seed in (0, 1):
    d = tmp_path_factory.mktemp(f"base{seed}")
    mc = config_lib.preset_model_config(tiny())
    hf.save_pretrained(model_registry.causal_lm(mc, rngs=nnx.Rngs(seed)), str(d))
    out.append(str(d))
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_bases):
  """{algorithm: (workdir, trainer after 2 LoRA steps, base as loaded)}; PACS's on the first HF base, GRPO's and
  PPO's saving the norms and the (tied) embeddings too."""
  out = {}
  for algorithm in ("pacs", "grpo", "ppo"):
    workdir = tmp_path_factory.mktemp(algorithm) / "run"
    on_hf = {"model.hf_path": hf_bases[0]} if algorithm == "pacs" else {"lora.modules_to_save": "norm,embed_tokens"}
    t = trainer(workdir, algorithm=algorithm, **{**LORA, **on_hf})
    base, adapters = leaves(t.base), leaves(t.state.params)
    t.run()
    out[algorithm] = (workdir, t, base, adapters)
  return out


@pytest.mark.parametrize("algorithm", ["pacs", "grpo", "ppo"])
def test_two_lora_steps_train_the_adapters_only(runs, algorithm):
  workdir, t, base, adapters = runs[algorithm]
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["loss"]) and r["skipped_updates"] == 0 for r in rows)
  assert rows[-1]["lr"] == pytest.approx(t.cfg.train.lr)  # the rule at width 64: min(10, 64 / (2 alpha)) = 1
  for before, after in zip(base, leaves(t.base)):  # the base: neither trained nor donated
    np.testing.assert_array_equal(before, after)
  assert any(not np.array_equal(a, b) for a, b in zip(adapters, leaves(t.state.params)))
  saved = {p: v for p, v in nnx.to_flat_state(t.state.params) if p[-1].startswith("saved_")}
  assert len(saved) == (0 if algorithm == "pacs" else 4)  # input, post-attention and final norms; embeddings
  for path, copy in saved.items():  # trained, the base weight it copies untouched
    base_weight = np.asarray(dict(nnx.to_flat_state(t.base))[path[:-1] + (path[-1].removeprefix("saved_"),)].get_value())
    assert not np.array_equal(np.asarray(copy.get_value()), base_weight), path
  if algorithm == "ppo":  # the critic trains its own adapters, saved copies and value head on the policy's base
    names = {p[-1] for p, _ in nnx.to_flat_state(t.state.critic_params)}
    assert names == {"value_kernel", "value_bias"} | {p[-1] for p, _ in nnx.to_flat_state(t.state.params)}
    assert rows[-1]["critic/grad_norm"] > 0


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs, tmp_path):
  workdir, t, _, _ = runs["grpo"]
  full_dir = tmp_path / "full"
  trainer(full_dir, algorithm="grpo").run()
  adapters = sorted(("params", *p, "value") for p, _ in nnx.to_flat_state(t.state.params))
  assert saved_params(workdir, 2) == adapters
  # 14 adapters (A and B of 7 projections) and 4 saved copies (3 norms, the embeddings): no base weight.
  assert all(p[-2].endswith(("_lora_a", "_lora_b")) or p[-2].startswith("saved_") for p in adapters)
  assert len(adapters) == 18
  lora_bytes, full_bytes = state_bytes(workdir, 2), state_bytes(full_dir, 2)
  n_adapters, n_full = (sum(x.size for x in jax.tree.leaves(p)) for p in (t.state.params, nnx.state(
      nnx.merge(t.frozen.ref_graphdef, t.base), nnx.Param)))
  print(f"\ncheckpoint state of the tiny model: LoRA rank 8 saving norms and embeddings {lora_bytes} bytes "
        f"({n_adapters} adapter and saved parameters + "
        f"Adam moments), full {full_bytes} bytes ({n_full} parameters + Adam moments)")
  # params, mu, nu of the adapters alone in fp32 (and a few scalars): no base weight.
  assert 3 * 4 * n_adapters <= lora_bytes < 3 * 4 * n_adapters + 3 * 4 * n_full / 10
  n_saved = sum(v.get_value().size for p, v in nnx.to_flat_state(t.state.params) if p[-1].startswith("saved_"))
  assert lora_bytes - 3 * 4 * n_saved < full_bytes / 3  # the adapters' part; the saved copies add their own size


# ---------------------------------------------------------------------------------------------------------
# Refusals, one line naming the field.

@pytest.mark.parametrize("overrides, message", [
    ({"lora.rank": -1}, "config.lora.rank: must be a positive integer (0 = off"),
    ({"lora.alpha": 8.0}, "config.lora.rank: is 0 (LoRA off), but lora.alpha is set"),
    ({"lora.rank": 33}, "config.lora.rank: 33 is above the smaller side of the k projection's [64, 32] matrix"),
    ({"lora.rank": 8, "lora.targets": "q,attn"}, "config.lora.targets: 'attn' is neither a projection"),
    ({"lora.rank": 8, "lora.alpha": 0.0}, "config.lora.alpha: must be positive"),
    ({"lora.rank": 8, "lora.modules_to_save": "norm,mlp"},
     "config.lora.modules_to_save: 'mlp' names model.layers.0.mlp, which is neither a norm nor the embeddings or LM head"),
])
def test_bad_lora_settings_are_refused_naming_the_field(overrides, message, tmp_path):
  with pytest.raises(config_lib.ConfigError) as e:
    trainer(tmp_path / "run", **overrides)
  assert message in str(e.value) and "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "run")


def test_a_rank_above_an_hf_models_matrix_is_refused(hf_bases, tmp_path):
  with pytest.raises(config_lib.ConfigError, match=r"config\.lora\.rank: 40 is above the smaller side"):
    trainer(tmp_path / "run", **{"model.hf_path": hf_bases[0], "lora.rank": 40})


@pytest.mark.parametrize("change, message", [
    ({"lora.rank": 4}, "another lora (lora.rank: 8 -> 4); adapters are resumed with the settings they were trained"),
    ({"lora.alpha": 16.0}, "another lora (lora.alpha: 32.0 -> 16.0)"),
    ({"lora.rank": 0}, "another lora (lora.rank: 8 -> 0)"),
    ("other base", "another base (base.sha256: "),
])
def test_a_resume_with_other_adapters_or_on_another_base_is_refused(runs, hf_bases, change, message, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(runs["pacs"][0], workdir)
  overrides = {"model.hf_path": hf_bases[1], **LORA} if change == "other base" else {
      "model.hf_path": hf_bases[0], **LORA, **change}
  t = trainer(workdir, steps=3, **overrides)
  with pytest.raises(checkpoint_lib.CheckpointMismatch) as e:
    t.run()
  assert f"checkpoints: checkpoint step 2 was trained with {message}" in str(e.value) and "\n" not in str(e.value)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]


def test_a_full_runs_checkpoint_is_not_resumed_as_lora_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  trainer(workdir, steps=1).run()
  before = sorted(os.listdir(workdir / "checkpoints"))
  env = {**os.environ, "XLA_FLAGS": child_env.xla_flags(),
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": child_env.pythonpath(ROOT)}
  args = [f"--config.{k}={v}" for k, v in {**RUN, "steps": 3, "lora.rank": 8}.items()]
  result = subprocess.run([sys.executable, "-m", "pacs_jax.train", "--config", TINY, "--workdir", str(workdir),
                           *args], capture_output=True, text=True, timeout=300, env=env)
  noise = ("All log messages before absl::InitializeLog() is called", "cudart_stub.cc")  # jax's CUDA plugin
  lines = [line for line in result.stderr.splitlines() if line.strip() and not any(n in line for n in noise)]
  assert result.returncode == errors.EXIT_CHECKPOINT, result.stderr
  assert len(lines) == 1 and "checkpoint step 1 was trained with another lora (lora.rank: 0 -> 8)" in lines[0], lines
  assert sorted(os.listdir(workdir / "checkpoints")) == before
