"""pass@k evaluation: n sampled responses per problem, scored, written in the released layouts (ritzz-ai/PACS
src/inference.py): `eval_rollout.jsonl` (one line per problem, appended once all its samples are scored, so a
restart skips what is written) and `eval_metrics.json` ({data_source: {"pass@k": value}}); settings, counts and
accuracies in `eval_summary.json`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from pacs_jax import config as config_lib
from pacs_jax import paths
from pacs_jax.data import sources
from pacs_jax.envs import python_tool
from pacs_jax.eval import problems as problems_lib
from pacs_jax.eval import results
from pacs_jax.eval.eval_settings import EvalSettings
from pacs_jax.eval.results import ROLLOUT_FILE
from pacs_jax.rewards import named as reward_named

logger = logging.getLogger(__name__)


def evaluate(model: str, data: str | Sequence[str], settings: EvalSettings, *, out_dir: str | None = None,
             data_dir: str | None = None, step: int | None = None, mesh=None, scorer=None, reward_workers: int = 2,
             reward_timeout_s: float = 10.0, reward_fn: str = reward_named.BUILTIN,
             progress: bool = True) -> dict[str, Any]:
  """Samples, scores and writes what is missing from `out_dir` (default: beside the evaluated weights; for a
  training workdir, which is never written, `<workdir>-eval_step_<S>`); returns the summary written to
  `eval_summary.json` (settings, and per data source pass@k and counts over this evaluation's problems) and
  `out_dir`.

  `scorer`: anything with `score_batch(responses, answers, data_sources) -> (scores, stats)`
  (default: a `RewardScorer` of the reward `reward_fn` names, "package.module:function", in `reward_workers`
  processes).
  """
  from pacs_jax.storage import hf_export as storage_export
  with storage_export.model_to_evaluate(model, step) as (model_dir, default_out, name):
    out_dir = out_dir or default_out
    summary = _evaluate(model_dir, name, data, settings, out_dir, data_dir, mesh, scorer, reward_workers,
                        reward_timeout_s, reward_fn, progress)
  return summary | {"out_dir": paths.normalize(out_dir)}


def _evaluate(model_dir: str, name: str, data, settings: EvalSettings, out_dir: str, data_dir, mesh, scorer,
              reward_workers: int, reward_timeout_s: float, reward_fn: str, progress: bool) -> dict[str, Any]:
  """`evaluate` of the Hugging Face directory `model_dir`, recorded as `name`."""
  import jax
  from flax import nnx

  from pacs_jax.data import tokenizers
  from pacs_jax.models import hf
  from pacs_jax.rewards import pool as reward_pool
  from pacs_jax.rollout import interface
  from pacs_jax.rollout import local as local_rollout
  from pacs_jax.rollout import sampling as sampling_lib
  from pacs_jax.rollout import stop_tokens

  sampling = sampling_lib.from_config(settings.temperature, settings.top_k, settings.top_p)
  specs = problems_lib.resolve_data(data, data_dir)
  with paths.local_dir(model_dir, exclude=(".safetensors",)) as local_model:  # a gs:// model: a local copy
    tokenizer = tokenizers.load_tokenizer(local_model)
  problems, dropped = problems_lib.load_problems(specs, tokenizer, settings.max_prompt_length, settings.limit)
  if not problems:
    raise config_lib.ConfigError(f"--max_prompt_length={settings.max_prompt_length}: no problem of {specs} fits "
                                 f"(dropped per source: {dropped})")
  n = settings.n
  recorded = dataclasses.asdict(settings) | {"model": name, "data": specs}
  rollout_path = paths.join(out_dir, ROLLOUT_FILE)
  lines, others = results.read_rollout(rollout_path)
  if others:
    logger.warning("%s holds %d lines this project did not write: they are kept as they are", rollout_path, others)
  results.check_resumable(out_dir, recorded, lines, problems)
  todo = [p for p in problems if p.key not in lines]
  if todo:  # read before anything is written: weights that do not load leave the output folder as it was
    dtype = config_lib.dtype(settings.dtype)
    with paths.local_dir(model_dir) as local_model, (
        jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
      eos, _ = stop_tokens.stop_and_mask_ids(tokenizer, local_model, settings.stop_tokens)
      policy, _ = hf.load_pretrained(local_model, dtype=dtype, mesh=mesh, compute_dtype=dtype)
      hf.refuse_non_finite(nnx.state(policy, nnx.Param), model_dir)
  paths.makedirs(out_dir)
  results.keep_foreign_metrics(out_dir)

  def write_metrics(complete: bool) -> dict[str, Any]:
    summary = {"complete": complete, "settings": recorded} | results.compute_metrics(lines, problems, n, dropped)
    results.write_summary(out_dir, summary)
    if paths.isfile(rollout_path):
      results.write_released_metrics(out_dir)
    return summary

  summary = write_metrics(complete=not todo)  # records the settings before the first (long) chunk
  if not todo:
    return summary

  chunk = settings.problems_per_chunk()
  # No more slots than one chunk can fill (the KV cache is allocated per slot), and a multiple of the model
  # replicas so that the slots split evenly over them instead of being replicated.
  replicas = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
  slots = -(-min(settings.batch_slots, chunk * n) // replicas) * replicas
  sampler = local_rollout.LocalRollout(policy, slots=slots, max_prompt_length=settings.max_prompt_length,
                                       max_new_tokens=settings.max_new_tokens, mesh=mesh, eos_ids=eos)
  sampler.set_weights(policy, version=0)
  del policy
  own_scorer = scorer is None
  if own_scorer:
    scorer = reward_pool.RewardScorer(num_workers=reward_workers, timeout_s=reward_timeout_s, score_fn=reward_fn)
  # env "python_tool": each sample a conversation with the tool (its sandbox open until the last chunk is written)
  tools = None if settings.env == "single_turn" else python_tool.ToolSession(settings.to_config().env, tokenizer, eos)
  # A bar over the token budget (responses x max_new_tokens): it moves with every decode call, so its rate and
  # estimate are the decoding's (a response that stops early fills the rest of its budget as it ends).
  budget = n * settings.max_new_tokens
  bar = interface.token_bar("eval", total=len(problems) * budget, initial=(len(problems) - len(todo)) * budget,
                            leave=True, disable=not progress)
  ticks = interface.BarProgress(bar, compiling=True)  # a line says how long the first call (its compile) took
  results.repair_tail(rollout_path)
  try:
    if tools is not None:
      tools.open()
    for start in range(0, len(todo), chunk):
      batch = todo[start:start + chunk]
      if tools is None:
        completions = sampler.generate(
            [p.prompt_ids for p in batch], n=n, max_new_tokens=settings.max_new_tokens, sampling=sampling,
            seed=settings.seed, prompt_ids=[p.seed_id for p in batch], on_finish=ticks)
        texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
        scores, _ = scorer.score_batch(texts, [batch[c.prompt_index].answer for c in completions],
                                       [batch[c.prompt_index].data_source for c in completions])
        talks = [{} for _ in completions]
      else:
        completions, texts, scores, talks = _conversations(tools, sampler, scorer, batch, settings, sampling, ticks)
      samples: list[list[dict]] = [[None] * n for _ in batch]
      for c, text, score, talk in zip(completions, texts, scores, talks):
        samples[c.prompt_index][c.sample_index] = {"output": text, "score": float(score),
                                                   "finish_reason": c.finish_reason, "num_tokens": len(c.tokens),
                                                   **talk}
      new = [results.problem_line(p, s) for p, s in zip(batch, samples)]  # every problem's n samples are scored
      results.append_lines(rollout_path, new)
      lines.update({p.key: line for p, line in zip(batch, new)})
      summary = write_metrics(complete=start + chunk >= len(todo))
      bar.set_postfix_str(f"{ticks.responses} responses, accuracy {summary['overall']['mean_accuracy'] or 0:.3f}")
  finally:
    ticks.close()
    if tools is not None:
      tools.close()
    if own_scorer:
      scorer.close()
  return summary


def _conversations(tools, sampler, scorer, batch, settings: EvalSettings, sampling, ticks):
  """A chunk's samples as conversations with the tool: (completions, each conversation's text, its episode's
  reward, its turns, observations and ending)."""
  rows = [{"problem": p.user_message, "answer": p.answer, "data_source": p.data_source} for p in batch]
  completions, texts, episodes, _ = tools.scored(
      sampler, scorer, [p.prompt_ids for p in batch], rows, n=settings.n, max_new_tokens=settings.max_new_tokens,
      sampling=sampling, seed=settings.seed, seed_ids=[p.seed_id for p in batch], on_finish=ticks)
  return completions, texts, [e.reward for e in episodes], [python_tool.record(e) for e in episodes]


def summary_table(metrics: dict[str, Any]) -> str:
  """Plain-text table: one row per data source (by the name `--data` gives it: math500, not the files' math_500),
  pass@k columns in percent."""
  by_source = metrics["sources"]
  ks = sorted({int(name[5:]) for entry in by_source.values() for name in entry if name.startswith("pass@")})
  header = ["data_source", "problems"] + [f"pass@{k}" for k in ks]
  lines = [header]
  for source, entry in by_source.items():
    lines.append([sources.set_name(source), str(entry["num_problems_scored"])] +
                 [f"{100 * entry[f'pass@{k}']:.2f}" if f"pass@{k}" in entry else "-" for k in ks])
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
                   for line in lines)
