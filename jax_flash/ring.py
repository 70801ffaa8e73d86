"""Ring attention: exact attention over a sequence sharded along a mesh axis (context parallel).

Each device keeps its query block and passes its key/value block around the ring with
`ppermute`; at every step it runs the per-shard flash kernel (`_kernel_call`) on the block it
holds and folds the partial result into its own with the logsumexp identity

    lse = logaddexp(lse_a, lse_b),   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).

The backward pass sends K/V around again, with the dK/dV accumulators of each block travelling
beside it: the per-shard backward kernel, given the *final* out and lse, yields exact partial
dQ/dK/dV for one (query block, key block) pair, so the pieces only need summing.

Layouts of the sequence over the P devices of the ring (global order, natural token positions):
  contiguous: device i holds chunk i of P equal chunks.
  zigzag:     the sequence is cut into 2P chunks and device i holds chunks i and 2P-1-i (in that
              order). Under a causal mask every device then does the same work at every step.

The kernels' causal mask is top-left aligned within one call, so the ring only ever issues calls
whose causal structure is one of: the diagonal (a causal call on the device's own block), a full
block (non-causal) or nothing. With zigzag, writing lo/hi for the two chunks of a block, a step
whose source device j differs from ours (i) is one full (non-causal) call: all of q against k_lo
when j < i (chunk j precedes both of ours, chunk 2P-1-j follows both), q_hi against all of k
when j > i (both of j's chunks lie between ours). Which of the two is a run-time fact (the
device index), so the step is a `lax.cond` between two calls of static shapes. The diagonal step
is one causal call on the whole block: the local order [chunk i, chunk 2P-1-i] is increasing, so
local top-left causality is global causality. Sequence lengths stay valid prefixes of every block
and half-block (a later chunk has valid keys only when all earlier chunks are full), so they are
translated to per-call lengths and no mask tensor is ever built.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flash import _dispatch, _kernel_call
from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.api import _pad_head_dim
from jax_flash._validate import check_qkv, check_seq_lengths, resolve_scale, resolve_softcap

LAYOUTS = ("zigzag", "contiguous")


# -- public API ------------------------------------------------------------------------------

def ring_attention(query, key, value, *, axis_name, is_causal=False, layout="zigzag", scale=None,
                   softcap=None, query_seq_lengths=None, key_value_seq_lengths=None,
                   schedule="auto"):
  """Attention over a sequence sharded along `axis_name`; call it inside `jax.shard_map`.

  query [B, T_local, N, H], key / value [B, S_local, K, H]: this device's blocks of the global
  sequence in `layout` ("zigzag" or "contiguous", see `to_layout`). The other arguments mean
  what they mean in `jax_flash.flash_attention`; the sequence lengths are global (positions in
  the natural token order) and the same on every device of the ring. Returns this device's
  block of the output, in the same layout. Differentiable (ring backward).

  Use layout="zigzag" with is_causal=True: every device then does equal work at every step.
  """
  shape = check_qkv(query, key, value)
  check_seq_lengths("query_seq_lengths", query_seq_lengths, shape.batch)
  check_seq_lengths("key_value_seq_lengths", key_value_seq_lengths, shape.batch)
  _check_layout(layout)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal must be a Python bool; got {type(is_causal).__name__}")
  _check_block_lengths(shape, bool(is_causal), layout)
  config = AttentionConfig(scale=resolve_scale(scale, shape.head_dim),
                           softcap=resolve_softcap(softcap), is_causal=bool(is_causal))
  ring = RingSpec(_axis_tuple(axis_name), layout)
  chosen = _dispatch.select(schedule, shape, query.dtype, config)
  q_lens = _global_lengths(query_seq_lengths, shape.batch, shape.q_len, ring)
  kv_lens = _global_lengths(key_value_seq_lengths, shape.batch, shape.kv_len, ring)
  pad = functools.partial(_pad_head_dim, multiple=chosen.head_dim_multiple)
  out = _ring_attention(chosen, config, ring, pad(query), pad(key), pad(value), q_lens, kv_lens)
  return out[..., :shape.head_dim]


def to_layout(x, num_shards: int, layout: str = "zigzag", axis: int = 1):
  """Reorder a global array from natural token order along `axis` so that splitting it into
  `num_shards` equal contiguous blocks (what NamedSharding does) gives each device its block of
  `layout`. Identity for "contiguous"."""
  _check_layout(layout)
  if layout == "contiguous":
    return x
  return jnp.take(x, _zigzag_order(x.shape[axis], num_shards), axis=axis)


def from_layout(x, num_shards: int, layout: str = "zigzag", axis: int = 1):
  """Inverse of `to_layout`: back to natural token order."""
  _check_layout(layout)
  if layout == "contiguous":
    return x
  return jnp.take(x, np.argsort(_zigzag_order(x.shape[axis], num_shards)), axis=axis)


def _check_layout(layout):
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")


def _zigzag_order(length: int, num_shards: int) -> np.ndarray:
  if length % (2 * num_shards):
    raise ValueError(f"the sequence length {length} must be a multiple of 2 * num_shards = "
                     f"{2 * num_shards} for the zigzag layout")
  chunks = np.arange(length).reshape(2 * num_shards, -1)
  order = [chunks[c] for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
  return np.concatenate(order)


# -- the differentiable ring (explicit API) ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RingSpec:
  """Static description of a ring: the mesh axes it runs over and the sequence layout."""
  axis_name: tuple
  layout: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring_attention(schedule, config, ring, q, k, v, q_lens, kv_lens):
  return ring_forward(schedule, config, ring, q, k, v, q_lens, kv_lens)[0]


def _ring_attention_fwd(schedule, config, ring, q, k, v, q_lens, kv_lens):
  out, lse = ring_forward(schedule, config, ring, q, k, v, q_lens, kv_lens)
  return out, (q, k, v, q_lens, kv_lens, out, lse)


def _ring_attention_bwd(schedule, config, ring, residuals, dout):
  q, k, v, q_lens, kv_lens, out, lse = residuals
  dq, dk, dv = ring_backward(schedule, config, ring, q, k, v, q_lens, kv_lens, out, lse,
                             dout.astype(q.dtype))
  return dq, dk, dv, None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


# -- ring forward / backward on local blocks (also used by sharding.py's partition) ------------

def ring_forward(schedule, config: AttentionConfig, ring: RingSpec, q, k, v, q_lens, kv_lens):
  """(out [B,T,N,H], lse f32 [B,N,T]) of this device's query block against the whole ring."""
  steps = _Steps(ring, config.is_causal, q.shape[1], k.shape[1])
  kv = (k, v)

  def fold(call, state):
    block_out, block_lse = _kernel_call.forward(
        schedule, call.config(config), call.q_rows(q), call.kv_rows(kv[0]),
        call.kv_rows(kv[1]), None, None, call.q_valid, call.kv_valid)
    if state is None:  # step 0: one call covering every row starts the accumulators
      return block_out.astype(jnp.float32), block_lse
    return call.merge_rows(*state, block_out, block_lse)

  state = None
  for step in range(steps.size):
    next_kv = steps.shift(kv) if step + 1 < steps.size else None  # in flight while we compute
    state = _run_step(steps.calls(step, q_lens, kv_lens), fold, state)
    kv = next_kv
  out, lse = state
  return out.astype(q.dtype), lse


