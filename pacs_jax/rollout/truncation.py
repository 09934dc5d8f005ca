"""The top-p and top-k supports on a 151,936-token vocabulary without sorting it (issue 35).

Top-p (`nucleus`): with z = logits + Gumbel noise, a draw from the nucleus renormalised is the argmax of z over
the nucleus (Gumbel-max). The argmax over the tokens not yet ruled out is in the nucleus iff the probability of
the tokens ordered before it (higher logit, or equal and lower id, as a stable sort orders them) is < p: one
masked sum. If not, it and every token after it are ruled out and the next argmax is tried (a round).
  - Round 1 is plain sampling's own draw (the argmax of z over the whole vocabulary) and its normaliser: it adds
    the masked sum, which shares a pass over the vocabulary with the normaliser's sum.
  - A round misses with probability at most 1 - p, whatever the logits: the nucleus holds at least p of the
    mass, and a round's candidates are the nucleus and part of the tail, whose argmax is independent of the
    rounds before (the candidates and the ruled-out tokens are disjoint sets of independent Gumbels).
  - Later rounds run on a fixed number of rows per batch shard (`retry_sizes`), gathered: first one round on
    the first S1 rows still out, then a loop of rounds on S2 rows at a time until every row is in; rows past S1
    (rare) take round 1's way on the whole batch in a cond. Which rows a round takes changes nothing of a row's
    draw: its rounds depend on its own logits and noise only.

Top-k (`top_k`): the k largest logits lie in the k blocks of the vocabulary with the largest maxima (any token of
another block has k block maxima, k distinct tokens, before it), so `lax.top_k` runs on the blocks' maxima and
then on those k blocks only: the same values and ids as `lax.top_k` over the whole vocabulary, ties included.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pacs_jax import sharding


def _mesh_size(axes) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else math.prod(dict(mesh.shape).get(a, 1) for a in axes)


def batch_groups(rows: int) -> int:
  """G: the current mesh's batch shards (`jax.set_mesh`) when they divide the rows, else 1. Later rounds take
  their rows within each group, so no row moves between devices."""
  g = _mesh_size(sharding.BATCH_AXES)
  return g if rows % g == 0 else 1


def retry_sizes(rows_per_group: int, p: float) -> tuple[int, int]:
  """(S1, S2): the rows per group of the second round and of each later round. A round misses with probability
  at most 1 - p, so about (1 - p) x rows need a second round: S1 covers twice that and more (a multiple of 8),
  S2 twice S1's share of misses (rows past S1 wait for the loop)."""
  q = 1.0 - p
  s1 = min(rows_per_group, 8 * math.ceil((2 * q * rows_per_group + 2) / 8))
  return s1, min(s1, max(2, math.ceil(2 * q * s1)))


def _before(x, logit, token, ids):
  """[..., V]: the tokens ordered before (logit, token) [...] by (logit descending, id ascending)."""
  return (x > logit[..., None]) | ((x == logit[..., None]) & (ids < token[..., None]))


