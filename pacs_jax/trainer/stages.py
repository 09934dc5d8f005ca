"""A training step's stages, each a function of plain values: rollout -> score -> pack -> update -> record.

`Trainer.train_one_step` runs them in this order on one element of the prompt pipeline; an overlapped rollout can
run `rollout` ahead and the others on what it returned. Rows of one prompt's group are contiguous
(row = prompt * n + sample).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pacs_jax.algos import batch as batch_lib
from pacs_jax.rollout import interface
from pacs_jax.rollout.interface import Completion
from pacs_jax.services import metrics as metrics_lib
from pacs_jax.services import multihost
from pacs_jax.trainer import adapters as adapters_lib
from pacs_jax.trainer import packing
from pacs_jax.trainer import programs as programs_lib
from pacs_jax.trainer import train_state as state_lib


def rollout(sampler: interface.Rollout, prompt_ids: list[list[int]], *, P: int, n: int, max_new_tokens: int,
            sampling, seed: int, on_finish: Callable[[], None] | None = None) -> list[Completion]:
  """This process's completions of a rollout over every process's prompts (all run the same global one) by the
  weights `sampler` holds; `on_finish()` is called as each response finishes. Run under the mesh its weights
  live on."""
  completions = generate(sampler, multihost.gather_prompts(prompt_ids, P), n=n, max_new_tokens=max_new_tokens,
                         sampling=sampling, seed=seed, on_finish=on_finish)
  return multihost.local_share(completions, len(prompt_ids))


def generate(sampler: interface.Rollout, prompts: list[list[int]], *, n: int, max_new_tokens: int, sampling,
             seed: int, on_finish: Callable[[], None] | None = None) -> list[Completion]:
  """Every completion of the global rollout of `prompts` (every process's, processes in order), prompt-major."""
  return sampler.generate(prompts, n=n, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                          on_finish=on_finish)


@dataclasses.dataclass(frozen=True)
class Scored:
  """A step's responses as text with the verifier's verdicts, one entry per completion (row)."""
  texts: list[str]
  answers: list[str]  # the ground truth each was compared with
  data_sources: list[str]
  scores: np.ndarray  # [rows] float32
  stats: dict[str, int]  # the verifier's counts: errors, timeouts


def score(scorer, tokenizer, prompts: dict[str, Any], completions: list[Completion]) -> Scored:
  """Decodes each response and scores it against its prompt's answer (`prompts`: the pipeline's element, lists
  per field)."""
  texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
  answers = [prompts["answer"][c.prompt_index] for c in completions]
  data_sources = [prompts["data_source"][c.prompt_index] for c in completions]
  scores, stats = scorer.score_batch(texts, answers, data_sources)
  return Scored(texts, answers, data_sources, scores, stats)


def pack(prompt_ids: list[list[int]], completions: list[Completion], scored: Scored, *, P: int,
         R: int, n: int, pad_id: int, mask_eos_ids,
         host_inputs: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
         shape_rewards: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
         version: int | None = None, whole_responses: bool = False) -> packing.PackedRollout:
  """The responses as host rows (prompt left-padded to P, response right-padded to R), checked to be grouped
  prompt-major; `host_inputs(input_ids, attention_mask)`: the algorithm's extra host fields;
  `shape_rewards(scores, response_mask)`: the rewards the loss sees (None: the verifier's scores); the loss
  mask is the response mask less each completion's inserted tokens (`packing.loss_mask`); `version`:
  the policy the update starts from, which marks the rows sampled by an older one (`stale_rows`; None: untracked);
  `whole_responses`: the response mask covers each response's tokens (conversations, `packing.pack_rows`)."""
  input_ids, attention_mask, resp_mask = packing.pack_rows(prompt_ids, completions, P, R, pad_id, mask_eos_ids,
                                                           whole_responses)
  packing.check_groups(input_ids, attention_mask, P, n)
  scores = np.asarray(scored.scores, np.float32)
  rewards = scores if shape_rewards is None else np.asarray(shape_rewards(scores, resp_mask), np.float32)
  return packing.PackedRollout(input_ids, attention_mask, resp_mask, rewards, scored.data_sources,
                               [c.finish_reason for c in completions], extra=host_inputs(input_ids, attention_mask),
                               scores=None if shape_rewards is None else scores,
                               behaviour_logprobs=packing.behaviour_logprobs(completions, R),
                               stale_rows=None if version is None else np.asarray(
                                   [c.policy_version < version for c in completions], bool),
                               loss_mask=packing.loss_mask(completions, resp_mask))


def update(programs: programs_lib.Programs, state: state_lib.TrainState, ref_params, packed: packing.PackedRollout,
           layout: batch_lib.BatchLayout, mesh, num_minibatches: int, base: nnx.State
           ) -> tuple[state_lib.TrainState, list[dict]]:
  """Reference / old log-probs (and values) for the whole step first, then the algorithm's step inputs, then one
  optimizer update per mini-batch (the last one moves the step counter and the RNG on). `ref_params`: a frozen
  reference, or None for the policy that sampled the step; `base`: the run's frozen part (empty in a full run), the
  programs' last argument (the reference's own weights are all it runs on). With the rollout correction (`layout`
  holds `behaviour_logprobs`), each mini-batch's metrics gain the importance weights' statistics
  (`correction.importance_stats`). With the sampling policy as reference, a row
  sampled by an older policy than this one (`packed.stale_rows`) takes its behaviour log-probs as its reference
  (over its response); a fresh row takes π_old, as released. Returns the new state (`state` is donated) and each
  mini-batch's metrics (device scalars)."""
  old, ref, values = batch_lib.OLD_LOGPROBS.name, batch_lib.REF_LOGPROBS.name, batch_lib.OLD_VALUES.name
  passes = layout.names(batch_lib.PASS)
  with jax.set_mesh(mesh):
    packed, plan = packing.arrange(packed, layout, num_minibatches)  # packed: rows in the order they pack
    minibatches = packing.to_minibatches(packed, layout, mesh, num_minibatches, plan)
    behaviour = None
    if ref in passes and ref_params is None:  # per micro-batch as packed (several padded ones may be one packed one)
      behaviour = packing.rollout_reference(packed, minibatches[0]["loss_mask"].shape[0], mesh, num_minibatches)
    for j, mb in enumerate(minibatches):
      if old in passes:
        mb[old] = programs.logprob_fn(state.params, mb, base)
      if ref in passes:  # a frozen copy (or base), or the policy that sampled this step (e.g. PACS "rollout")
        mb[ref] = mb[old] if ref_params is None else programs.ref_logprob_fn(ref_params, mb, adapters_lib.NO_BASE)
        if behaviour is not None:
          mb[ref] = _stale_reference(mb[old], behaviour[j]["behaviour"], behaviour[j]["stale"], mb["loss_mask"])
      if values in passes:
        mb[values] = programs.value_fn(state.critic_params, mb, base)
    if programs.step_inputs is not None:
      for mb, inputs in zip(minibatches, programs.step_inputs(minibatches)):
        mb.update(inputs)
    for mb in minibatches:  # before the first update donates the state
      if sorted(mb) != sorted(layout.names()):
        raise ValueError(f"mini-batch fields {sorted(mb)}, expected {sorted(layout.names())}")
    corrected = batch_lib.BEHAVIOUR_LOGPROBS.name in layout.names()
    stats = [programs.importance_stats(mb[old], mb[batch_lib.BEHAVIOUR_LOGPROBS.name], mb["loss_mask"])
             for mb in minibatches] if corrected else [{} for _ in minibatches]
    per_minibatch = []
    for j, mb in enumerate(minibatches):
      state, m = programs.train_step(state, mb, programs_lib.ends_step(mesh, j == len(minibatches) - 1), base)
      per_minibatch.append({**m, **stats[j]})
  return state, per_minibatch


@jax.jit
def _stale_reference(old_logprobs, behaviour_logprobs, stale, loss_mask):
  """[k, m, R]: the behaviour log-probs over the responses of the stale rows [k, m], π_old elsewhere."""
  take = stale[..., None] & (loss_mask > 0)
  return jnp.where(take, behaviour_logprobs.astype(old_logprobs.dtype), old_logprobs)


def step_metrics(per_minibatch: list[dict]) -> dict[str, float]:
  """The step's update metrics: the mini-batches' mean, but the running count of skipped updates as it ends and the
  largest of a `*_max`."""
  def over_step(k):
    values = [np.asarray(m[k]) for m in per_minibatch]
    if k == "skipped_updates":
      return float(values[-1])
    return float(np.max(values) if k.endswith("_max") else np.mean(values))
  return {k: over_step(k) for k in per_minibatch[0]}


def staleness_metrics(completions: list[Completion], version: int) -> dict[str, float]:
  """How many policy versions behind `version` (the policy the update starts from) each response's sampler was,
  over every process's responses: mean, max, and the fraction at each lag (the histogram)."""
  lags = multihost.gather_rows(np.asarray([[version - c.policy_version] for c in completions], np.float32))[:, 0]
  out = {"rollout/staleness_mean": float(np.mean(lags)), "rollout/staleness_max": float(np.max(lags))}
  for lag in np.unique(lags):
    out[f"rollout/staleness_frac/{int(lag)}"] = float(np.mean(lags == lag))
  return out


class Clock:
  """When each stage of a step ended (`lap`), from the clock's creation."""

  def __init__(self):
    self.start = time.perf_counter()
    self.laps: dict[str, float] = {}

  def lap(self, stage: str) -> None:
    self.laps[stage] = time.perf_counter()

  def metrics(self, tokens: float) -> dict[str, float]:
    """Seconds per stage (packing counts in the update) and tokens per second over the step."""
    rollout, reward, update = self.laps["rollout"], self.laps["score"], self.laps["update"]
    step_s = update - self.start
    return {"timing/rollout_s": rollout - self.start, "timing/reward_s": reward - rollout,
            "timing/update_s": update - reward, "timing/step_s": step_s,
            "throughput/tokens_per_s": tokens / max(step_s, 1e-9)}


def record(update_metrics: dict[str, float], packed: packing.PackedRollout, scored: Scored, clock: Clock,
           source_names: list[str], n: int) -> dict[str, float]:
  """The step's metrics row: the update's, then reward, accuracy per data source and response lengths over every
  process's rows (groups of n), then the timings."""
  row = dict(update_metrics)
  row.update(packing.rollout_metrics(packed, scored.stats, source_names, n))
  tokens = float(np.sum(packed.attention_mask)) * jax.process_count()
  row.update(clock.metrics(tokens))
  return row


def dump(directory: str, step: int, tokenizer, prompt_ids: list[list[int]],
         completions: list[Completion], scored: Scored, extra: dict[str, list] | None = None) -> None:
  """`directory/<step>.jsonl`: each response with its prompt, score and ground truth (the released dumps), and
  `extra`'s columns (a conversation's turns)."""
  inputs = metrics_lib.prompt_texts(tokenizer, prompt_ids, [c.prompt_index for c in completions])
  metrics_lib.dump_generations(directory, step, inputs, scored.texts, scored.scores, scored.data_sources,
                               scored.answers, extra=extra)


def validation_metrics(scorer, tokenizer, records: list[dict], prompt_ids: list[list[int]],
                       completions: list[Completion], *, dump_dir: str, step: int) -> dict[str, float]:
  """Validation's accuracy per data source (`val/accuracy...`) of one response to each record's prompt; with
  `dump_dir`, the responses are written there too (by process 0: every process ran the same validation)."""
  texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
  answers, data_sources = [r["answer"] for r in records], [r["data_source"] for r in records]
  scores, _ = scorer.score_batch(texts, answers, data_sources)
  if dump_dir and jax.process_index() == 0:
    inputs = metrics_lib.prompt_texts(tokenizer, prompt_ids, [c.prompt_index for c in completions])
    metrics_lib.dump_generations(dump_dir, step, inputs, texts, scores, data_sources, answers,
                                 extra={"reward": [float(x) for x in scores]})
  return packing.per_source_mean(scores, data_sources, "val/accuracy")
