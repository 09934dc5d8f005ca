"""KV-cache rollout engine with JetStream's Engine semantics (prefill / insert / generate over decode
slots) and `generate`, the continuous-batching call the trainer and evaluator use.

Shapes: S decode slots, L = max_prefill_length + max_decode_length cache rows per slot, B prefill rows,
T prefill bucket length, R requests inserted at once, V vocab, K kv heads, H head dim. KV caches are
`qwen2.KVCache`s laid out as decode reads them, [layers, S, K, L, H]; decode writes its new rows in place.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from pacs_jax import sharding
from pacs_jax.models import qwen2
from pacs_jax.models.qwen2 import KVCache
from pacs_jax.rollout import sampling as sampling_lib

_INT32_MAX = np.iinfo(np.int32).max


# ----------------------------------------------------------------------------------------------
# Engine data


@flax.struct.dataclass
class Prefix:
  """A prefilled prompt (or a batch of them), ready to be inserted into decode slots."""
  cache: KVCache  # [layers, B, K, T, H]; rows >= lengths hold padding junk
  lengths: jax.Array  # [B] int32: cache rows holding the prompt = position of `tokens`
  tokens: jax.Array  # [B] int32: the next token to feed (the first sampled token, or the last prompt token)
  logprobs: jax.Array  # [B] fp32: log-prob of `tokens` (0 for a prompt token)
  keys: jax.Array  # [B, *key] uint32: each request's PRNG key data
  steps: jax.Array  # [B] int32: tokens generated so far (`tokens` included when sampled)


@flax.struct.dataclass
class DecodeState:
  """Everything a decode step transforms, one row per slot."""
  cache: KVCache  # [layers, S, K, L, H]
  lengths: jax.Array  # [S] int32: filled cache rows = position of the pending token
  tokens: jax.Array  # [S] int32: pending token (last sampled), fed at the next step
  keys: jax.Array  # [S, *key] uint32: request keys; token t of a request uses fold_in(key, t)
  steps: jax.Array  # [S] int32: tokens generated so far
  budgets: jax.Array  # [S] int32: most tokens the slot's request may generate
  active: jax.Array  # [S] bool: still generating


@flax.struct.dataclass
class ResultTokens:
  """One generate step's output in JetStream's layout: columns [token, valid, length] per slot."""
  data: jax.Array  # [S, 3] int32
  tokens_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(0, 1))
  valid_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(1, 2))
  length_idx: tuple[int, int] = flax.struct.field(pytree_node=False, default=(2, 3))
  samples_per_slot: int = flax.struct.field(pytree_node=False, default=1)

  def copy_to_host_async(self) -> None:
    if isinstance(self.data, jax.Array):
      self.data.copy_to_host_async()

  def convert_to_numpy(self) -> "ResultTokens":
    return self.replace(data=np.asarray(self.data))

  def get_result_at_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [1, 1], valid [1, 1], lengths [1]) of one slot."""
    row = self.data[slot:slot + 1]
    return row[:, 0:1], row[:, 1:2], row[:, 2]


@dataclasses.dataclass
class Completion:
  """One sampled response: its tokens (EOS included when it stopped there) and their log-probs."""
  prompt_index: int
  sample_index: int
  tokens: list[int]
  logprobs: np.ndarray  # [len(tokens)] fp32, log_softmax(logits / temperature) at each token
  finish_reason: str  # "eos" | "length"


# ----------------------------------------------------------------------------------------------
# Pure pieces (take a merged model; the Engine jits them with params as an argument)


def request_keys(seed: jax.Array, prompt_index: jax.Array, sample_index: jax.Array) -> jax.Array:
  """Key data [R, *key] of requests (prompt_index [R], sample_index [R]): independent of slot and order."""
  base = jax.random.key(seed)
  one = lambda p, s: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(base, p), s))
  return jax.vmap(one)(prompt_index, sample_index)


def _step_keys(key_data: jax.Array, steps: jax.Array) -> jax.Array:
  return jax.vmap(lambda k, t: jax.random.fold_in(jax.random.wrap_key_data(k), t))(key_data, steps)


