"""Runs jax's Pallas TPU ragged paged attention kernel in interpret mode on CPU.

jax 0.10.2's TPU interpreter cannot index a reshaped VMEM ref (`ReshapeTransform` has no `indices`), which
the kernel does once per KV block (`async_copy.wait().reshape(...)`, then strided k / v loads). Here that
one read becomes a load of the whole buffer, reshaped and sliced as a value: the same numbers, the rest of
the kernel (DMAs, semaphores, online softmax, masks) runs as written. Also avoid num_queries_per_block >
query heads per kv head: the interpreter's masked store checks bounds along the first axis only.
"""

from __future__ import annotations

import contextlib

from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa


class _ReshapedBuffer:
  def __init__(self, ref, shape):
    self.ref, self.shape, self.dtype = ref, shape, ref.dtype

  def __getitem__(self, index):
    return self.ref[...].reshape(self.shape)[index]


class _Buffer:
  def __init__(self, ref):
    self.ref = ref

  def reshape(self, *shape):
    return _ReshapedBuffer(self.ref, shape)


class _Descriptor(rpa.MultiPageAsyncCopyDescriptor):
  def wait(self):
    return _Buffer(super().wait())


@contextlib.contextmanager
def ragged_paged_attention_interpreted():
  """TPU interpret mode (`pltpu.force_tpu_interpret_mode`) with the kernel's reshaped read as above."""
  original = rpa.MultiPageAsyncCopyDescriptor
  rpa.MultiPageAsyncCopyDescriptor = _Descriptor
  try:
    with pltpu.force_tpu_interpret_mode():
      yield
  finally:
    rpa.MultiPageAsyncCopyDescriptor = original
