"""A step's completions as training arrays (rows prompt-major, mini-/micro-batches of whole groups) and their stats.

Rows of one prompt's group are contiguous (row = prompt * n + sample).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pacs_jax.algos import batch as batch_lib
from pacs_jax.rollout import interface as rollout_interface
from pacs_jax.services import multihost
from pacs_jax.trainer import programs as programs_lib
from pacs_jax.trainer import sequence_packing


@dataclasses.dataclass
class PackedRollout:
  """One step's rollout packed into rows: this process's rows (numpy), ordered prompt-major (row = prompt * n +
  sample), before `to_minibatches` splits them into the run's `Batch`es."""
  input_ids: np.ndarray  # [rows, P + R] int32
  attention_mask: np.ndarray  # [rows, P + R] int32
  response_mask: np.ndarray  # [rows, R] float32: each response's extent (up to its first EOS); lengths, shaping
  rewards: np.ndarray  # [rows] float32
  data_sources: list[str]
  finish_reasons: list[str]
  # The algorithm's host inputs ([rows, R] each; `Algorithm.host_inputs`), e.g. PACS's padding replication.
  extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # The verifier's verdicts [rows] where the algorithm shaped them into `rewards` (`Algorithm.shape_rewards`, e.g.
  # DAPO's overlong penalty); None: the objective does not shape, the rewards are the verdicts.
  scores: np.ndarray | None = None
  # The rollout engine's log-probs of each response token [rows, R] (0 past its end): the behaviour policy of the
  # rollout correction (`batch.BEHAVIOUR_LOGPROBS`); None when not packed.
  behaviour_logprobs: np.ndarray | None = None
  # [rows] bool: responses sampled by an older policy than the one the update starts from (the overlapped modes);
  # with the sampling policy as reference their reference is their behaviour log-probs. None: all fresh.
  stale_rows: np.ndarray | None = None
  # [rows, R] float32: the positions every objective's sums run over (`loss_mask`): the response mask with the
  # tokens a rollout inserted (`Completion.loss_mask` 0) taken out. None: nothing inserted, the response mask.
  loss_mask: np.ndarray | None = None

  def __post_init__(self):
    if self.loss_mask is None:
      self.loss_mask = self.response_mask


def response_mask(responses: np.ndarray, eos_ids) -> np.ndarray:
  """[rows, R] -> 1 up to and including each row's first token in `eos_ids`, 0 after (float32).

  verl's get_response_mask (verl/utils/torch_functional.py): (cumsum(is_eos) − is_eos) == 0.
  """
  is_eos = np.isin(responses, np.asarray(list(eos_ids))).astype(np.int64)
  return ((np.cumsum(is_eos, axis=1) - is_eos) == 0).astype(np.float32)


