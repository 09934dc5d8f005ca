"""The training batch's vocabulary: a `Batch` (the arrays), its `Field`s and a run's `BatchLayout` (which fields,
what sizes), every field named once with its dtype, shape and origin (docs/design.md, "Batch vocabulary").

A mini-batch is a `Batch` {field name: array [k, m, *per-row axes]}: k micro-batches of m rows (whole prompt
groups, rows prompt-major: row = prompt * n + sample); a micro-batch is a `Batch` of [m, ...] arrays. The host
packs the rollout's fields (`packing.to_minibatches`, from a `packing.PackedRollout`), the compile-only path
builds the same fields abstractly (`programs.minibatch_shapes`), the trainer fills the rest before the first
update, and the step reads them. Which fields a run has follows from its algorithm (`Algorithm.batch_fields`):
the shared ones below, plus what the algorithm declares (`Algorithm.extra_fields`, in the same terms). Control
flags (the update that ends a training step) are arguments of the step, never fields.

Shapes: k micro-batches, m rows per micro-batch, L = P + R tokens (prompt left-padded to P, response
right-padded to R), R response positions. A packed layout (`BatchLayout.row_tokens`, trainer/sequence_packing.py)
runs the model on b packed rows of T tokens ([k, b, T] fields, axis letter "T") and keeps of the padded rows only
what the objectives read: their last 1 + R columns (L = 1 + R: the last prompt position and the response).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

# A mini-batch ({field: [k, m, ...]}) or a micro-batch ({field: [m, ...]}) of a `BatchLayout`'s fields.
Batch = dict[str, jax.Array]

# Where a field comes from.
HOST = "host"  # packed on the host from the step's rollout (`packing.to_minibatches`)
PASS = "pass"  # a log-prob or value pass over the mini-batch before the step's first update
STEP = "step"  # the algorithm's `step_inputs`, over the whole step's batch (after the passes)
SOURCES = (HOST, PASS, STEP)


class Reference(enum.Enum):
  """Whose log-probs a mini-batch's `ref_logprobs` are (docs/algorithm.md, "The reference policy")."""
  NONE = "none"  # no reference term: no `ref_logprobs` field
  FROZEN = "frozen"  # a frozen copy of the initial policy, kept beside the trained one
  ROLLOUT = "rollout"  # the policy that sampled this step: its old log-probs, computed before the first update


@dataclasses.dataclass(frozen=True)
class Field:
  """One mini-batch field: [k, m, *axes] of `dtype`, axes letters "L" (tokens) or "R" (response positions); a
  packed row field ("T", the row's tokens) is [k, b, T] (b packed rows)."""
  name: str
  dtype: Any  # a numpy / jax.numpy dtype
  axes: tuple[str, ...]
  source: str

  def __post_init__(self):
    if self.source not in SOURCES or not set(self.axes) <= {"L", "R", "T"}:
      raise ValueError(f"field {self.name!r}: source one of {SOURCES}, axes of 'L' / 'R' / 'T', got {self}")

  @property
  def packed(self) -> bool:
    """A packed rows field ([k, b, T]), not one of the responses' rows ([k, m, ...])."""
    return "T" in self.axes


def per_response(name: str, dtype, source: str) -> Field:
  """A [k, m, R] field (one value per response position): what an algorithm's extra inputs are."""
  return Field(name, dtype, ("R",), source)


