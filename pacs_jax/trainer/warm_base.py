"""A base model taught by a short supervised warm-up before RL (`model.warmup`): next-token cross-entropy on the
rows' target tokens with AdamW, from the preset's seeded init. The tool demo's ("mul53_tools") knows the Python
tool's call and how to read its output, and rarely calls it on the task itself. Built once into
<workdir>/base_model (a Hugging Face directory) that the run then loads as its `model.hf_path`."""

# Why: RL amplifies what a base model already does now and then (the paper post-trains Qwen2.5, which calls a tool
# on some problems unasked). A random tiny model writes the 7-token call with the right operands with probability
# about 72^-7: never, so reward would stay at chance. The warm-up teaches the call and the reading of its output on
# a sister prompt form (`a * b % 53`, always called) and, on the task's own form (`a * b mod 53`), calls at
# `task_call_rate` and otherwise guesses a residue at random. The task's reward so starts near chance, and what RL
# has to learn is when to call: on every problem of the task's form.

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from pacs_jax import paths
from pacs_jax.data import prompts as prompts_lib
from pacs_jax.data import synthetic_tasks
from pacs_jax.envs import env as env_lib
from pacs_jax.envs import sandbox as sandbox_lib

DONE_FILE = "warmup.json"  # written last: a base_model folder without it is an interrupted build
BASE_DIR = "base_model"  # under the workdir


@dataclasses.dataclass(frozen=True)
class ToolWarmup:
  """The tool demo's base model (configs/tiny_tools_cpu.py): rows of synthetic/mul53 problems."""
  task: str = "mul53"
  sister_share: float = 0.5  # rows in the sister form `a * b % m`: always a call, its output, the answer
  task_call_rate: float = 0.03  # rows in the task's form that call; the others answer a random residue at once
  steps: int = 600  # the call and the copy of its output are learnt exactly (greedy, teacher-forced) by then
  batch: int = 64
  lr: float = 3e-3
  data_seed: int = 1234  # the rows' draw (the init is the run's `seed`)


WARMUPS = {"mul53_tools": ToolWarmup()}


def fit(model, ids: np.ndarray, attention: np.ndarray, loss_mask: np.ndarray, *, steps: int, batch: int,
        lr: float) -> float:
  """`steps` AdamW updates of the mean next-token cross-entropy over the positions whose next token is a target
  (`loss_mask` [B, T]: 1 where position t predicts a target at t + 1); update s takes rows [s * batch, (s + 1) *
  batch) of ids and attention [B, T]. Updates `model` (an nnx module) in place; returns the last loss."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = optax.adamw(lr, weight_decay=0.0)
  opt_state = optimizer.init(params)

  def loss_fn(params, ids, attention, loss_mask):
    logits = nnx.merge(graphdef, params)(ids, attention).astype(jnp.float32)  # [B, T, V]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    mask = loss_mask[:, :-1]
    return jnp.sum(nll * mask) / jnp.sum(mask)

  @jax.jit
  def step(params, opt_state, ids, attention, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids, attention, loss_mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  loss = float("nan")
  for i in range(steps):
    rows = slice(i * batch, (i + 1) * batch)
    params, opt_state, loss = step(params, opt_state, ids[rows], attention[rows], loss_mask[rows])
  nnx.update(model, params)
  return float(loss)


def left_padded(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Rows of (token ids, is-target per token) -> ids, attention mask and loss mask [B, T], left-padded; the loss
  mask marks the positions whose next token is a target (`fit`'s)."""
  T = max(len(ids) for ids, _ in rows)
  ids = np.full((len(rows), T), pad_id, np.int32)
  attention = np.zeros((len(rows), T), np.int32)
  loss_mask = np.zeros((len(rows), T), np.float32)
  for i, (row, targets) in enumerate(rows):
    ids[i, T - len(row):] = row
    attention[i, T - len(row):] = 1
    loss_mask[i, T - len(row):T - 1] = targets[1:]  # position t predicts token t + 1
  return ids, attention, loss_mask


