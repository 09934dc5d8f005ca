"""The KV-cache rollout `Engine`: the batched rollout programs (prefill, insert, decode) jitted with weights as an
argument, the decode state's layout on a mesh, and public `lower_*` hooks for ahead-of-time compiles. The decode
cache is paged (`decode_state.PagedCache`); which page budget a decode call runs at is `budget.PagePolicy`'s, and the
one-request-at-a-time surface JetStream serves is `single.SingleRequest`.

Shapes: B slots (or prompts in a prefill), T prompt bucket length, Q requests, V vocab, L cache rows per slot.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from pacs_jax import sharding
from pacs_jax.models import paged, paged_kernel
from pacs_jax.models.kv_cache import KVCache
from pacs_jax.models.decoder import CausalLM
from pacs_jax.models.model_config import ModelConfig
from pacs_jax.rollout import budget as budget_lib
from pacs_jax.rollout import continuation as continuation_lib
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout import slot_rungs as slot_rungs_lib
from pacs_jax.rollout import decode as decode_lib
from pacs_jax.rollout import page_allocation as pages_lib
from pacs_jax.rollout import decode_state as state_lib
from pacs_jax.rollout.decode_state import ChunkOutput, ContinuedTokens, DecodeState, FirstTokens

def _i32(*shape) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jnp.int32)


class Engine:
  """Prefill / insert / decode over `max_concurrent_decodes` slots, many requests and steps per device call.

  The engine holds the model's graphdef only; weights (an `nnx.State`) are an argument of every call,
  so a new policy is swapped in each training step without recompiling (same shapes and shardings).
  Each slot holds up to `max_prefill_length + max_decode_length` KV rows in pages of a shared pool. Prompts
  are right-padded to power-of-two buckets so prefill compiles a few shapes only.

  `prefill_batch` and `insert_requests` put many prompts into many slots; `decode` runs many steps per device
  call (`scheduler.generate` drives them); `continue_slots` feeds tokens into slots paused at a pause id (a
  conversation's next turn) after their KV prefix, in buckets of inserted tokens like the prompts'. EOS ids are
  traced arguments and sampling methods static ones, so changing the method compiles decode once more. `sampling`
  and `eos_ids` are the defaults of the lowering hooks and of `single.SingleRequest`.
  """

  def __init__(self, model: CausalLM, *, max_concurrent_decodes: int, max_prefill_length: int,
               max_decode_length: int, mesh: jax.sharding.Mesh | None = None,
               sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), eos_ids: Sequence[int] = (),
               steps_per_call: int = 16, min_prefill_bucket: int = 16, seed: int = 0, page_size: int = 64,
               kv_pages: int = 0, slot_rungs: int = 1):
    """`model` may be abstract (`nnx.eval_shape`): only its structure and shapes are kept.

    Slots hold pages of `page_size` rows taken as they grow and returned when they finish, from a pool per
    batch shard (slots and pages are split over the mesh's batch axes alike); `kv_pages` pages in all (0:
    enough for every slot at full length, so none waits). Decode reads each slot's live pages, padded to a
    page budget per shard (`budget.PagePolicy`: the smallest of `page_budgets` that holds every slot for
    the next `steps_per_call` steps). A decode program is compiled per page budget used. With `slot_rungs` > 1
    decode also runs over fewer slots (`slot_rungs.ladder`: B/2, B/4, ...) once few are busy: a program per rung.
    """
    self.config: ModelConfig = model.config
    self.graphdef, abstract = nnx.split(model)
    self._abstract = abstract
    self.max_concurrent_decodes = max_concurrent_decodes
    self.max_prefill_length = max_prefill_length
    self.max_decode_length = max_decode_length
    self.cache_length = max_prefill_length + max_decode_length
    self.mesh = mesh
    self.sampling = sampling
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.steps_per_call = steps_per_call
    self.seed = seed
    self.prefill_buckets = budget_lib.pow2_ladder(min_prefill_bucket, max_prefill_length)
    # A continuation feeds the pending token and its inserted tokens: at most every row of a slot.
    self.continue_buckets = budget_lib.pow2_ladder(min_prefill_bucket, self.cache_length - 1)
    # Token positions the model ran over (padding included), per program: the prefix of a continued slot is never
    # run again, so "continue" grows by the inserted tokens' buckets only.
    self.positions_run: collections.Counter = collections.Counter()
    if page_size < 1:
      raise ValueError(f"rollout.page_size must be >= 1, got {page_size}")
    self.page_size = page_size
    self.kv_pages = kv_pages
    # Slot b and its pages live on batch shard b // (B / Z); slots the mesh does not divide are one pool.
    self.page_shards = 1 if mesh is None else paged_kernel.batch_shards(dict(mesh.shape), max_concurrent_decodes)
    self.pages_per_slot = budget_lib.prompt_pages(self.cache_length, page_size)
    slots_per_shard = max_concurrent_decodes // self.page_shards
    if kv_pages == 0:  # every slot at full length, plus the null page
      self.pages_per_shard = slots_per_shard * self.pages_per_slot + 1
    else:
      self.pages_per_shard = kv_pages // self.page_shards
      if kv_pages % self.page_shards or self.pages_per_shard < self.pages_per_slot + 1:
        raise ValueError(
            f"rollout.kv_pages={kv_pages} must be a multiple of the {self.page_shards} batch shards with at least "
            f"{self.pages_per_slot + 1} pages each (one slot of {self.cache_length} rows in pages of "
            f"rollout.page_size={page_size}, and a null page), or 0 (enough for every slot)")
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    self.decode_kernel = paged.decode_kernel(self.config, platform, tensor)
    self.slot_rungs = slot_rungs_lib.ladder(max_concurrent_decodes, self.page_shards, slot_rungs)
    self.policy = budget_lib.PagePolicy.of(max_concurrent_decodes, self.page_shards, self.cache_length, page_size,
                                           steps_per_call, kernel=self.decode_kernel)
    self.param_shardings = sharding.state_shardings(abstract, mesh, "sample") if mesh is not None else None

    # Model-sized programs (prefill per bucket shape, decode) are kept apart from the cheap ones that
    # depend on the number of requests, so few large compiles are needed. Donating the decode state
    # lets XLA update the (large) cache in place.
    self._prefill_jit = jax.jit(self._prefill_impl)
    self._insert_requests_jit = jax.jit(self._insert_requests_impl, static_argnames=("sampling",),
                                        donate_argnums=(0,))
    self._decode_jit = jax.jit(self._decode_impl, static_argnames=("num_steps", "sampling", "page_budget", "rung"),
                               donate_argnums=(1,))
    self._continue_jit = jax.jit(self._continue_impl, static_argnames=("sampling",), donate_argnums=(1,))
    self._release_jit = jax.jit(self._release_impl, donate_argnums=(0,))
    self._init_jit = jax.jit(self._init_impl)

  @property
  def page_budgets(self) -> tuple[int, ...]:
    """The page budgets decode programs are compiled for (`budget.PagePolicy.page_budgets`)."""
    return self.policy.page_budgets

  # -- layout -----------------------------------------------------------------------------------

  def mesh_context(self):
    """The engine's mesh as the current one (`jax.set_mesh`), or nothing without a mesh."""
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def constrain(self, tree: DecodeState | KVCache):
    """The decode state (or a prefill cache) in its declared layout (`decode_state.field_shardings`), inside a trace."""
    if self.mesh is None:
      return tree
    cache = isinstance(tree, KVCache)
    shardings = state_lib.cache_shardings(tree, self.mesh) if cache else state_lib.field_shardings(tree, self.mesh)
    return jax.lax.with_sharding_constraint(tree, shardings)

  def replicate(self, tree):
    """Small outputs the host reads: replicated, so every process (multi-host) can read them whole."""
    if self.mesh is None:
      return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

  # -- params and state -------------------------------------------------------------------------

  def load_params(self, params_or_model: nnx.State | nnx.Module) -> nnx.State:
    """Policy weights in the sample-mode shardings (from train-mode ones, a module, or host arrays)."""
    params = nnx.state(params_or_model) if isinstance(params_or_model, nnx.Module) else params_or_model
    if self.param_shardings is not None:
      params = sharding.reshard(params, self.param_shardings)
    return params

  def model(self, params) -> CausalLM:
    """The model with weights `params` (inside a trace)."""
    return nnx.merge(self.graphdef, params)

  def _init_impl(self) -> DecodeState:
    B = self.max_concurrent_decodes
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    cache = pages_lib.init(self.config, B, self.cache_length, self.page_size, self.page_shards, self.pages_per_shard)
    state = DecodeState(cache=cache, lengths=jnp.zeros((B,), jnp.int32), tokens=jnp.zeros((B,), jnp.int32),
                        keys=jnp.zeros((B,) + key_shape, jnp.uint32), steps=jnp.zeros((B,), jnp.int32),
                        budgets=jnp.zeros((B,), jnp.int32), active=jnp.zeros((B,), bool))
    return self.constrain(state)

  def init_decode_state(self) -> DecodeState:
    """All slots empty: a zero cache (every page free), each field in its declared layout."""
    with self.mesh_context():
      return self._init_jit()

  def abstract_params(self, dtype=None) -> nnx.State:
    """The weights' shapes and sample-mode shardings (in `dtype`, default the parameter dtype), for
    ahead-of-time compiles: nothing is allocated."""
    is_var = lambda x: isinstance(x, nnx.Variable)
    shardings = self.param_shardings
    if shardings is None:
      shardings = jax.tree.map(lambda _: None, self._abstract, is_leaf=is_var)
    return jax.tree.map(lambda v, sh: v.replace(jax.ShapeDtypeStruct(v.shape, dtype or v.dtype, sharding=sh)),
                        self._abstract, shardings, is_leaf=is_var)

  def abstract_decode_state(self) -> DecodeState:
    """The decode state's shapes and shardings (the ones `init_decode_state` returns), allocating nothing."""
    shapes = jax.eval_shape(self._init_impl)
    if self.mesh is None:
      return shapes
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                        state_lib.field_shardings(shapes, self.mesh))

  # -- lowering hooks (ahead-of-time compiles: `.compile()` for memory and cost analyses) ----------

  def lower_init(self):
    """The program that builds an empty decode state (`init_decode_state`)."""
    with self.mesh_context():
      return self._init_jit.lower()

  def lower_prefill(self, params, batch: int, bucket: int):
    """The prefill program for `batch` prompts of bucket length `bucket`; `params` may be abstract
    (`abstract_params`)."""
    with self.mesh_context():
      return self._prefill_jit.lower(params, _i32(batch, bucket), _i32(batch))

  def lower_insert_requests(self, state, cache, logits, requests: int, sampling=None, pauses: int = 0):
    """The insert program for `requests` requests from a prefill's `cache` and `logits` (its outputs, e.g.
    `lower_prefill(...).compile()`'s) into `state` (may be abstract: `abstract_decode_state`); `pauses` pause ids
    (a conversation's turn ends; 0: the single-turn program, no pause test)."""
    Q = requests
    B = logits.shape[0]
    with self.mesh_context():
      return self._insert_requests_jit.lower(state, cache, logits, _i32(B), _i32(Q), _i32(Q),
                                             jax.ShapeDtypeStruct((), jnp.uint32), _i32(Q), _i32(Q), _i32(Q),
                                             _i32(decode_lib.eos_array(self.eos_ids).shape[0]), _pauses(pauses),
                                             sampling=sampling or self.sampling)

  def lower_decode(self, params, state, page_budget: int | None = None, sampling=None, num_steps: int | None = None,
                   pauses: int = 0, rung: int | None = None):
    """The decode program (`num_steps`, default `steps_per_call`, steps at a budget of `page_budget` live pages
    per shard, default the top of `page_budgets`, over `rung` of the slots, default all) for `params` and
    `state`, which may be abstract; `pauses` pause ids (0: the single-turn program)."""
    rung, index = self._rung(rung)
    with self.mesh_context():
      return self._decode_jit.lower(params, state, np.int32(0), decode_lib.eos_array(self.eos_ids),
                                    _pauses(pauses), index, num_steps=num_steps or self.steps_per_call,
                                    sampling=sampling or self.sampling, page_budget=self.policy.clamp(page_budget),
                                    rung=rung)

  def lower_continue(self, params, state, requests: int, bucket: int, sampling=None, pauses: int = 0):
    """The continue program for `requests` slots with up to `bucket` inserted tokens each (`continue_slots`);
    `params` and `state` may be abstract; `pauses` pause ids (a conversation's: 1, its turn end)."""
    Q = requests
    eos = _i32(decode_lib.eos_array(self.eos_ids).shape[0])
    with self.mesh_context():
      return self._continue_jit.lower(params, state, _i32(Q), _i32(Q, bucket), _i32(Q), _i32(Q), eos, _pauses(pauses),
                                      sampling=sampling or self.sampling)

  # -- prompts ----------------------------------------------------------------------------------

  def bucket_length(self, length: int) -> int:
    """The prefill bucket (padded length) for a prompt of `length` tokens."""
    if not 0 < length <= self.max_prefill_length:
      raise ValueError(f"prompt length {length} is not in [1, max_prefill_length={self.max_prefill_length}]")
    return next(b for b in self.prefill_buckets if b >= length)

  def pad_prompt(self, padded_tokens, true_length: int) -> np.ndarray:
    """`padded_tokens[:true_length]` right-padded to its bucket: [1, T] int32."""
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
    row = np.zeros((1, self.bucket_length(true_length)), np.int32)
    row[0, :true_length] = tokens
    return row

  def continue_bucket_length(self, inserted: int) -> int:
    """The continue bucket (padded count of inserted tokens) for `inserted` tokens."""
    if not 0 <= inserted <= self.continue_buckets[-1]:
      raise ValueError(f"{inserted} inserted tokens is not in [0, {self.continue_buckets[-1]}] (a slot holds "
                       f"{self.cache_length} rows, the pending token included)")
    return next(b for b in self.continue_buckets if b >= inserted)

  def continuation_fits(self, rows: int, inserted: int) -> bool:
    """Whether a slot with `rows` filled rows (`ChunkOutput.lengths`) holds its pending token and `inserted`
    more: otherwise `continue_slots` refuses it (host arithmetic, to check before the call)."""
    return rows + 1 + inserted <= self.cache_length

  # -- jitted bodies ----------------------------------------------------------------------------

  def _prefill_impl(self, params, tokens, true_lengths):
    cache, logits = decode_lib.prefill_forward(self.model(params), tokens, true_lengths)
    return self.constrain(cache), logits

  def _insert_requests_impl(self, state, cache, logits, true_lengths, rows, slots, seed, prompt_index,
                            sample_index, budgets, eos_ids, pause_ids, sampling):
    """Inserts Q requests from B prefilled prompts (several samples may share a prompt row)."""
    key_data = decode_lib.request_keys(seed, prompt_index, sample_index)
    # The insert reads each request's prompt rows layer by layer: no [layers, Q, ...] copy of them.
    prefix = decode_lib.prefix_of_requests(cache, logits, true_lengths, rows, key_data, sampling)
    state = self.constrain(decode_lib.insert_rows(state, prefix, slots, budgets, eos_ids, rows, pause_ids))
    return (state, *self.replicate((prefix.tokens, prefix.logprobs)))

  def _decode_impl(self, params, state, stop_after_finished, eos_ids, pause_ids, index, num_steps, sampling,
                   page_budget, rung):
    if rung == self.max_concurrent_decodes:  # every slot: the program as compiled before the slot ladder
      state, out = decode_lib.decode_chunk(self.model(params), state, num_steps, stop_after_finished, sampling,
                                           eos_ids, page_budget, pause_ids)
      return self.constrain(state), self.replicate(out)
    part = self.constrain(slot_rungs_lib.gather(state, index))
    part, out = decode_lib.decode_chunk(self.model(params), part, num_steps, stop_after_finished, sampling,
                                        eos_ids, page_budget, pause_ids)
    state = self.constrain(slot_rungs_lib.scatter(state, part, index))
    return state, self.replicate(slot_rungs_lib.widen(out, state, index))

  def _continue_impl(self, params, state, slots, tokens, lengths, budgets, eos_ids, pause_ids, sampling):
    state, out = continuation_lib.continue_slots(self.model(params), state, slots, tokens, lengths, budgets,
                                                 sampling, eos_ids, pause_ids)
    return self.constrain(state), self.replicate(out)

  def _release_impl(self, state, slots):
    """Slots [B] bool give their pages back and stop."""
    return self.constrain(state.replace(cache=pages_lib.release(state.cache, slots),
                                        active=state.active & ~slots))

  # -- batched calls for the continuous-batching loop -------------------------------------------

  def prefill_batch(self, params, tokens: np.ndarray, true_lengths: np.ndarray):
    """Right-padded prompts [B, T] (T a bucket length) -> (cache [layers, B, K, T, H], last-token
    logits [B, V] fp32); see `decode.prefill_forward`."""
    self.positions_run["prefill"] += int(np.size(tokens))
    with self.mesh_context():
      return self._prefill_jit(params, tokens, true_lengths)

  def insert_requests(self, decode_state: DecodeState, cache: KVCache, logits: jax.Array,
                      true_lengths: np.ndarray, rows: np.ndarray, slots: np.ndarray, seed: int,
                      prompt_index: np.ndarray, sample_index: np.ndarray, budgets: np.ndarray,
                      sampling: sampling_lib.SamplingMethod, eos_ids: Sequence[int],
                      requests: Sequence[int], pause_ids: Sequence[int] = ()) -> tuple[DecodeState, FirstTokens]:
    """Inserts Q requests into `slots` [Q] from prompts prefilled together (`prefill_batch`'s cache and
    logits): request r continues prompt `rows[r]`, samples with key data `request_keys(seed, prompt_index[r],
    sample_index[r])` and generates at most `budgets[r]` tokens; a slot >= B marks a padding request, dropped; a
    first token in `pause_ids` pauses its slot as decode does. The first tokens come back on device, tagged with
    the caller's `requests` ids."""
    with self.mesh_context():
      state, first, logprobs = self._insert_requests_jit(
          decode_state, cache, logits, true_lengths, rows, slots, np.uint32(seed & 0xFFFFFFFF), prompt_index,
          sample_index, budgets, decode_lib.eos_array(eos_ids), _pause_array(pause_ids), sampling=sampling)
    return state, FirstTokens(requests=tuple(requests), tokens=first, logprobs=logprobs)

  def decode(self, params, decode_state: DecodeState, stop_after_finished: int,
             sampling: sampling_lib.SamplingMethod, eos_ids: Sequence[int],
             page_budget: int | None = None, pause_ids: Sequence[int] = (),
             slots: np.ndarray | None = None) -> tuple[DecodeState, ChunkOutput]:
    """Up to `steps_per_call` decode steps in one call at a budget of `page_budget` live pages per shard
    (default: the top of `page_budgets`; see `decode.decode_chunk` and `budget.PagePolicy.page_budget`), over
    the slots `slots` [b] (a rung's `slot_rungs.slot_index`, holding every active slot; default: all). A slot
    that samples one of `pause_ids` (a tool-call stop; a traced argument like `eos_ids`) stops but keeps its pages,
    for `continue_slots`. The output is replicated for the host."""
    rung, index = self._rung(None if slots is None else len(slots))
    if slots is not None and rung < self.max_concurrent_decodes:
      index = np.asarray(slots, np.int32)
    with self.mesh_context():
      return self._decode_jit(params, decode_state, np.int32(stop_after_finished), decode_lib.eos_array(eos_ids),
                              _pause_array(pause_ids), index, num_steps=self.steps_per_call, sampling=sampling,
                              page_budget=self.policy.clamp(page_budget), rung=rung)

  def _rung(self, rung: int | None) -> tuple[int, np.ndarray | None]:
    """(a decode program's slot count, the abstract slot index it takes: None for every slot)."""
    rung = self.max_concurrent_decodes if rung is None else int(rung)
    if rung not in self.slot_rungs:
      raise ValueError(f"no decode program over {rung} slots: the slot ladder is {self.slot_rungs}")
    return rung, None if rung == self.max_concurrent_decodes else _i32(rung)

  def continue_slots(self, params, decode_state: DecodeState, slots: np.ndarray, tokens: np.ndarray,
                     lengths: np.ndarray, budgets: np.ndarray, sampling: sampling_lib.SamplingMethod,
                     eos_ids: Sequence[int], pause_ids: Sequence[int] = ()) -> tuple[DecodeState, ContinuedTokens]:
    """Feeds paused slots [Q] their inserted tokens [Q, T] (the first lengths[q] of row q; T a continue bucket)
    after their KV prefix, and samples on from the last one (`continuation.continue_slots`; padding: slot B,
    `continuation.pad_continuations` lays them out). Each slot's budget becomes budgets[q] (< 0: unchanged). A
    request that does not fit its slot's rows (`continuation_fits`) or its shard's free pages is refused and its
    slot left as it was: `ContinuedTokens.continued` says which went ahead. Other slots are untouched."""
    self.positions_run["continue"] += int(np.shape(tokens)[0] * (np.shape(tokens)[1] + 1))
    with self.mesh_context():
      return self._continue_jit(params, decode_state, slots, tokens, lengths, budgets, decode_lib.eos_array(eos_ids),
                                _pause_array(pause_ids), sampling=sampling)

  def release_slots(self, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
    """Ends `slots` (e.g. paused ones whose conversation is over): their pages go back to their pools."""
    mask = np.zeros((self.max_concurrent_decodes,), bool)
    mask[list(slots)] = True
    with self.mesh_context():
      return self._release_jit(decode_state, mask)

  def compiled_count(self) -> int:
    """Number of compiled programs across the engine's jitted functions (to check weight swaps hit the cache)."""
    fns = (self._prefill_jit, self._insert_requests_jit, self._decode_jit, self._init_jit, self._continue_jit,
           self._release_jit)
    return sum(f._cache_size() for f in fns)


def _pauses(count: int) -> jax.ShapeDtypeStruct | None:
  """`count` pause ids' abstract array (`_pause_array`'s shape), or None for none (the single-turn programs)."""
  return _i32(decode_lib.eos_array(range(count)).shape[0]) if count else None


def _pause_array(pause_ids: Sequence[int]) -> np.ndarray | None:
  """`pause_ids` as a traced argument (`decode.eos_array`), or None without any: the single-turn programs are then
  the ones compiled before slots could pause (no pause test in them at all)."""
  return decode_lib.eos_array(pause_ids) if len(pause_ids) else None