def pack_rows(prompts: list[list[int]], completions: list[rollout_interface.Completion], P: int, R: int,
              pad_id: int, mask_eos_ids, whole_responses: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Prompt left-padded to P, response right-padded to R with `pad_id`: (input_ids, attention_mask, response_mask).

  As verl's vLLM rollout: the response mask (and the response part of the attention mask) runs up to and
  including the first of `mask_eos_ids` in the padded response, or to R without one. Inserted tokens are part
  of both (attended to); `loss_mask` takes them out of the loss. `whole_responses`: the mask runs over each
  response's tokens instead (a conversation: its turns end with the stop token, its last one where it ended).
  """
  rows = len(completions)
  input_ids = np.full((rows, P + R), pad_id, np.int32)
  attention_mask = np.zeros((rows, P + R), np.int32)
  for row, comp in enumerate(completions):
    prompt = prompts[comp.prompt_index]
    input_ids[row, P - len(prompt):P] = prompt
    attention_mask[row, P - len(prompt):P] = 1
    toks = comp.tokens[:R]
    input_ids[row, P:P + len(toks)] = toks
  if whole_responses:
    lengths = np.asarray([min(len(c.tokens), R) for c in completions])[:, None]
    mask = (np.arange(R)[None, :] < lengths).astype(np.float32)  # [rows, R]
  else:
    mask = response_mask(input_ids[:, P:], mask_eos_ids)  # [rows, R]
  attention_mask[:, P:] = mask.astype(np.int32)
  return input_ids, attention_mask, mask


def loss_mask(completions: list[rollout_interface.Completion], response_mask: np.ndarray) -> np.ndarray:
  """[rows, R] float32: `response_mask` times each response's `Completion.loss_mask` (1 past its tokens), so an
  inserted token (0) gets no loss while the extent stays the response mask's; all ones leave it exactly as is."""
  out = response_mask.copy()
  R = response_mask.shape[1]
  for row, comp in enumerate(completions):
    mask = np.asarray(comp.loss_mask, np.float32)[:R]
    out[row, :len(mask)] *= mask
  return out


def behaviour_logprobs(completions: list[rollout_interface.Completion], R: int) -> np.ndarray:
  """[rows, R] float32: each response's log-probs as the rollout engine sampled it, right-padded with 0."""
  out = np.zeros((len(completions), R), np.float32)
  for row, comp in enumerate(completions):
    logprobs = np.asarray(comp.logprobs, np.float32)[:R]
    out[row, :len(logprobs)] = logprobs
  return out


def to_minibatches(rollout: PackedRollout, layout: batch_lib.BatchLayout, mesh, num_minibatches: int,
                   plan: tuple[int, int] | None = None) -> list[batch_lib.Batch]:
  """Splits local rows into mini-batches of whole groups: the `layout`'s host fields [k, m, ...] each, as global
  arrays over (data, fsdp). Packed, the rows must be in `arrange`'s order with its `plan` (f, b); without one they
  are arranged here (the mini-batches then hold the rows in that order)."""
  if layout.packed and plan is None:
    rollout, plan = arrange(rollout, layout, num_minibatches)
  behaviour = {} if rollout.behaviour_logprobs is None else {"behaviour_logprobs": rollout.behaviour_logprobs}
  arrays = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask, "loss_mask": rollout.loss_mask,
            "rewards": rollout.rewards, **rollout.extra, **behaviour}
  if layout.packed:
    arrays, k = packed_rows(arrays, layout, num_minibatches, *plan)  # k: packed micro-batches (merging changes no row shape)
    return split_rows(layout.host_rows(arrays), k, mesh, num_minibatches)
  return split_rows(layout.host_rows(arrays), layout.k, mesh, num_minibatches)