def eos_array(eos_ids: Sequence[int]) -> np.ndarray:
  """EOS ids as an int32 array padded with -1 to a multiple of 4: a traced argument, so changing the
  ids (up to 4 of them) does not recompile."""
  eos = sorted({int(e) for e in eos_ids})
  size = max(4, -(-len(eos) // 4) * 4)
  return np.array(eos + [-1] * (size - len(eos)), np.int32)


def _is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)  # -1 padding never matches a token


def prefill_forward(model: qwen2.Qwen2ForCausalLM, tokens: jax.Array, true_lengths: jax.Array):
  """Right-padded prompts tokens [B, T] at positions 0..T-1 -> (cache [layers, B, K, T, H], logits
  [B, V] fp32 at each row's last real token). Pad rows hold junk that decode overwrites before use."""
  B, T = tokens.shape
  cache = qwen2.init_cache(model.config, B, T)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  hidden, cache = model.model.forward_with_cache(tokens, positions, cache)
  last = jnp.clip(true_lengths - 1, 0, T - 1)
  last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
  # The vocab projection only at the last token: [B, V] instead of [B, T, V].
  return cache, model.logits(last_hidden)[:, 0].astype(jnp.float32)


def sample_first(logits: jax.Array, key_data: jax.Array, sampling: sampling_lib.SamplingMethod):
  """First response token (key step 0) of requests from their prompts' last logits [R, V]."""
  keys = _step_keys(key_data, jnp.zeros(key_data.shape[:1], jnp.int32))
  return sampling.sample_with_logprobs(logits, keys)


def insert_rows(state: DecodeState, prefix: Prefix, slots: jax.Array, budgets: jax.Array,
                eos_ids: jax.Array) -> DecodeState:
  """Writes prefix rows [R] into decode slots [R]; a slot index >= S is a padding row and is dropped."""
  L = state.cache.rows
  T = prefix.cache.rows

  def put(buf, rows):
    return buf.at[slots].set(rows.astype(buf.dtype), mode="drop")

  # Only the slots' first T rows of every layer are written (in place: the decode state is donated).
  put_rows = lambda buf, rows: buf.at[:, slots, :, :T].set(rows.astype(buf.dtype), mode="drop")
  cache = KVCache(k=put_rows(state.cache.k, prefix.cache.k), v=put_rows(state.cache.v, prefix.cache.v))
  sampled = prefix.steps > 0
  done = (sampled & _is_eos(prefix.tokens, eos_ids)) | (prefix.steps >= budgets) | (prefix.lengths >= L)
  return DecodeState(cache=cache, lengths=put(state.lengths, prefix.lengths), tokens=put(state.tokens, prefix.tokens),
                     keys=put(state.keys, prefix.keys), steps=put(state.steps, prefix.steps),
                     budgets=put(state.budgets, budgets), active=put(state.active, ~done))


def decode_step(model: qwen2.Qwen2ForCausalLM, state: DecodeState, sampling: sampling_lib.SamplingMethod,
                eos_ids: jax.Array, window: int | None = None):
  """Feeds every slot's pending token and samples the next one.

  Returns (state, tokens [S], logprobs [S], emitted [S] bool, logits [S, V] fp32); only active slots
  emit and advance. A slot stops at an EOS id, at its budget, or when its cache is full. Attention reads
  the first `window` cache rows (default: all); every active slot's position must be below it.
  """
  L = state.cache.rows
  W = L if window is None else window
  # Finished slots may sit at L; clamp so their (ignored) write stays inside the window.
  position = jnp.minimum(state.lengths, W - 1)
  logits, cache = model.forward_with_cache(state.tokens[:, None], position[:, None], state.cache, position, W)
  logits = logits[:, 0].astype(jnp.float32)  # [S, V]
  tokens, logprobs = sampling.sample_with_logprobs(logits, _step_keys(state.keys, state.steps))
  emitted = state.active
  steps = state.steps + emitted
  lengths = state.lengths + emitted
  finished = emitted & (_is_eos(tokens, eos_ids) | (steps >= state.budgets) | (lengths >= L))
  state = state.replace(cache=cache, lengths=lengths, tokens=jnp.where(emitted, tokens, state.tokens),
                        steps=steps, active=state.active & ~finished)
  return state, tokens, logprobs, emitted, logits


def decode_chunk(model: qwen2.Qwen2ForCausalLM, state: DecodeState, num_steps: int, stop_after_finished: jax.Array,
                 sampling: sampling_lib.SamplingMethod, eos_ids: jax.Array, window: int | None = None):
  """Up to `num_steps` decode steps in one device call (`lax.while_loop`).

  Stops early when no slot is active or once `stop_after_finished` slots have finished, so the host
  can refill them. With a `window` W < L, the steps attend over (and write) only the first W cache rows:
  each step reads W rows per slot instead of L. The loop then also stops before any active slot would
  need row W, so a window chosen too small costs an early return, never a wrong token. The cache stays
  whole and is carried through the loop: each step writes its new rows in place, nothing is copied.
  Returns (state, tokens [S, num_steps], logprobs [S, num_steps], emitted [S, num_steps]).
  """
  S = state.tokens.shape[0]
  L = state.cache.rows
  W = L if window is None else min(window, L)
  out = (jnp.zeros((S, num_steps), jnp.int32), jnp.zeros((S, num_steps), jnp.float32),
         jnp.zeros((S, num_steps), bool))

  def cond(carry):
    i, state, _, finished = carry
    fits = jnp.all(~state.active | (state.lengths < W))  # always true when W == L
    return (i < num_steps) & jnp.any(state.active) & (finished < stop_after_finished) & fits

  def body(carry):
    i, state, (out_tokens, out_logprobs, out_emitted), finished = carry
    new_state, tokens, logprobs, emitted, _ = decode_step(model, state, sampling, eos_ids, window=W)
    column = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x[:, None], i, axis=1)
    out = (column(out_tokens, tokens), column(out_logprobs, logprobs), column(out_emitted, emitted))
    finished = finished + jnp.sum(state.active & ~new_state.active)
    return i + 1, new_state, out, finished

  _, state, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, out, jnp.int32(0)))
  return (state,) + out