def argmax_and_logit(z: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(j, x[j]) with j = argmax of z over the last axis (the lower id among equal values): one pass."""
  ids = lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)

  def pick(a, b):
    first = (a[0] > b[0]) | ((a[0] == b[0]) & (a[2] < b[2]))
    return tuple(jnp.where(first, u, v) for u, v in zip(a, b))

  init = (jnp.array(-jnp.inf, z.dtype), jnp.array(0, x.dtype), jnp.array(jnp.iinfo(jnp.int32).max, jnp.int32))
  _, logit, j = lax.reduce((z, x, ids), init, pick, (z.ndim - 1,))
  return j, logit


def normaliser(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(m, s): m = max x (0 where not finite), s = sum exp(x - m) over the last axis, as the log-probs take them
  (`models.token_logprobs`): log-sum-exp = m + log s."""
  m = jnp.max(x, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return m, jnp.sum(jnp.exp(x - m[..., None]), axis=-1)


class Rows(NamedTuple):
  """Per row [B]: the draw so far, whether it is in the nucleus, and the candidates' bound (the tokens before
  (floor, floor_id) are not ruled out); m, s: the row's normaliser."""
  token: jax.Array
  logit: jax.Array
  done: jax.Array
  floor: jax.Array
  floor_id: jax.Array
  m: jax.Array
  s: jax.Array


def _round(x, z, rows: Rows, p: float, first: bool) -> Rows:
  """One round on rows x, z [..., V] with their state [...]."""
  ids = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  candidates = z if first else jnp.where(_before(x, rows.floor, rows.floor_id, ids), z, -jnp.inf)
  j, logit = argmax_and_logit(candidates, x)
  mass = jnp.sum(jnp.where(_before(x, logit, j, ids), jnp.exp(x - rows.m[..., None]), 0.0), axis=-1) / rows.s
  inside = mass < p
  keep = lambda new, old: jnp.where(rows.done, old, new)
  return Rows(token=keep(j, rows.token), logit=keep(logit, rows.logit), done=rows.done | inside,
              floor=keep(jnp.where(inside, rows.floor, logit), rows.floor),
              floor_id=keep(jnp.where(inside, rows.floor_id, j), rows.floor_id), m=rows.m, s=rows.s)


def _subset_round(x, src, draw, rows: Rows, p: float, size: int) -> Rows:
  """A round on the first `size` rows still out (the others as they are)."""
  order = jnp.argsort(rows.done, stable=True)[:size]  # [S]: rows still out first
  x_rows = x[order]
  new = _round(x_rows, draw(x_rows, jax.tree.map(lambda a: a[order], src)), Rows(*(a[order] for a in rows)), p,
               first=False)
  return Rows(*(a.at[order].set(n) for a, n in zip(rows, new)))


def _rows_by_matmul(x, order, ok):
  """x[order] for x [b, V] and order [S] by a one-hot matmul, exact where `ok` (finite rows away from float32's
  smallest magnitudes; the other rows read as 0): the TPU keeps the logits batch-minor, where a row gather is a
  relayout of the whole array; the matrix unit reads them in place."""
  onehot = (order[:, None] == jnp.arange(x.shape[0])).astype(x.dtype)
  return jnp.einsum("sb,bv->sv", onehot, jnp.where(ok[:, None], x, 0.0), precision=lax.Precision.HIGHEST)


def _buffer_rounds(x, z, src, draw, rows: Rows, ok, p: float, sizes: tuple[int, int], regenerate: bool):
  """The rounds after the first on one batch shard's rows [b]: its first S1 rows still out whose logits are
  `ok` are gathered once (a buffer), take a round, then rounds on S2 of them at a time until all are in (a loop of
  no fixed count, on the buffer only). Returns (rows, the loop's round count)."""
  order = jnp.argsort(rows.done | ~ok, stable=True)[:sizes[0]]  # [S1]: rows to take first
  taken = ~rows.done[order] & ok[order]
  src_buf = src[order]
  if regenerate:
    x_buf = _rows_by_matmul(x, order, ok)
    z_buf = lambda x_rows, src_rows: draw(x_rows, src_rows)
  else:  # z as round 1 made it: its rows gathered, not drawn again
    x_buf, src_buf = x[order], (src_buf, z[order])
    z_buf = lambda x_rows, src_rows: src_rows[1]
  buf = Rows(*(a[order] for a in rows))
  buf = _round(x_buf, z_buf(x_buf, src_buf), buf._replace(done=~taken), p, first=False)
  buf, rounds = lax.while_loop(lambda c: ~jnp.all(c[0].done),
                               lambda c: (_subset_round(x_buf, src_buf, z_buf, c[0], p, sizes[1]), c[1] + 1),
                               (buf, jnp.int32(0)))
  return Rows(*(a.at[order].set(jnp.where(taken, n, a[order])) for a, n in zip(rows, buf))), rounds


def _later_rounds(x, z, src, draw, rows: Rows, p: float, sizes: tuple[int, int], regenerate: bool):
  """The rounds after the first: each batch shard's buffer (`_buffer_rounds`), then the rows no buffer took
  (past S1, or with logits not finite or below 2^-100 in magnitude) in a cond: round 1's way on the whole batch.
  `regenerate`: the later rounds draw their rows' noise again and gather rows by a matmul (what the TPU's
  batch-minor logits want), else they gather z (the CPU's cheaper way). Both give the same draws."""
  B, V = x.shape
  groups = batch_groups(B)
  ok = jnp.all(jnp.isfinite(x) & ((x == 0) | (jnp.abs(x) >= 2.0 ** -100)), axis=-1)
  split = lambda a: a.reshape(groups, B // groups, *a.shape[1:])
  later = jax.vmap(lambda *a: _buffer_rounds(*a[:3], draw, *a[3:], p, sizes, regenerate))
  rows, rounds = later(split(x), split(z), split(src), Rows(*map(split, rows)), split(ok))
  rows = Rows(*(a.reshape(B) for a in rows))
  with jax.named_scope(OVERFLOW):
    z_all = (lambda: draw(x, src)) if regenerate else (lambda: z)
    everyone = lambda r: lax.while_loop(lambda r: ~jnp.all(r.done), lambda r: _round(x, z_all(), r, p, False), r)
    rows = lax.cond(jnp.all(rows.done), lambda r: r, everyone, rows)
  return rows, jnp.max(rounds)


# The name of the branch that takes the rows the buffer did not (`nucleus`): the cost report weighs it by how
# often it runs.
OVERFLOW = "nucleus_overflow"


def nucleus(scaled: jax.Array, src: jax.Array, draw, p: float, sizes: tuple[int, int] | None = None,
            with_rounds: bool = False, regenerate: bool | None = None):
  """Top-p draw of each row: (token [B] int32, its logit [B], m [B], s [B]) (`normaliser`), plus the buffer
  loop's round count with `with_rounds`. scaled: logits / temperature [B, V] fp32; `draw(x, src)`: the
  Gumbel-perturbed logits z of rows whose logits are x [..., V] and whose rows of `src` [B, ...] are src [..., ...]
  (a key per row, or z itself); sizes: (S1, S2) instead of `retry_sizes`; regenerate: `_later_rounds`'s choice
  (None: on a CPU no, elsewhere yes)."""
  B, V = scaled.shape
  sizes = sizes or retry_sizes(B // batch_groups(B), p)
  m, s = normaliser(scaled)
  zeros = jnp.zeros((B,), jnp.int32)
  rows = Rows(token=zeros, logit=jnp.zeros((B,)), done=jnp.zeros((B,), bool), floor=jnp.full((B,), jnp.inf),
              floor_id=zeros, m=m, s=s)
  z = draw(scaled, src)
  rows = _round(scaled, z, rows, p, first=True)
  later = lambda regen: lambda *a: _later_rounds(*a[:3], draw, a[3], p, sizes, regen)
  if regenerate is None:
    rows, rounds = lax.platform_dependent(scaled, z, src, rows, cpu=later(False), default=later(True))
  else:
    rows, rounds = later(regenerate)(scaled, z, src, rows)
  out = (rows.token, rows.logit, rows.m, rows.s)
  return (*out, rounds) if with_rounds else out


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x, k)` of x [B, V] (the same values and ids, the lower id first among equals) by the blocks'
  maxima: one pass over the vocabulary and a `lax.top_k` over V / block + k x block values, not over V."""
  B, V = x.shape
  block = next((c for c in (128, 64, 32, 16) if V % (c * _mesh_size(("tensor",))) == 0 and V >= 16 * k * c), 0)
  if not block:
    return lax.top_k(x, k)
  blocks = x.reshape(B, V // block, block)
  _, chosen = lax.top_k(jnp.max(blocks, axis=-1), k)  # [B, k]
  chosen = jnp.sort(chosen, axis=-1)  # in id order, so that lax.top_k's ties fall as over the whole row
  values, at = lax.top_k(jnp.take_along_axis(blocks, chosen[..., None], axis=1).reshape(B, k * block), k)
  return values, jnp.take_along_axis(chosen, at // block, axis=-1) * block + at % block


def loop_rounds(rows: int, groups: int, p: float, trials: int = 20_000, seed: int = 0):
  """Simulated `nucleus` steps of a batch of `rows` in `groups` shards when every round misses with probability
  1 - p (the most it can: an upper bound in distribution for any logits), each step's slowest shard counted (the
  shards meet at the next step): (the buffer loop's round counts [trials], whether a shard overflowed its buffer
  [trials], the overflow loop's round counts [trials]); what the compiled cost of top-p counts the loops of no
  fixed count at (benchmarks/sampling_cost.py)."""
  b, q = rows // groups, 1.0 - p
  s1, s2 = retry_sizes(b, p)
  rng = np.random.default_rng(seed)
  out = rng.binomial(b, q, size=(trials, groups))  # rows out after round 1
  left = out - np.minimum(out, s1)  # past the buffer
  out = rng.binomial(np.minimum(out, s1), q)  # buffer rows out after its first round
  rounds = np.zeros((trials, groups), np.int64)
  while out.any():
    rounds += out > 0
    taken = np.minimum(out, s2)
    out = out - taken + rng.binomial(taken, q)
  overflow_rounds = np.zeros((trials, groups), np.int64)
  while left.any():
    overflow_rounds += left > 0
    left = rng.binomial(left, q)
  return rounds.max(axis=1), (overflow_rounds > 0).any(axis=1), overflow_rounds.max(axis=1)