def arrange(rollout: PackedRollout, layout: batch_lib.BatchLayout, num_minibatches: int
            ) -> tuple[PackedRollout, tuple[int, int] | None]:
  """A packed layout's plan for this step: (the rollout's rows in the order they pack, (f, b)): f of the step's
  micro-batches taken at a time (the most that fit the row budget, `sequence_packing.choose`), their groups dealt
  so each packed micro-batch holds about the same tokens (`sequence_packing.balanced_order`; a group never leaves
  its mini-batch), b rows each (the smallest rung that holds every one), f and b agreed over the processes
  (each deals its own rows). The padded layout: (the rollout as it is, None)."""
  if not layout.packed:
    return rollout, None
  R, T, n = layout.R, layout.row_tokens, layout.group
  m_local = rollout.input_ids.shape[0] // (num_minibatches * layout.k)
  prompt, response = sequence_packing.sequence_spans(rollout.attention_mask, R)
  lengths = prompt + response
  needed = sequence_packing.rows_by_merge(lengths, n, m_local, layout.k, T)
  processes = jax.process_count()
  merges = sorted(needed)
  agreed = multihost.gather_rows(np.asarray([[needed[f] for f in merges]], np.int64)).max(axis=0)  # every process's
  f, b = sequence_packing.choose({f: int(rows) * processes for f, rows in zip(merges, agreed)}, layout.row_ladder[-1],
                                 layout.row_ladder)
  order = sequence_packing.balanced_order(lengths, n, m_local, layout.k, f)
  return take(rollout, order), (f, b // processes)


def take(rollout: PackedRollout, order: np.ndarray) -> PackedRollout:
  """The rollout's rows in `order` (every per-row field; itself if `order` is the identity)."""
  if np.array_equal(order, np.arange(len(order))):
    return rollout
  rows = lambda a: None if a is None else (np.asarray(a)[order] if isinstance(a, np.ndarray) else [a[i] for i in order])
  return dataclasses.replace(
      rollout, **{f.name: rows(getattr(rollout, f.name)) for f in dataclasses.fields(rollout) if f.name != "extra"},
      extra={name: a[order] for name, a in rollout.extra.items()})


def packed_rows(arrays: dict[str, np.ndarray], layout: batch_lib.BatchLayout, num_minibatches: int, f: int,
                b: int) -> tuple[dict[str, np.ndarray], int]:
  """(the host rows of a packed layout, k' = k / f packed micro-batches per mini-batch): the local rows (in
  `arrange`'s order) taken f x m at a time, each such micro-batch's sequences packed into this process's b rows of
  T tokens (`sequence_packing.pack`; `batch.PACKED_FIELDS`, [micro-batches * b local rows, T] and [rows, R]), and
  input_ids / attention_mask cut to their last 1 + R columns (what the objectives read of them)."""
  ids, mask = arrays["input_ids"], arrays["attention_mask"]
  R, T = layout.R, layout.row_tokens
  per_packed = ids.shape[0] // (num_minibatches * layout.k) * f  # local rows of one packed micro-batch
  parts = [sequence_packing.pack(ids[s:s + per_packed], mask[s:s + per_packed], R, T, b, pad_id=0,
                                 row_offset=jax.process_index() * b) for s in range(0, ids.shape[0], per_packed)]
  out = dict(arrays, input_ids=ids[:, -(R + 1):], attention_mask=mask[:, -(R + 1):])
  for name in parts[0]:
    out[name] = np.concatenate([p[name] for p in parts])
  return out, layout.k // f


def split_rows(arrays: dict[str, np.ndarray], k: int, mesh, num_minibatches: int) -> list[batch_lib.Batch]:
  """Host arrays {name: [rows, ...]} -> `num_minibatches` dicts of global arrays [k, m, ...] over (data, fsdp)
  (packed rows: [k, b, ...])."""
  out = []
  for j in range(num_minibatches):
    mb = {}
    for name, a in arrays.items():
      per_mb = a.shape[0] // num_minibatches
      local = a[j * per_mb:(j + 1) * per_mb].reshape((k, per_mb // k) + a.shape[1:])
      global_shape = (local.shape[0], local.shape[1] * jax.process_count()) + local.shape[2:]
      mb[name] = jax.make_array_from_process_local_data(programs_lib.minibatch_sharding(mesh, local.ndim), local,
                                                        global_shape)
    out.append(mb)
  return out


def rollout_reference(rollout: PackedRollout, k: int, mesh, num_minibatches: int) -> list[batch_lib.Batch] | None:
  """Per mini-batch, the stale rows' flags [k, m] (`stale`) and behaviour log-probs [k, m, R] (`behaviour`): what
  the sampling-policy reference takes from the behaviour policy; None when no row is stale (every process's) or
  staleness is not tracked (`stale_rows` None: the synchronous path, which calls no collective here)."""
  if rollout.stale_rows is None or not multihost.any_process([bool(np.any(rollout.stale_rows))])[0]:
    return None
  return split_rows({"stale": rollout.stale_rows, "behaviour": rollout.behaviour_logprobs}, k, mesh,
                    num_minibatches)


def check_groups(input_ids: np.ndarray, attention_mask: np.ndarray, prompt_len: int, n: int) -> None:
  """Raises unless each group of n consecutive rows holds one prompt (the group baselines compare its
  responses); the released compute_pacs_loss asserts the same (pacs_core_algos.py)."""
  prompts = np.where(attention_mask[:, :prompt_len] > 0, input_ids[:, :prompt_len], -1)  # [rows, P]
  if prompts.shape[0] % n:
    raise ValueError(f"{prompts.shape[0]} rows do not split into groups of n={n}")
  groups = prompts.reshape(-1, n, prompt_len)
  differs = np.any(groups != groups[:, :1], axis=(1, 2))
  if differs.any():
    g = int(np.argmax(differs))
    raise ValueError(f"rows {g * n}..{g * n + n - 1} should be the n={n} responses of one prompt, but their prompts "
                     "differ: the batch is not grouped prompt-major (row = prompt * n + sample)")


def rollout_metrics(packed: PackedRollout, reward_stats: dict, source_names: list[str], n: int) -> dict[str, float]:
  """Reward (the verifier's mean; `reward/shaped_mean` the shaped rewards' where the objective shapes them),
  accuracy per data source, response lengths, the share of groups (n rows each) whose rewards differ among those
  the loss sees: over every process's rows (the global batch; each process's rows are whole groups)."""
  source_ids = np.asarray([source_names.index(s) for s in packed.data_sources], np.float32)
  finished_by_length = np.asarray([r == "length" for r in packed.finish_reasons], np.float32)
  counts = np.asarray([reward_stats.get("errors", 0), reward_stats.get("timeouts", 0)], np.float32)
  scores = packed.rewards if packed.scores is None else packed.scores
  trained = (packed.loss_mask.sum(-1) > 0).astype(np.float32)  # 0: a row no loss sees (dynamic sampling's filler)
  rows = np.stack([packed.rewards, packed.response_mask.sum(-1), finished_by_length, source_ids, scores, trained],
                  axis=1)  # [rows, 6]
  rows, counts = multihost.gather_rows(rows), multihost.sum_over_processes(counts)
  rewards, lengths, clipped, ids, scores, trained = rows.T
  m = {"reward/mean": float(np.mean(scores)),
       "response_length/mean": float(np.mean(lengths)),
       "response_length/max": float(np.max(lengths)),
       "response_length/clip_ratio": float(np.mean(clipped)),
       "reward/errors": float(counts[0]),
       "reward/timeouts": float(counts[1]),
       "reward/mixed_groups": mixed_groups(rewards, n, trained > 0)}
  if packed.scores is not None:  # the loss saw shaped rewards (e.g. DAPO's overlong penalty): their mean too
    m["reward/shaped_mean"] = float(np.mean(rewards))
  m.update(per_source_mean(scores, [source_names[int(i)] for i in ids], "accuracy"))  # the verifier's, unshaped
  return m


def mixed_groups(rewards: np.ndarray, n: int, trained: np.ndarray | None = None) -> float:
  """The share of groups (n consecutive rows of [rows] rewards) whose rewards are not all equal: the groups that
  give an objective comparing a prompt's responses (GRPO, PACS) a non-zero gradient. `trained` [rows]: a group
  none of whose rows the loss sees (all False: dynamic sampling's filler) counts as giving none."""
  groups = np.asarray(rewards).reshape(-1, n)  # [groups, n]
  differ = np.any(groups != groups[:, :1], axis=1)
  if trained is not None:
    differ &= np.asarray(trained, bool).reshape(-1, n).any(axis=1)
  return float(np.mean(differ))


def per_source_mean(scores, data_sources: list[str], prefix: str) -> dict[str, float]:
  scores = np.asarray(scores, np.float64)
  out = {}
  for src in sorted(set(data_sources)):
    sel = np.asarray([d == src for d in data_sources])
    out[f"{prefix}/{src}"] = float(scores[sel].mean())
  if data_sources:
    out[f"{prefix}/all"] = float(scores.mean())
  return out