def ring_backward(schedule, config: AttentionConfig, ring: RingSpec, q, k, v, q_lens, kv_lens,
                  out, lse, dout):
  """(dq, dk, dv) of this device's blocks; K/V and their gradient accumulators travel."""
  steps = _Steps(ring, config.is_causal, q.shape[1], k.shape[1])
  kv = (k, v)

  def fold(call, state):
    dq_part, dk_part, dv_part, _ = _kernel_call.backward(
        schedule, call.config(config), call.q_rows(q), call.kv_rows(kv[0]),
        call.kv_rows(kv[1]), None, None, call.q_valid, call.kv_valid, call.q_rows(out),
        call.q_rows(lse, axis=2), call.q_rows(dout))
    if state is None:  # step 0: one call covering every row starts the accumulators
      return tuple(x.astype(jnp.float32) for x in (dq_part, dk_part, dv_part))
    dq, dk, dv = state
    return (call.add_q_rows(dq, dq_part), call.add_kv_rows(dk, dk_part),
            call.add_kv_rows(dv, dv_part))

  state = None
  for step in range(steps.size):
    next_kv = steps.shift(kv) if step + 1 < steps.size else None
    dq, *dkv = _run_step(steps.calls(step, q_lens, kv_lens), fold, state)
    state = (dq, *steps.shift(dkv))  # after the last step this brings each block's gradient home
    kv = next_kv
  dq, dk, dv = state
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# -- which kernel calls one ring step makes ------------------------------------------------------