def tool_rows(tokenizer, settings: ToolWarmup, n: int,
              template: env_lib.ToolTemplate = env_lib.QWEN25) -> list[tuple[list[int], list[int]]]:
  """`n` conversations as the tool rollout holds them: prompt, the model's call turn (closed by the turn end), the
  tool's turn with the program's output (envs/env.py's observation of an "ok" run) and the answer; or prompt and a
  random residue. The targets are the model's tokens."""
  task = synthetic_tasks.get_task(settings.task)
  rng = np.random.default_rng(settings.data_seed)
  word = tokenizer.convert_tokens_to_ids
  end = word(template.turn_end)
  rows = []
  for record in task.records(n, settings.data_seed):
    a, _, b, _, m = record["problem"].split()  # "a * b mod m"
    sister = rng.random() < settings.sister_share
    problem = f"{a} * {b} % {m}" if sister else record["problem"]
    prompt = [int(t) for t in prompts_lib.encode_prompts(tokenizer, [problem], None)[0]]
    if sister or rng.random() < settings.task_call_rate:
      call = [word(w) for w in (synthetic_tasks.TOOL_OPEN, a, "*", b, "%", m, synthetic_tasks.TOOL_CLOSE)] + [end]
      ran = sandbox_lib.Result(output=record["answer"] + "\n", kind="ok", seconds=0.0, exit_code=0)
      observation = tokenizer.encode(template.observation(sandbox_lib.format_observation(ran).removesuffix("\n")),
                                     add_special_tokens=False)
      answer = [word(record["answer"]), end]
      rows.append((prompt + call + observation + answer, [0] * len(prompt) + [1] * len(call) + [0] * len(observation)
                   + [1] * len(answer)))
    else:
      guess = [word(str(int(rng.integers(0, task.modulus)))), end]
      rows.append((prompt + guess, [0] * len(prompt) + [1] * len(guess)))
  return rows


def build(cfg, tokenizer, settings: ToolWarmup | None = None) -> tuple[object, float]:
  """The warmed-up policy of `settings` (default `model.warmup`'s: a `decoder.CausalLM` of the preset, init seed
  `cfg.seed`) and its last loss."""
  from flax import nnx

  from pacs_jax import config as config_lib
  from pacs_jax.models import families

  settings = settings or WARMUPS[cfg.model.warmup]
  model = families.causal_lm(config_lib.model_config(cfg), rngs=nnx.Rngs(cfg.seed))
  ids, attention, loss_mask = left_padded(tool_rows(tokenizer, settings, settings.steps * settings.batch),
                                          tokenizer.pad_token_id)
  return model, fit(model, ids, attention, loss_mask, steps=settings.steps, batch=settings.batch, lr=settings.lr)


def resolve(cfg, workdir: str, settings: ToolWarmup | None = None) -> None:
  """With `model.warmup` set: builds the base into <workdir>/base_model unless it is there (one line before, one
  after: it takes half a minute on 2 CPU cores), then makes the run load it (`model.hf_path`, `model.warmup`
  cleared), so the run's recorded config is a plain model path, the same on every resume. `settings`: in place of
  the named warm-up's (the study's shrunk one)."""
  if not cfg.model.warmup:
    return
  import jax

  from pacs_jax import config as config_lib

  if cfg.model.warmup not in WARMUPS:
    raise config_lib.ConfigError(f"config.model.warmup: {cfg.model.warmup!r} is not a built-in warm-up (one of "
                                 f"{sorted(WARMUPS)}, or '' for none)")
  if cfg.model.hf_path or cfg.lora.rank:
    raise config_lib.ConfigError("config.model.warmup: warms up the preset's random init for a full-parameter run; "
                                 f"set it to '' with model.hf_path ({cfg.model.hf_path!r}) or lora.rank "
                                 f"({cfg.lora.rank})")

  from pacs_jax.storage import hf_export

  out = paths.join(workdir, BASE_DIR)
  if not paths.isfile(paths.join(out, DONE_FILE)):
    settings = settings or WARMUPS[cfg.model.warmup]
    primary = jax.process_index() == 0
    if primary:
      print(f"warm-up: teaching the base model {cfg.model.warmup!r} ({settings.steps} supervised steps) ...",
            flush=True)
    start = time.time()
    from pacs_jax.trainer import build as build_lib
    tokenizer = build_lib.load_tokenizer(cfg)
    model, loss = build(cfg, tokenizer, settings)
    with paths.staged_dir(out, last=(DONE_FILE,)) as local:
      hf_export.save_model_dir(model, local, tokenizer)
      if primary:
        record = {"warmup": cfg.model.warmup, "settings": dataclasses.asdict(settings), "seed": cfg.seed,
                  "final_loss": loss}
        with open(f"{local}/{DONE_FILE}", "w") as f:
          json.dump(record, f, indent=2)
    if primary:
      print(f"warm-up: done in {time.time() - start:.0f} s (loss {loss:.3f}): {out}", flush=True)
  cfg.model.hf_path, cfg.model.warmup = out, ""
