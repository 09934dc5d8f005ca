"""Packed rows: a micro-batch's sequences (each prompt's real tokens, then its response's) end to end in rows of
`T` tokens, so the log-prob passes and the update compute only the tokens that exist (as the released runs' verl
actor with `use_remove_padding`), never the left padding of short prompts or the right padding of short
responses.

Each sequence keeps its own segment id (1, 2, ... in a row; 0 on the row's padding) and its own positions (0 at
its first token), so attention never crosses from one sequence into another and every real token's hidden state
is the padded layout's. `response_index` maps the packed layout back: for each response position j it names the
packed position whose hidden state predicts response token j (the token before it), so log-probs and values
come back [m, R] per response and the objectives read what they always read.

The number of packed rows b is a rung of a small fixed ladder (`ladder`) up to a row budget (by default a padded
micro-batch's m rows, so packing never holds more than the padded layout), the same for every micro-batch of a step
and every process, so the compiled programs take a handful of shapes, each compiled once. Where the sequences are
short, one packed micro-batch takes several padded ones (`merges`: a token budget, as verl's dynamic batch size),
whole prompt groups still, dealt so that the merged micro-batches hold about the same tokens (`balanced_order`);
the gradient accumulation weighs micro-batches exactly, so any split gives the same update.

Shapes: m responses of a micro-batch, L = P + R tokens of the padded layout (prompt left-padded to P, response
right-padded to R), b packed rows of T tokens.
"""

from __future__ import annotations

import math

import numpy as np