# Which rows of a block a call covers: ALL, or half 0 (lo) / half 1 (hi) of a zigzag block.
ALL = None


@dataclasses.dataclass(frozen=True)
class _Call:
  """One per-shard kernel call inside a ring step, and how its result maps onto the block."""
  q_half: int | None       # ALL, 0 or 1
  kv_half: int | None
  causal: bool
  q_valid: jax.Array       # int32 [B]: valid query rows of the rows this call sees
  kv_valid: jax.Array      # int32 [B]: valid keys of the key rows this call sees

  def config(self, base: AttentionConfig) -> AttentionConfig:
    return dataclasses.replace(base, is_causal=self.causal)

  def q_rows(self, x, axis: int = 1):
    return _rows(x, self.q_half, axis)

  def kv_rows(self, x):
    return _rows(x, self.kv_half, 1)

  def add_q_rows(self, acc, part):
    return _add_rows(acc, part, self.q_half)

  def add_kv_rows(self, acc, part):
    return _add_rows(acc, part, self.kv_half)

  def merge_rows(self, out, lse, block_out, block_lse):
    """Fold a partial (out, lse) for this call's query rows into the block accumulators."""
    if self.q_half is ALL:
      return _merge(out, lse, block_out, block_lse)
    merged_out, merged_lse = _merge(_rows(out, self.q_half, 1), _rows(lse, self.q_half, 2),
                                    block_out, block_lse)
    return (_put_rows(out, merged_out, self.q_half, 1), _put_rows(lse, merged_lse, self.q_half, 2))


@dataclasses.dataclass(frozen=True)
class _Choice:
  """A ring step whose calls depend on a run-time fact (on which side of us the source lies)."""
  predicate: jax.Array     # bool scalar
  if_true: Sequence[_Call]
  if_false: Sequence[_Call]


def _run_step(step_calls, fold, state):
  """state = fold(call, state) over the calls of one step, under lax.cond for a _Choice."""
  def fold_all(calls, state):
    for call in calls:
      state = fold(call, state)
    return state

  if isinstance(step_calls, _Choice):
    return lax.cond(step_calls.predicate, functools.partial(fold_all, step_calls.if_true),
                    functools.partial(fold_all, step_calls.if_false), state)
  return fold_all(step_calls, state)


def _rows(x, half, axis):
  if half is ALL:
    return x
  size = x.shape[axis] // 2
  return lax.slice_in_dim(x, half * size, (half + 1) * size, axis=axis)


def _put_rows(x, part, half, axis):
  return lax.dynamic_update_slice_in_dim(x, part.astype(x.dtype), half * part.shape[axis], axis)


def _add_rows(acc, part, half):
  if half is ALL:
    return acc + part.astype(acc.dtype)
  return _put_rows(acc, _rows(acc, half, 1) + part.astype(acc.dtype), half, 1)


def _merge(out, lse, block_out, block_lse):
  """The logsumexp identity; rows where both sides are empty (lse -inf) stay (0, -inf)."""
  total = jnp.logaddexp(lse, block_lse)
  safe_total = jnp.where(jnp.isneginf(total), 0.0, total)
  weight = lambda l: jnp.transpose(jnp.exp(l - safe_total), (0, 2, 1))[..., None]
  return out * weight(lse) + block_out.astype(jnp.float32) * weight(block_lse), total