INPUT_IDS = Field("input_ids", jnp.int32, ("L",), HOST)  # prompt then response tokens, padded with pad_id
ATTENTION_MASK = Field("attention_mask", jnp.int32, ("L",), HOST)  # 1 on real tokens
# What every objective's sums run over: 1 on the model's response tokens (up to and including the first EOS), 0 on
# padding and on tokens the rollout inserted (`Completion.loss_mask`; those stay in the attention mask).
LOSS_MASK = per_response("loss_mask", jnp.float32, HOST)
REWARDS = Field("rewards", jnp.float32, (), HOST)  # the verifier's outcome reward of each response
ROLLOUT_FIELDS = (INPUT_IDS, ATTENTION_MASK, LOSS_MASK, REWARDS)
# The rollout engine's log-probs of the sampled tokens, as sampled (0 past a response's end): the behaviour policy of
# the rollout correction (`rollout.tis_imp_ratio_cap`, algos/correction.py).
BEHAVIOUR_LOGPROBS = per_response("behaviour_logprobs", jnp.float32, HOST)
OLD_LOGPROBS = per_response("old_logprobs", jnp.float32, PASS)  # the sampling policy's (ratios, rollout ref)
REF_LOGPROBS = per_response("ref_logprobs", jnp.float32, PASS)  # the reference policy's (`Algorithm.reference`)
OLD_VALUES = per_response("old_values", jnp.float32, PASS)  # the critic's before the step's updates
# Packed rows (trainer/sequence_packing.py): the model's inputs, b rows of T tokens, sequences end to end.
TOKENS = Field("tokens", jnp.int32, ("T",), HOST)  # prompt then response tokens of each sequence, pad_id after
SEGMENT_IDS = Field("segment_ids", jnp.int32, ("T",), HOST)  # 1, 2, ... per sequence in a row; 0 on padding
POSITIONS = Field("positions", jnp.int32, ("T",), HOST)  # each token's position in its own sequence
# For each response position, the flat packed position (row * T + column) whose hidden state predicts it (b * T:
# none, 0 comes back): log-probs and values return to the responses' [m, R] layout through it.
RESPONSE_INDEX = per_response("response_index", jnp.int32, HOST)
PACKED_FIELDS = (TOKENS, SEGMENT_IDS, POSITIONS, RESPONSE_INDEX)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """One run's mini-batch format: its fields and sizes (k micro-batches of m rows, P + R tokens). Packed
  (`row_tokens` T > 0): the model reads b = `packed_rows` rows of T tokens (`PACKED_FIELDS`; b is the step's rung
  of `row_ladder`), and the "L" fields keep their last 1 + R columns."""
  fields: tuple[Field, ...]
  k: int
  m: int
  P: int
  R: int
  row_tokens: int = 0  # T: packed rows' length; 0 = the padded layout
  row_ladder: tuple[int, ...] = ()  # the packed row counts b compiled for (`sequence_packing.ladder`)
  packed_rows: int = 0  # b of `abstract` (default: the ladder's top, every sequence in a row of its own)
  group: int = 1  # n: rows of one prompt's group (consecutive), which a packed micro-batch keeps whole

  def __post_init__(self):  # (an algorithm's `extra_fields` may not reuse a name)
    names = [f.name for f in self.fields]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
      raise ValueError(f"mini-batch fields named twice: {twice} (of {names})")

  @classmethod
  def of(cls, cfg: ml_collections.ConfigDict, fields: tuple[Field, ...], k: int, m: int, row_tokens: int = 0,
         row_ladder: tuple[int, ...] = ()) -> BatchLayout:
    """`fields` (an algorithm's `batch_fields`) in k micro-batches of m rows, sized by `cfg`'s prompt and
    response lengths; with `row_tokens`, packed (`PACKED_FIELDS` added)."""
    if row_tokens:
      fields = tuple(fields) + PACKED_FIELDS
    return cls(tuple(fields), k, m, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens, row_tokens,
               tuple(row_ladder), group=cfg.rollout.n)

  @property
  def packed(self) -> bool:
    return self.row_tokens > 0

  def with_rows(self, b: int, merge: int = 1) -> BatchLayout:
    """This layout at b packed rows (`abstract`'s shapes), `merge` micro-batches in each packed one."""
    return dataclasses.replace(self.merged(merge), packed_rows=b)

  def merged(self, f: int) -> BatchLayout:
    """Packed micro-batches that each take f of this layout's (k / f of f x m responses), the same row budget."""
    if self.k % f:
      raise ValueError(f"{f} micro-batches per packed one do not divide k = {self.k}")
    return dataclasses.replace(self, k=self.k // f, m=self.m * f)

  def names(self, source: str | None = None) -> tuple[str, ...]:
    """The fields' names (those from `source` only, if given)."""
    return tuple(f.name for f in self.fields if source is None or f.source == source)

  def row_shape(self, field: Field) -> tuple[int, ...]:
    """The per-row axes' sizes of `field`."""
    sizes = {"L": 1 + self.R if self.packed else self.P + self.R, "R": self.R, "T": self.row_tokens}
    return tuple(sizes[a] for a in field.axes)

  def abstract(self, sharding: Callable[[int], jax.sharding.Sharding]) -> dict[str, jax.ShapeDtypeStruct]:
    """{name: ShapeDtypeStruct [k, m, *per-row axes]} ([k, b, T] packed rows), each in `sharding(ndim)`."""
    out = {}
    b = self.packed_rows or (self.row_ladder[-1] if self.row_ladder else self.m)
    for f in self.fields:
      shape = (self.k, b if f.packed else self.m) + self.row_shape(f)
      out[f.name] = jax.ShapeDtypeStruct(shape, f.dtype, sharding=sharding(len(shape)))
    return out

  def host_rows(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The host fields from `arrays` ({name: [rows, *per-row axes]}), in their dtypes; raises on a missing field
    or a wrong per-row shape."""
    out = {}
    for f in self.fields:
      if f.source != HOST:
        continue
      if f.name not in arrays:
        raise ValueError(f"mini-batch field {f.name!r} is missing from the host rows (have {sorted(arrays)})")
      a = np.asarray(arrays[f.name], f.dtype)
      if a.shape[1:] != self.row_shape(f):
        raise ValueError(f"mini-batch field {f.name!r}: rows of shape {a.shape[1:]}, expected {self.row_shape(f)}")
      out[f.name] = a
    return out