# ----------------------------------------------------------------------------------------------
# The engine


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _pow2_ladder(start: int, cap: int) -> list[int]:
  """Powers of two from `start` (rounded up), capped by and ending at `cap`."""
  return sorted({min(_next_pow2(start) << i, cap) for i in range(max(1, cap).bit_length() + 1)})


class Engine:
  """Prefill / insert / generate over `max_concurrent_decodes` slots, JetStream-style.

  The engine holds the model's graphdef only; weights (an `nnx.State`) are an argument of every call,
  so a new policy is swapped in each training step without recompiling (same shapes and shardings).
  Each slot owns a preallocated KV cache of `max_prefill_length + max_decode_length` rows. Prompts are
  right-padded to power-of-two buckets so prefill compiles a few shapes only.

  JetStream methods (`prefill`, `insert`, `generate`: one prompt, one slot, one step) use the
  engine's `sampling` and `eos_ids`; `prefill_deferred` serves JetStream 0.2.2's orchestrator. The
  batched calls behind the module-level `generate` (`prefill_insert`: many prompts into many slots;
  `decode`: many steps per device call) take their own sampling and EOS ids. EOS ids are traced
  arguments and sampling methods static ones, so changing the method compiles decode once more.
  """

  def __init__(self, model: qwen2.Qwen2ForCausalLM, *, max_concurrent_decodes: int, max_prefill_length: int,
               max_decode_length: int, mesh: jax.sharding.Mesh | None = None,
               sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), eos_ids: Sequence[int] = (),
               steps_per_call: int = 16, min_prefill_bucket: int = 16, min_decode_window: int = 512,
               seed: int = 0):
    """`model` may be abstract (`nnx.eval_shape`): only its structure and shapes are kept.

    Decode reads a window of the first W cache rows, W the smallest of `decode_windows` (powers of
    two from `min_decode_window`, and the whole cache) that holds every busy slot for the next
    `steps_per_call` steps: a decode program is compiled per window used.
    """
    self.config: qwen2.Qwen2Config = model.config
    self.graphdef, abstract = nnx.split(model)
    self._abstract = abstract
    self._slots = max_concurrent_decodes
    self._max_prefill_length = max_prefill_length
    self.max_decode_length = max_decode_length
    self.cache_length = max_prefill_length + max_decode_length
    self._mesh = mesh
    self.sampling = sampling
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.steps_per_call = steps_per_call
    self.seed = seed
    self._prefill_count = 0  # request counter that keys JetStream-style prefills
    self.prefill_buckets = _pow2_ladder(min_prefill_bucket, max_prefill_length)
    self.decode_windows = _pow2_ladder(min_decode_window, self.cache_length)

    if mesh is not None:
      self.param_shardings = sharding.state_shardings(abstract, mesh, "sample")
    else:
      self.param_shardings = None

    # Model-sized programs (prefill per bucket shape, decode) are kept apart from the cheap ones that
    # depend on the number of requests, so few large compiles are needed. Donating the decode state
    # lets XLA update the (large) cache in place.
    self._prefill_jit = jax.jit(self._prefill_impl)
    self._make_prefix_jit = jax.jit(self._make_prefix_impl, static_argnames=("sampling", "defer_last"))
    self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(0,))
    self._insert_requests_jit = jax.jit(self._insert_requests_impl, static_argnames=("sampling",),
                                        donate_argnums=(0,))
    self._generate_jit = jax.jit(self._generate_impl, static_argnames=("sampling",), donate_argnums=(1,))
    self._decode_chunk_jit = jax.jit(self._decode_chunk_impl, static_argnames=("num_steps", "sampling", "window"),
                                     donate_argnums=(1,))
    self._init_jit = jax.jit(self._init_impl)

  # -- JetStream Engine properties ------------------------------------------------------------

  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return self._mesh

  # -- sharding helpers -------------------------------------------------------------------------

  def _mesh_context(self):
    return jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext()

  def _sharding(self, logical_axes, shape) -> NamedSharding | None:
    if self._mesh is None:
      return None
    spec = sharding.spec_for(logical_axes, sharding.ACTIVATION_RULES, dict(self._mesh.shape), shape)
    return NamedSharding(self._mesh, spec)

  def _layout(self, x) -> NamedSharding | None:
    """Slot / batch rows over (data, fsdp), cache kv heads over tensor (when the mesh divides them)."""
    axes = qwen2.CACHE_AXES if x.ndim == 5 else ("batch",) + (None,) * (x.ndim - 1)
    return self._sharding(axes, x.shape)

  def _constrain(self, tree):
    if self._mesh is None:
      return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._layout(x)), tree)

  def _replicate(self, tree):
    """Small outputs the host reads: replicated, so every process (multi-host) can read them whole."""
    if self._mesh is None:
      return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(self._mesh, jax.sharding.PartitionSpec()))

  def prefix_shardings(self) -> Prefix | None:
    """A `Prefix`-shaped tree of shardings (JetStream's prefix destination); any bucket length fits."""
    if self._mesh is None:
      return None
    c = self.config
    probe = (c.num_hidden_layers, 1, c.num_key_value_heads, self._max_prefill_length, c.head_size)
    cache_sh = self._sharding(qwen2.CACHE_AXES, probe)
    vec = self._sharding(("batch",), (1,))
    key = self._sharding(("batch", None), (1, 2))
    return Prefix(cache=KVCache(k=cache_sh, v=cache_sh), lengths=vec, tokens=vec, logprobs=vec, keys=key, steps=vec)

  # -- params and state -------------------------------------------------------------------------

  def load_params(self, params_or_model: nnx.State | nnx.Module) -> nnx.State:
    """Policy weights in the sample-mode shardings (from train-mode ones, a module, or host arrays)."""
    params = nnx.state(params_or_model) if isinstance(params_or_model, nnx.Module) else params_or_model
    if self.param_shardings is not None:
      params = sharding.reshard(params, self.param_shardings)
    return params

  def _model(self, params) -> qwen2.Qwen2ForCausalLM:
    return nnx.merge(self.graphdef, params)

  def _init_impl(self):
    S, L = self._slots, self.cache_length
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    state = DecodeState(cache=qwen2.init_cache(self.config, S, L), lengths=jnp.zeros((S,), jnp.int32),
                        tokens=jnp.zeros((S,), jnp.int32), keys=jnp.zeros((S,) + key_shape, jnp.uint32),
                        steps=jnp.zeros((S,), jnp.int32), budgets=jnp.zeros((S,), jnp.int32),
                        active=jnp.zeros((S,), bool))
    return self._constrain(state)

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
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._layout(x)), shapes)

  def lower_decode(self, params, state, window: int | None = None, sampling=None):
    """The decode chunk program (`steps_per_call` steps over the first `window` cache rows) lowered for
    `params` and `state`, which may be abstract (`abstract_params`, `abstract_decode_state`): call
    `.compile()` for its memory and cost analyses."""
    window = self.cache_length if window is None else min(int(window), self.cache_length)
    with self._mesh_context():
      return self._decode_chunk_jit.lower(params, state, np.int32(0), eos_array(self.eos_ids),
                                          num_steps=self.steps_per_call, sampling=sampling or self.sampling,
                                          window=window)

  def lower_prefill(self, params, batch: int, bucket: int):
    """The prefill program for `batch` prompts of bucket length `bucket` (see `lower_decode`)."""
    tokens = jax.ShapeDtypeStruct((batch, bucket), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    with self._mesh_context():
      return self._prefill_jit.lower(params, tokens, lengths)

  def init_decode_state(self) -> DecodeState:
    """All slots empty: a zero cache [layers, S, K, L, H], sharded like the decode batch."""
    with self._mesh_context():
      return self._init_jit()

  def decode_window(self, rows: int) -> int:
    """The decode window (cache rows read per step) for slots that need `rows` rows."""
    return next((w for w in self.decode_windows if w >= rows), self.cache_length)

  def bucket_length(self, length: int) -> int:
    """The prefill bucket (padded length) for a prompt of `length` tokens."""
    if not 0 < length <= self._max_prefill_length:
      raise ValueError(f"prompt length {length} is not in [1, max_prefill_length={self._max_prefill_length}]")
    return next(b for b in self.prefill_buckets if b >= length)

  # -- jitted bodies ----------------------------------------------------------------------------

  def _prefill_impl(self, params, tokens, true_lengths):
    cache, logits = prefill_forward(self._model(params), tokens, true_lengths)
    return self._constrain(cache), logits

  def _make_prefix_impl(self, cache, logits, tokens, true_lengths, key_data, sampling, defer_last):
    B = tokens.shape[0]
    if defer_last:
      # The last prompt token stays pending (its cache row is rewritten, identically, when it is fed),
      # so the first generate step emits the first response token: JetStream 0.2.2 streams only
      # generate's tokens.
      last = jnp.take_along_axis(tokens, (true_lengths - 1)[:, None], axis=1)[:, 0]
      return Prefix(cache=cache, lengths=true_lengths - 1, tokens=last, logprobs=jnp.zeros((B,), jnp.float32),
                    keys=key_data, steps=jnp.zeros((B,), jnp.int32))
    first, logprobs = sample_first(logits, key_data, sampling)
    return Prefix(cache=cache, lengths=true_lengths, tokens=first, logprobs=logprobs, keys=key_data,
                  steps=jnp.ones((B,), jnp.int32))

  def _insert_impl(self, state, prefix, slots, budgets, eos_ids):
    return self._constrain(insert_rows(state, prefix, slots, budgets, eos_ids))

  def _insert_requests_impl(self, state, cache, logits, true_lengths, rows, slots, seed, prompt_index,
                            sample_index, budgets, eos_ids, sampling):
    """Inserts R requests from B prefilled prompts (several samples may share a prompt row)."""
    key_data = request_keys(seed, prompt_index, sample_index)
    first, logprobs = sample_first(logits[rows], key_data, sampling)
    prefix = Prefix(cache=KVCache(k=cache.k[:, rows], v=cache.v[:, rows]), lengths=true_lengths[rows], tokens=first,
                    logprobs=logprobs, keys=key_data, steps=jnp.ones_like(rows))
    state = self._constrain(insert_rows(state, prefix, slots, budgets, eos_ids))
    return (state, *self._replicate((first, logprobs)))

  def _generate_impl(self, params, state, eos_ids, sampling):
    state, tokens, _, emitted, _ = decode_step(self._model(params), state, sampling, eos_ids)
    data = jnp.stack([tokens, emitted.astype(jnp.int32), state.steps], axis=-1)  # [S, 3]
    return self._constrain(state), ResultTokens(data=self._replicate(data))

  def _decode_chunk_impl(self, params, state, stop_after_finished, eos_ids, num_steps, sampling, window):
    state, *out = decode_chunk(self._model(params), state, num_steps, stop_after_finished, sampling, eos_ids,
                               window)
    return (self._constrain(state), *self._replicate((*out, state.active, state.lengths)))

  # -- JetStream Engine methods -----------------------------------------------------------------

  def _pad_prompt(self, padded_tokens, true_length: int) -> np.ndarray:
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)[:true_length]
    row = np.zeros((1, self.bucket_length(true_length)), np.int32)
    row[0, :true_length] = tokens
    return row

  def _next_key(self) -> jax.Array:
    self._prefill_count += 1
    return request_keys(jnp.uint32(self.seed), jnp.array([self._prefill_count]), jnp.zeros((1,), jnp.int32))

  def _prefill_one(self, params, padded_tokens, true_length, key_data, defer_last) -> Prefix:
    tokens = self._pad_prompt(padded_tokens, true_length)
    lengths = np.array([true_length], np.int32)
    key_data = self._next_key() if key_data is None else key_data
    with self._mesh_context():
      cache, logits = self._prefill_jit(params, tokens, lengths)
      return self._make_prefix_jit(cache, logits, tokens, lengths, key_data, sampling=self.sampling,
                                   defer_last=defer_last)

  def prefill(self, params, padded_tokens, true_length: int, key_data: jax.Array | None = None,
              existing_prefix: Prefix | None = None) -> tuple[Prefix, ResultTokens]:
    """KV cache of one prompt (`padded_tokens[:true_length]`) and its first sampled token.

    Returns (prefix, result) with result holding the first token as [1, 3] [token, valid, length].
    `key_data` [1, *key] is the request's key (default: the engine seed and a request counter).
    """
    if existing_prefix is not None:
      raise NotImplementedError("prefix caching (existing_prefix) is not supported")
    prefix = self._prefill_one(params, padded_tokens, true_length, key_data, defer_last=False)
    data = jnp.stack([prefix.tokens, jnp.ones_like(prefix.tokens), prefix.steps], axis=-1)
    return prefix, ResultTokens(data=data)

  def prefill_deferred(self, params, padded_tokens, true_length: int, key_data: jax.Array | None = None) -> Prefix:
    """Like `prefill`, but the last prompt token is left pending instead of sampling a token, so the
    first `generate` step after `insert` emits the first response token."""
    return self._prefill_one(params, padded_tokens, true_length, key_data, defer_last=True)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, budget: int | None = None) -> DecodeState:
    """Moves a single-prompt prefix into `slot` (the slot generates at most `budget` tokens)."""
    budget = _INT32_MAX if budget is None else budget
    with self._mesh_context():
      return self._insert_jit(decode_state, prefix, np.array([slot], np.int32), np.array([budget], np.int32),
                              eos_array(self.eos_ids))

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    """One decode step for every slot: feeds the pending tokens, returns the new ones [S, 3]."""
    with self._mesh_context():
      return self._generate_jit(params, decode_state, eos_array(self.eos_ids), sampling=self.sampling)

  # -- batched calls for the continuous-batching loop -------------------------------------------

  def prefill_batch(self, params, tokens: np.ndarray, true_lengths: np.ndarray):
    """Right-padded prompts [B, T] (T a bucket length) -> (cache [layers, B, K, T, H], last-token
    logits [B, V] fp32); see `prefill_forward`."""
    with self._mesh_context():
      return self._prefill_jit(params, tokens, true_lengths)

  def prefill_insert(self, params, decode_state: DecodeState, prompts: Sequence[Sequence[int]],
                     prompt_rows: Sequence[int], slots: Sequence[int], prompt_index: Sequence[int],
                     sample_index: Sequence[int], budgets: Sequence[int], seed: int,
                     sampling: sampling_lib.SamplingMethod, eos_ids: Sequence[int]):
    """Prefills distinct `prompts` and inserts requests r into `slots[r]` from `prompts[prompt_rows[r]]`.

    One prefill per prompt-length bucket; prompt rows and requests are padded to powers of two
    (padding requests target slot S and are dropped). Returns (state, [(request ids, first tokens,
    logprobs)]), the tokens as device arrays so the caller can read them after queueing more work.
    """
    by_bucket: dict[int, list[int]] = collections.defaultdict(list)
    for i, p in enumerate(prompts):
      by_bucket[self.bucket_length(len(p))].append(i)
    requests_of = collections.defaultdict(list)
    for r, row in enumerate(prompt_rows):
      requests_of[row].append(r)
    eos = eos_array(eos_ids)
    firsts = []
    for T, rows in sorted(by_bucket.items()):
      B = _next_pow2(len(rows))
      tokens = np.zeros((B, T), np.int32)
      lengths = np.ones((B,), np.int32)
      for b, i in enumerate(rows):
        tokens[b, :len(prompts[i])] = prompts[i]
        lengths[b] = len(prompts[i])
      req = [(b, r) for b, i in enumerate(rows) for r in requests_of[i]]
      pad = _next_pow2(len(req)) - len(req)
      column = lambda values, fill: np.array(list(values) + [fill] * pad, np.int32)
      cache, logits = self.prefill_batch(params, tokens, lengths)
      with self._mesh_context():
        decode_state, first, logprobs = self._insert_requests_jit(
            decode_state, cache, logits, lengths, column((b for b, _ in req), 0),
            column((slots[r] for _, r in req), self._slots), np.uint32(seed & 0xFFFFFFFF),
            column((prompt_index[r] for _, r in req), 0), column((sample_index[r] for _, r in req), 0),
            column((budgets[r] for _, r in req), 0), eos, sampling=sampling)
      firsts.append(([r for _, r in req], first, logprobs))
    return decode_state, firsts

  def decode(self, params, decode_state: DecodeState, stop_after_finished: int,
             sampling: sampling_lib.SamplingMethod, eos_ids: Sequence[int], window: int | None = None):
    """Up to `steps_per_call` decode steps in one call over the first `window` cache rows (default:
    all; see `decode_chunk` and `decode_window`).

    Returns (state, tokens [S, steps], logprobs [S, steps], emitted [S, steps], active [S], lengths [S]);
    all but the state are replicated so the host can read them.
    """
    window = self.cache_length if window is None else min(int(window), self.cache_length)
    with self._mesh_context():
      return self._decode_chunk_jit(params, decode_state, np.int32(stop_after_finished), eos_array(eos_ids),
                                    num_steps=self.steps_per_call, sampling=sampling, window=window)

  def generate_completions(self, params, prompts: Sequence[Sequence[int]], n: int = 1,
                           max_new_tokens: int | None = None,
                           sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
                           eos_ids: Sequence[int] = (), prompt_ids: Sequence[int] | None = None,
                           refill_fraction: float = 0.125) -> list[Completion]:
    """See the module-level `generate`."""
    return generate(self, params, prompts, n=n, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                    eos_ids=eos_ids, prompt_ids=prompt_ids, refill_fraction=refill_fraction)

  def compiled_count(self) -> int:
    """Number of compiled programs across the engine's jitted functions (to check weight swaps hit the cache)."""
    fns = (self._prefill_jit, self._make_prefix_jit, self._insert_jit, self._insert_requests_jit,
           self._generate_jit, self._decode_chunk_jit, self._init_jit)
    return sum(f._cache_size() for f in fns)