class _Steps:
  """The ring's schedule, traced inside the SPMD context that binds `ring.axis_name`."""

  def __init__(self, ring: RingSpec, causal: bool, q_len: int, kv_len: int):
    self.axis_name = ring.axis_name
    self.size = lax.axis_size(ring.axis_name)
    self.me = lax.axis_index(ring.axis_name)
    self.zigzag = ring.layout == "zigzag"
    self.causal = causal
    self.q_len, self.kv_len = q_len, kv_len

  def shift(self, arrays):
    """Send to the next device of the ring, receive from the previous one."""
    perm = [(i, (i + 1) % self.size) for i in range(self.size)]
    return tuple(lax.ppermute(x, self.axis_name, perm) for x in arrays)

  def calls(self, step: int, q_lens, kv_lens) -> Sequence[_Call] | _Choice:
    source = (self.me - step) % self.size  # whose key/value block we hold at this step
    q_valid = self._valid(q_lens, self.me, ALL, self.q_len)
    kv_valid = self._valid(kv_lens, source, ALL, self.kv_len)
    if not self.causal:
      return [_Call(ALL, ALL, False, q_valid, kv_valid)]
    if step == 0:
      return [_Call(ALL, ALL, True, q_valid, kv_valid)]
    if not self.zigzag:  # keys of a later block are all in the future: none of them is kept
      return [_Call(ALL, ALL, False, q_valid, jnp.where(source < self.me, kv_valid, 0))]
    return _Choice(
        source < self.me,
        if_true=[_Call(ALL, 0, False, q_valid, self._valid(kv_lens, source, 0, self.kv_len))],
        if_false=[_Call(1, ALL, False, self._valid(q_lens, self.me, 1, self.q_len), kv_valid)])

  def _valid(self, lengths, device, half, block_len):
    """Valid rows among the rows `half` of `device`'s block: prefix lengths stay prefixes."""
    if not self.zigzag:
      return _chunk_valid(lengths, device, block_len)
    chunk_len = block_len // 2
    lo_chunk, hi_chunk = device, 2 * self.size - 1 - device
    if half is ALL:
      return (_chunk_valid(lengths, lo_chunk, chunk_len)
              + _chunk_valid(lengths, hi_chunk, chunk_len))
    return _chunk_valid(lengths, (lo_chunk, hi_chunk)[half], chunk_len)


def _chunk_valid(lengths, chunk, chunk_len: int):
  return jnp.clip(lengths - chunk * chunk_len, 0, chunk_len).astype(jnp.int32)


# -- reordering a contiguous sharding into zigzag and back (the automatic path) ------------------

def contiguous_to_zigzag(x, axis_name, axis: int = 1):
  """Device d holds natural chunks (2d, 2d+1) of 2P; afterwards it holds (d, 2P-1-d).

  Chunk m goes to device m (m < P) or 2P-1-m. Even chunks (first halves) and odd chunks (second
  halves) each form a permutation of the devices, so two ppermutes do it; a device receives one
  even and one odd chunk, its own-index chunk first."""
  size, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
  if size == 1:
    return x
  first, second = jnp.split(x, 2, axis=axis)
  even = lax.ppermute(first, axis_name, _zigzag_moves(size, parity=0))
  odd = lax.ppermute(second, axis_name, _zigzag_moves(size, parity=1))
  me_even = me % 2 == 0
  return jnp.concatenate([jnp.where(me_even, even, odd), jnp.where(me_even, odd, even)], axis)


def zigzag_to_contiguous(x, axis_name, axis: int = 1):
  """Inverse of `contiguous_to_zigzag`."""
  size, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
  if size == 1:
    return x
  own, mirror = jnp.split(x, 2, axis=axis)
  me_even = me % 2 == 0
  even, odd = jnp.where(me_even, own, mirror), jnp.where(me_even, mirror, own)
  back = lambda moves: [(dst, src) for src, dst in moves]
  first = lax.ppermute(even, axis_name, back(_zigzag_moves(size, parity=0)))
  second = lax.ppermute(odd, axis_name, back(_zigzag_moves(size, parity=1)))
  return jnp.concatenate([first, second], axis)


def _zigzag_moves(size: int, parity: int):
  """(source device, destination device) of chunk 2d + parity for every device d."""
  def destination(chunk):
    return chunk if chunk < size else 2 * size - 1 - chunk
  return [(d, destination(2 * d + parity)) for d in range(size)]


# -- helpers -------------------------------------------------------------------------------------

def _axis_tuple(axis_name) -> tuple:
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not names or not all(isinstance(n, str) for n in names):
    raise ValueError(f"axis_name must be a mesh axis name or a tuple of them; got {axis_name!r}")
  return tuple(names)


def _check_block_lengths(shape: AttentionShape, is_causal: bool, layout: str):
  if is_causal and shape.q_len != shape.kv_len:
    raise ValueError("is_causal=True needs query and key blocks of one length on every device; "
                     f"got query T={shape.q_len}, key S={shape.kv_len}")
  if layout == "zigzag" and (shape.q_len % 2 or shape.kv_len % 2):
    raise ValueError("layout='zigzag' needs even query / key block lengths (two chunks per "
                     f"device); got query T={shape.q_len}, key S={shape.kv_len}")


def _global_lengths(lengths, batch: int, block_len: int, ring: RingSpec):
  if lengths is not None:
    return lengths.astype(jnp.int32)
  return jnp.full((batch,), block_len * lax.axis_size(ring.axis_name), jnp.int32)

