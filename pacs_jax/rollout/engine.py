"""The KV-cache rollout `Engine`: the decode maths jitted with weights as an argument, the decode state's
layout on a mesh, and lowering hooks for ahead-of-time compiles. The decode KV cache is paged (`state.PagedCache`,
the default) or dense (`KVCache` [layers, S, K, L, H]: S slots, K kv heads, L cache rows, H head dim)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from pacs_jax import sharding
from pacs_jax.models import paged, paged_kernel
from pacs_jax.models.kv_cache import KVCache, init_cache
from pacs_jax.models.decoder import CausalLM
from pacs_jax.models.model_config import ModelConfig
from pacs_jax.rollout import sampling as sampling_lib
from pacs_jax.rollout import decode as decode_lib
from pacs_jax.rollout import pages as pages_lib
from pacs_jax.rollout import state as state_lib
from pacs_jax.rollout.state import ChunkOutput, DecodeState, FirstTokens, PagedCache, Prefix, SlotTokens

_INT32_MAX = np.iinfo(np.int32).max
KV_CACHES = ("paged", "dense")


def next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _pow2_ladder(start: int, cap: int, half_steps: bool = False) -> list[int]:
  """Powers of two from `start` (rounded up), capped by and ending at `cap`; with `half_steps` also 1.5x
  each power of two (a budget is then at most 1.5x, not 2x, what it must hold)."""
  steps = [next_pow2(start) << i for i in range(max(1, cap).bit_length() + 1)]
  if half_steps:
    steps += [3 * b // 2 for b in steps if b > 1]
  return sorted({min(b, cap) for b in steps if b >= start or b >= cap})


class Engine:
  """Prefill / insert / decode over `max_concurrent_decodes` slots.

  The engine holds the model's graphdef only; weights (an `nnx.State`) are an argument of every call,
  so a new policy is swapped in each training step without recompiling (same shapes and shardings).
  Each slot holds up to `max_prefill_length + max_decode_length` KV rows: pages of a shared pool (paged)
  or its own preallocated rows (dense). Prompts are right-padded to power-of-two buckets so prefill
  compiles a few shapes only.

  One prompt, one slot, one step (`prefill`, `insert`, `step`) use the engine's `sampling` and
  `eos_ids`; the batched calls behind `scheduler.generate` (`prefill_batch` and `insert_requests`: many
  prompts into many slots; `decode`: many steps per device call) take their own. EOS ids are traced arguments and
  sampling methods static ones, so changing the method compiles decode once more.
  """

  def __init__(self, model: CausalLM, *, max_concurrent_decodes: int, max_prefill_length: int,
               max_decode_length: int, mesh: jax.sharding.Mesh | None = None,
               sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), eos_ids: Sequence[int] = (),
               steps_per_call: int = 16, min_prefill_bucket: int = 16, min_decode_window: int = 512,
               seed: int = 0, kv_cache: str = "paged", page_size: int = 64, kv_pages: int = 0):
    """`model` may be abstract (`nnx.eval_shape`): only its structure and shapes are kept.

    `kv_cache="paged"`: slots hold pages of `page_size` rows taken as they grow and returned when they
    finish, from a pool per batch shard (slots and pages are split over the mesh's batch axes alike);
    `kv_pages` pages in all (0: enough for every slot at full length, so none waits). Decode reads each
    slot's live pages, padded to a budget per shard from `live_page_buckets` (powers of two and 1.5x them) that holds
    every slot for the next `steps_per_call` steps. `kv_cache="dense"`: each slot owns L rows and decode
    reads a window of the first W, W the smallest of `decode_windows` (powers of two from
    `min_decode_window`, and the whole cache) that holds every busy slot for the next `steps_per_call`
    steps. A decode program is compiled per budget / window used.
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
    self.prefill_buckets = _pow2_ladder(min_prefill_bucket, max_prefill_length)
    self.decode_windows = _pow2_ladder(min_decode_window, self.cache_length)
    if kv_cache not in KV_CACHES:
      raise ValueError(f"rollout.kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    self.kv_cache = kv_cache
    self.paged = kv_cache == "paged"
    self.page_size = page_size
    self.kv_pages = kv_pages
    # Slot s and its pages live on batch shard s // (S / D); slots the mesh does not divide are one pool.
    self.page_shards = 1 if mesh is None else paged_kernel.batch_shards(dict(mesh.shape), max_concurrent_decodes)
    self.pages_per_slot = -(-self.cache_length // page_size)
    slots_per_shard = max_concurrent_decodes // self.page_shards
    if self.paged:
      if page_size < 1:
        raise ValueError(f"rollout.page_size must be >= 1, got {page_size}")
      if kv_pages == 0:  # every slot at full length, plus the null page
        self.pages_per_shard = slots_per_shard * self.pages_per_slot + 1
      else:
        self.pages_per_shard = kv_pages // self.page_shards
        if kv_pages % self.page_shards or self.pages_per_shard < self.pages_per_slot + 1:
          raise ValueError(
              f"rollout.kv_pages={kv_pages} must be a multiple of the {self.page_shards} batch shards with at least "
              f"{self.pages_per_slot + 1} pages each (one slot of {self.cache_length} rows in pages of "
              f"rollout.page_size={page_size}, and a null page), or 0 (enough for every slot)")
    # Live pages track the tokens in flight closely (not the longest row), so their budgets step finer. The TPU
    # kernel walks each slot's live pages itself: one decode program, no budget.
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    self.decode_kernel = self.paged and paged.decode_kernel(self.config, platform, tensor)
    self.live_page_buckets = _pow2_ladder(slots_per_shard, slots_per_shard * self.pages_per_slot, half_steps=True)
    if self.decode_kernel:
      self.live_page_buckets = self.live_page_buckets[-1:]
    self.param_shardings = sharding.state_shardings(abstract, mesh, "sample") if mesh is not None else None

    # Model-sized programs (prefill per bucket shape, decode) are kept apart from the cheap ones that
    # depend on the number of requests, so few large compiles are needed. Donating the decode state
    # lets XLA update the (large) cache in place.
    self._prefill_jit = jax.jit(self._prefill_impl)
    self._prefix_jit = jax.jit(self._prefix_impl, static_argnames=("sampling",))
    self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(0,))
    self._insert_requests_jit = jax.jit(self._insert_requests_impl, static_argnames=("sampling",),
                                        donate_argnums=(0,))
    self._step_jit = jax.jit(self._step_impl, static_argnames=("sampling",), donate_argnums=(1,))
    self._decode_chunk_jit = jax.jit(self._decode_chunk_impl, static_argnames=("num_steps", "sampling", "window"),
                                     donate_argnums=(1,))
    self._init_jit = jax.jit(self._init_impl)

  # -- layout -----------------------------------------------------------------------------------

  def _mesh_context(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _constrain(self, tree: DecodeState | KVCache):
    """The decode state (or a prefill cache) in its declared layout (`state.field_shardings`)."""
    if self.mesh is None:
      return tree
    cache = isinstance(tree, KVCache)
    shardings = state_lib.cache_shardings(tree, self.mesh) if cache else state_lib.field_shardings(tree, self.mesh)
    return jax.lax.with_sharding_constraint(tree, shardings)

  def _replicate(self, tree):
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

  def _model(self, params) -> CausalLM:
    return nnx.merge(self.graphdef, params)

  def _init_cache(self) -> KVCache | PagedCache:
    S, L = self.max_concurrent_decodes, self.cache_length
    if self.paged:
      return pages_lib.init(self.config, S, L, self.page_size, self.page_shards, self.pages_per_shard)
    return init_cache(self.config, S, L)

  def _init_impl(self) -> DecodeState:
    S = self.max_concurrent_decodes
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    state = DecodeState(cache=self._init_cache(), lengths=jnp.zeros((S,), jnp.int32),
                        tokens=jnp.zeros((S,), jnp.int32), keys=jnp.zeros((S,) + key_shape, jnp.uint32),
                        steps=jnp.zeros((S,), jnp.int32), budgets=jnp.zeros((S,), jnp.int32),
                        active=jnp.zeros((S,), bool))
    return self._constrain(state)

  def init_decode_state(self) -> DecodeState:
    """All slots empty: a zero cache (every page free), each field in its declared layout."""
    with self._mesh_context():
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

  def lower_decode(self, params, state, window: int | None = None, sampling=None):
    """The decode chunk program (`steps_per_call` steps over the first `window` cache rows; paged: a
    budget of `window` live pages per shard) lowered for `params` and `state`, which may be abstract
    (`abstract_params`, `abstract_decode_state`): call `.compile()` for its memory and cost analyses."""
    window = self._read_budget(window)
    with self._mesh_context():
      return self._decode_chunk_jit.lower(params, state, np.int32(0), decode_lib.eos_array(self.eos_ids),
                                          num_steps=self.steps_per_call, sampling=sampling or self.sampling,
                                          window=window)

  def lower_prefill(self, params, batch: int, bucket: int):
    """The prefill program for `batch` prompts of bucket length `bucket` (see `lower_decode`)."""
    tokens = jax.ShapeDtypeStruct((batch, bucket), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    with self._mesh_context():
      return self._prefill_jit.lower(params, tokens, lengths)

  def decode_window(self, rows: int) -> int:
    """The decode window (cache rows read per step) for slots that need `rows` rows."""
    return next((w for w in self.decode_windows if w >= rows), self.cache_length)

  @property
  def read_budgets(self) -> list[int]:
    """The budgets decode programs are compiled for: live pages per shard (paged) or windows (dense)."""
    return self.live_page_buckets if self.paged else self.decode_windows

  def _read_budget(self, budget: int | None) -> int:
    top = self.read_budgets[-1]
    return top if budget is None else min(int(budget), top)

  def read_budget(self, rows: np.ndarray, busy: np.ndarray) -> int:
    """What a decode call reads per step for the next `steps_per_call` steps of slots with `rows` [S] filled
    rows (busy [S] bool): the live-page bucket per shard (paged; an idle slot reads one null row), or the
    dense window."""
    ahead = np.minimum(np.asarray(rows) + self.steps_per_call, self.cache_length)
    if not self.paged:
      return self.decode_window(int(max(ahead[busy], default=0)))
    pages = np.where(busy, -(-ahead // self.page_size), 1).reshape(self.page_shards, -1).sum(axis=1)
    need = int(pages.max())
    return next((b for b in self.live_page_buckets if b >= need), self.live_page_buckets[-1])

  def rows_read(self, budget: int) -> int:
    """KV rows one decode step reads, all slots together, at a budget (`read_budget`)."""
    if self.paged:
      return budget * self.page_shards * self.page_size
    return budget * self.max_concurrent_decodes

  def prompt_pages(self, length: int) -> int:
    """Pages a request with a prompt of `length` tokens takes when it is inserted (0 on a dense cache)."""
    return -(-length // self.page_size) if self.paged else 0

  def bucket_length(self, length: int) -> int:
    """The prefill bucket (padded length) for a prompt of `length` tokens."""
    if not 0 < length <= self.max_prefill_length:
      raise ValueError(f"prompt length {length} is not in [1, max_prefill_length={self.max_prefill_length}]")
    return next(b for b in self.prefill_buckets if b >= length)

  def pad_prompt(self, padded_tokens, true_length: int) -> np.ndarray:
    """`padded_tokens[:true_length]` right-padded to its bucket: [1, bucket] int32."""
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
    row = np.zeros((1, self.bucket_length(true_length)), np.int32)
    row[0, :true_length] = tokens
    return row

  # -- jitted bodies ----------------------------------------------------------------------------

  def _prefill_impl(self, params, tokens, true_lengths):
    cache, logits = decode_lib.prefill_forward(self._model(params), tokens, true_lengths)
    return self._constrain(cache), logits

  def _prefix_impl(self, cache, logits, true_lengths, key_data, sampling):
    rows = jnp.arange(true_lengths.shape[0])
    return decode_lib.prefix_of_requests(cache, logits, true_lengths, rows, key_data, sampling)

  def _insert_impl(self, state, prefix, slots, budgets, eos_ids):
    return self._constrain(decode_lib.insert_rows(state, prefix, slots, budgets, eos_ids))

  def _insert_requests_impl(self, state, cache, logits, true_lengths, rows, slots, seed, prompt_index,
                            sample_index, budgets, eos_ids, sampling):
    """Inserts R requests from B prefilled prompts (several samples may share a prompt row)."""
    key_data = decode_lib.request_keys(seed, prompt_index, sample_index)
    # The paged insert reads each request's prompt rows layer by layer: no [layers, R, ...] copy of them.
    prefix = decode_lib.prefix_of_requests(cache, logits, true_lengths, rows, key_data, sampling,
                                           gather_cache=not self.paged)
    cache_rows = rows if self.paged else None
    state = self._constrain(decode_lib.insert_rows(state, prefix, slots, budgets, eos_ids, cache_rows))
    return (state, *self._replicate((prefix.tokens, prefix.logprobs)))

  def _step_impl(self, params, state, eos_ids, sampling):
    state, out = decode_lib.decode_step(self._model(params), state, sampling, eos_ids)
    return self._constrain(state), self._replicate(SlotTokens(tokens=out.tokens, valid=out.emitted,
                                                              lengths=state.steps))

  def _decode_chunk_impl(self, params, state, stop_after_finished, eos_ids, num_steps, sampling, window):
    state, out = decode_lib.decode_chunk(self._model(params), state, num_steps, stop_after_finished, sampling,
                                         eos_ids, window)
    return self._constrain(state), self._replicate(out)

  # -- one prompt, one slot, one step -----------------------------------------------------------

  def prefill(self, params, padded_tokens, true_length: int, key_data: jax.Array) -> Prefix:
    """KV cache of one prompt (`padded_tokens[:true_length]`) and its first token, sampled with the
    request's key data [1, *key] (see `decode.request_keys`)."""
    tokens = self.pad_prompt(padded_tokens, true_length)
    lengths = np.array([true_length], np.int32)
    with self._mesh_context():
      cache, logits = self._prefill_jit(params, tokens, lengths)
      return self._prefix_jit(cache, logits, lengths, key_data, sampling=self.sampling)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, budget: int | None = None) -> DecodeState:
    """Moves a single-prompt prefix into `slot` (the slot generates at most `budget` tokens)."""
    budget = _INT32_MAX if budget is None else budget
    with self._mesh_context():
      return self._insert_jit(decode_state, prefix, np.array([slot], np.int32), np.array([budget], np.int32),
                              decode_lib.eos_array(self.eos_ids))

  def step(self, params, decode_state: DecodeState) -> tuple[DecodeState, SlotTokens]:
    """One decode step for every slot: feeds the pending tokens, returns the new ones."""
    with self._mesh_context():
      return self._step_jit(params, decode_state, decode_lib.eos_array(self.eos_ids), sampling=self.sampling)

  # -- batched calls for the continuous-batching loop -------------------------------------------

  def prefill_batch(self, params, tokens: np.ndarray, true_lengths: np.ndarray):
    """Right-padded prompts [B, T] (T a bucket length) -> (cache [layers, B, K, T, H], last-token
    logits [B, V] fp32); see `decode.prefill_forward`."""
    with self._mesh_context():
      return self._prefill_jit(params, tokens, true_lengths)

  def insert_requests(self, decode_state: DecodeState, cache: KVCache, logits: jax.Array,
                      true_lengths: np.ndarray, rows: np.ndarray, slots: np.ndarray, seed: int,
                      prompt_index: np.ndarray, sample_index: np.ndarray, budgets: np.ndarray,
                      sampling: sampling_lib.SamplingMethod, eos_ids: Sequence[int],
                      requests: Sequence[int]) -> tuple[DecodeState, FirstTokens]:
    """Inserts R requests into `slots` [R] from prompts prefilled together (`prefill_batch`'s cache and
    logits): request r continues prompt `rows[r]`, samples with key data `request_keys(seed, prompt_index[r],
    sample_index[r])` and generates at most `budgets[r]` tokens; a slot >= S marks a padding request, dropped.
    The first tokens come back on device, tagged with the caller's `requests` ids."""
    with self._mesh_context():
      state, first, logprobs = self._insert_requests_jit(
          decode_state, cache, logits, true_lengths, rows, slots, np.uint32(seed & 0xFFFFFFFF), prompt_index,
          sample_index, budgets, decode_lib.eos_array(eos_ids), sampling=sampling)
    return state, FirstTokens(requests=tuple(requests), tokens=first, logprobs=logprobs)

  def decode(self, params, decode_state: DecodeState, stop_after_finished: int,
             sampling: sampling_lib.SamplingMethod, eos_ids: Sequence[int],
             window: int | None = None) -> tuple[DecodeState, ChunkOutput]:
    """Up to `steps_per_call` decode steps in one call over the first `window` cache rows, or on a paged
    cache a budget of `window` live pages per shard (default: all; see `decode.decode_chunk` and
    `read_budget`). The output is replicated for the host."""
    window = self._read_budget(window)
    with self._mesh_context():
      return self._decode_chunk_jit(params, decode_state, np.int32(stop_after_finished), decode_lib.eos_array(eos_ids),
                                    num_steps=self.steps_per_call, sampling=sampling, window=window)

  def compiled_count(self) -> int:
    """Number of compiled programs across the engine's jitted functions (to check weight swaps hit the cache)."""
    fns = (self._prefill_jit, self._prefix_jit, self._insert_jit, self._insert_requests_jit,
           self._step_jit, self._decode_chunk_jit, self._init_jit)
    return sum(f._cache_size() for f in fns)