# ----------------------------------------------------------------------------------------------
# Continuous batching


def generate(engine: Engine, params, prompts: Sequence[Sequence[int]], n: int = 1, max_new_tokens: int | None = None,
             sampling: sampling_lib.SamplingMethod = sampling_lib.Greedy(), seed: int = 0,
             eos_ids: Sequence[int] = (), prompt_ids: Sequence[int] | None = None,
             refill_fraction: float = 0.125) -> list[Completion]:
  """Samples `n` responses for every prompt; returns completions ordered by (prompt, sample).

  Requests beyond the slot count wait in a queue and take slots as others finish; samples of one
  prompt that enter together share its prefill. Each request's randomness comes from (seed, prompt
  id, sample index, token step) alone, so results do not depend on the slot count or on which
  requests share a batch; `prompt_ids` (default: the prompts' indices; e.g. dataset row ids) make
  them independent of the prompts' order too. A response stops at any of `eos_ids` (kept, with its
  log-prob, as transformers / verl do) or after `max_new_tokens` (default: the engine's
  `max_decode_length`). A decode call returns to the host early once `refill_fraction` of the slots
  have finished while requests wait.
  """
  max_new_tokens = engine.max_decode_length if max_new_tokens is None else max_new_tokens
  if not 0 < max_new_tokens <= engine.max_decode_length:
    raise ValueError(f"max_new_tokens {max_new_tokens} is not in [1, max_decode_length={engine.max_decode_length}]")
  prompts = [list(map(int, p)) for p in prompts]
  for p in prompts:
    engine.bucket_length(len(p))  # validates the length
  prompt_ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
  if len(prompt_ids) != len(prompts):
    raise ValueError(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")
  eos = tuple(sorted({int(e) for e in eos_ids}))
  eos_set = set(eos)
  S = engine.max_concurrent_decodes
  refill_at = max(1, int(S * refill_fraction))

  queue = collections.deque((p, s) for p in range(len(prompts)) for s in range(n))
  if not queue:
    return []
  slot_request: list[tuple[int, int] | None] = [None] * S
  slot_rows = np.zeros(S, np.int64)  # filled cache rows of each busy slot (the pending token's position)
  tokens: dict[tuple[int, int], list[int]] = {}
  logprobs: dict[tuple[int, int], list[float]] = {}
  done: dict[tuple[int, int], Completion] = {}
  state = engine.init_decode_state()

  def finish(slot: int):
    req = slot_request[slot]
    toks = tokens.pop(req)
    reason = "eos" if toks and toks[-1] in eos_set else "length"
    done[req] = Completion(prompt_index=req[0], sample_index=req[1], tokens=toks,
                           logprobs=np.asarray(logprobs.pop(req), np.float32), finish_reason=reason)
    slot_request[slot] = None

  while queue or any(r is not None for r in slot_request):
    firsts = []
    free = [i for i, r in enumerate(slot_request) if r is None]
    if queue and free:
      take = [queue.popleft() for _ in range(min(len(free), len(queue)))]
      distinct = sorted({p for p, _ in take})
      row_of = {p: i for i, p in enumerate(distinct)}
      state, firsts = engine.prefill_insert(
          params, state, [prompts[p] for p in distinct], [row_of[p] for p, _ in take], free[:len(take)],
          [prompt_ids[p] for p, _ in take], [s for _, s in take], [max_new_tokens] * len(take), seed, sampling, eos)
      for slot, req in zip(free, take):
        slot_request[slot] = req
        slot_rows[slot] = len(prompts[req[0]])
        tokens[req], logprobs[req] = [], []
      firsts = [([take[r] for r in reqs], first, lp) for reqs, first, lp in firsts]
    stop_after = min(refill_at, len(queue)) if queue else S + 1
    busy = [slot_rows[i] for i, r in enumerate(slot_request) if r is not None]
    window = engine.decode_window(max(busy, default=0) + engine.steps_per_call)
    state, out_tokens, out_logprobs, out_emitted, active, rows = engine.decode(params, state, stop_after, sampling,
                                                                               eos, window)
    # Host reads after the decode call is queued, so device work and transfers overlap.
    for reqs, first, lp in firsts:
      for req, t, l in zip(reqs, np.asarray(first).tolist(), np.asarray(lp).tolist()):
        tokens[req].append(t)
        logprobs[req].append(l)
    out_tokens, out_logprobs, out_emitted, active, rows = jax.device_get(
        (out_tokens, out_logprobs, out_emitted, active, rows))
    slot_rows = np.array(rows, np.int64)
    for slot, req in enumerate(slot_request):
      if req is None:
        continue
      emitted = out_emitted[slot]
      tokens[req].extend(out_tokens[slot, emitted].tolist())
      logprobs[req].extend(out_logprobs[slot, emitted].tolist())
      if not active[slot]:
        finish(slot)
  return [done[(p, s)] for p in range(len(prompts)) for s in range(n)]