def sequence_spans(attention_mask: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
  """[m, L] padded attention mask -> (prompt lengths [m], response lengths [m]): its real tokens on each side of
  the prompt / response boundary P = L - R (the response runs to its mask's end, its first EOS included)."""
  P = attention_mask.shape[1] - R
  prompt = (attention_mask[:, :P] > 0).sum(axis=1)
  response = (attention_mask[:, P:] > 0).sum(axis=1)
  return prompt.astype(np.int64), response.astype(np.int64)


def place(lengths: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray, int]:
  """First-fit decreasing: sequences of `lengths` [m] into rows of T tokens -> (row [m], offset [m], rows used).
  Longest first (ties in order), each into the first row with room; deterministic."""
  if lengths.size and lengths.max() > T:
    raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit packed rows of {T} tokens")
  row, offset = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
  used: list[int] = []  # tokens filled in each open row
  for i in np.argsort(-lengths, kind="stable"):
    for r, filled in enumerate(used):
      if filled + lengths[i] <= T:
        break
    else:
      r = len(used)
      used.append(0)
    row[i], offset[i] = r, used[r]
    used[r] += int(lengths[i])
  return row, offset, len(used)


def rows_needed(attention_mask: np.ndarray, R: int, T: int) -> int:
  """The packed rows one micro-batch's sequences ([m, L] padded attention mask) fill."""
  prompt, response = sequence_spans(attention_mask, R)
  return place(prompt + response, T)[2]


def ladder(m: int, shards: int, rungs: int) -> tuple[int, ...]:
  """The packed row counts a run compiles for: `rungs` steps from m / rungs up to m (the row budget: by default a
  padded micro-batch's rows, every sequence in a row of its own), each rounded up to a multiple of `shards` (the
  rows are split over the batch's devices)."""
  return tuple(sorted({min(m, shards * math.ceil(m * i / rungs / shards)) for i in range(1, rungs + 1)}))


def merges(k: int) -> tuple[int, ...]:
  """How many of a mini-batch's k micro-batches one packed micro-batch may take, largest first: the powers of two
  that divide k."""
  return tuple(f for f in (2 ** i for i in range(k.bit_length() - 1, -1, -1)) if k % f == 0)


def balanced_order(lengths: np.ndarray, n: int, m: int, k: int, f: int) -> np.ndarray:
  """The row order [rows] that merges f micro-batches at a time: each mini-batch's (k micro-batches of m rows)
  groups of n rows dealt to its k / f packed micro-batches, the same number of groups in each, the longest group
  (prompt + response tokens) first into the one holding the fewest tokens so far (verl's balanced partitions for
  its dynamic batch size, with equal counts: every packed micro-batch keeps f x m responses), in their own order
  within each. A group never leaves its mini-batch, so the update is the same; the packed micro-batches need
  about the same rows, so the step's rung (their most) wastes less. f = 1 keeps each padded micro-batch's own
  groups (an unmerged packed update is the padded one micro-batch by micro-batch, its metrics too), as does
  f = k (one packed micro-batch) or groups that straddle micro-batches (m not a multiple of n)."""
  order = np.arange(len(lengths))
  bins = k // f
  if f == 1 or bins == 1 or m % n:
    return order
  per_bin = f * m // n  # groups in each packed micro-batch
  for start in range(0, len(lengths), k * m):
    tokens = lengths[start:start + k * m].reshape(-1, n).sum(axis=1)  # [groups of the mini-batch]
    held, members = np.zeros(bins), [[] for _ in range(bins)]
    for g in np.argsort(-tokens, kind="stable"):
      open_bins = [b for b in range(bins) if len(members[b]) < per_bin]
      b = min(open_bins, key=lambda b: held[b])
      held[b] += tokens[g]
      members[b].append(g)
    groups = np.concatenate([sorted(b) for b in members])
    order[start:start + k * m] = start + (groups[:, None] * n + np.arange(n)).reshape(-1)
  return order


def rows_by_merge(lengths: np.ndarray, n: int, m: int, k: int, T: int) -> dict[int, int]:
  """{f: the most packed rows any merged micro-batch takes} for each merge f of `merges(k)`: a step's sequences
  (`lengths`, prompt + response tokens of each row, groups of n rows in order) in micro-batches of m rows, k a
  mini-batch, taken f at a time in `balanced_order` (never across a mini-batch)."""
  out = {}
  for f in merges(k):
    ordered = lengths[balanced_order(lengths, n, m, k, f)]
    out[f] = max(place(ordered[i:i + f * m], T)[2] for i in range(0, len(lengths), f * m))
  return out


def choose(needed: dict[int, int], budget: int, rungs: tuple[int, ...]) -> tuple[int, int]:
  """(merge f, rows b): the most micro-batches one packed micro-batch takes whose rows fit the `budget`, at the
  smallest rung that holds them (f = 1 always fits: a padded micro-batch's sequences take at most its rows)."""
  for f in sorted(needed, reverse=True):
    if needed[f] <= budget:
      return f, rung(needed[f], rungs)
  raise ValueError(f"a micro-batch's sequences take {needed[1]} packed rows, more than the budget of {budget}")


def rung(needed: int, rungs: tuple[int, ...]) -> int:
  """The smallest rung that holds `needed` rows."""
  for b in rungs:
    if b >= needed:
      return b
  raise ValueError(f"{needed} packed rows exceed the ladder's top rung {rungs[-1]}")


def pack(input_ids: np.ndarray, attention_mask: np.ndarray, R: int, T: int, rows: int, pad_id: int,
         row_offset: int = 0) -> dict[str, np.ndarray]:
  """One micro-batch's padded rows (input_ids, attention_mask [m, L]) packed into `rows` rows of T tokens:
  {tokens, segment_ids, positions: [rows, T] int32; response_index: [m, R] int32}.

  response_index[i, j] is the flat position (row * T + column, rows counted from `row_offset`: this process's
  first row of the global micro-batch) of the hidden state that predicts response token j of sequence i, for j
  up to and including its response length ℓ (j = ℓ < R is the position after its last token: what verl's
  remove-padding forward reads there, and PPO's critic values); `(row_offset + rows) * T`, past every row, for
  the positions after that (their log-probs and values come back 0).
  """
  m, L = input_ids.shape
  P = L - R
  prompt, response = sequence_spans(attention_mask, R)
  if np.any(prompt == 0):
    raise ValueError(f"row {int(np.argmax(prompt == 0))} has an empty prompt: no token predicts its first response "
                     "token")
  row, offset, used = place(prompt + response, T)
  if used > rows:
    raise ValueError(f"the micro-batch's {m} sequences fill {used} packed rows of {T} tokens, more than {rows}")
  tokens = np.full((rows, T), pad_id, np.int32)
  segment_ids = np.zeros((rows, T), np.int32)
  positions = np.zeros((rows, T), np.int32)
  end = (row_offset + rows) * T
  response_index = np.full((m, R), end, np.int32)
  segments_in_row = np.zeros(rows, np.int32)
  for i in range(m):
    real = attention_mask[i] > 0
    seq = np.concatenate([input_ids[i, :P][real[:P]], input_ids[i, P:][real[P:]]])  # prompt then response
    r, c, n = row[i], offset[i], len(seq)
    segments_in_row[r] += 1
    tokens[r, c:c + n] = seq
    segment_ids[r, c:c + n] = segments_in_row[r]
    positions[r, c:c + n] = np.arange(n)
    first = (row_offset + r) * T + c + prompt[i] - 1  # predicts response token 0
    valid = min(response[i] + 1, R)
    response_index[i, :valid] = first + np.arange(valid)
  return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "response_index": response_index}
