"""flash_decode: attention of a few new query tokens against a (paged) KV cache.

The contract (both implementations compute exactly this):

  query          [B, T, N, H]  the T newest tokens of each sequence (T small: 1 when decoding
                               one token at a time, a few for speculative decoding)
  k_cache/v_cache              contiguous [B, S, K, H], or with `block_table` a page pool
                               [num_pages, page_size, K, H] (page_size a power of two), N % K == 0
  block_table    int32 [B, max_pages]: page j of sequence b is k_cache[block_table[b, j]], so
                               position p of sequence b lives at page block_table[b, p // page_size],
                               row p % page_size. The capacity of a sequence is S, or
                               max_pages * page_size.
  cache_seqlens  int32 [B]     tokens already in the cache of each sequence (clipped to
                               [0, capacity])

Without k_new: the cache already holds the T new tokens, kv_len[b] = cache_seqlens[b], and query
t sits at position kv_len[b] - T + t.
With k_new / v_new [B, T, K, H]: they are first written at positions cache_seqlens[b] + t (the
caches come back updated; under jax.jit with the caches donated this happens in place, no copy),
then kv_len[b] = cache_seqlens[b] + T and query t sits at position cache_seqlens[b] + t.
Keep cache_seqlens[b] + T <= capacity: rows that would land past the capacity are not stored.

Query t at position p sees the keys at positions s with s <= p (causal, aligned to the END of the
sequence) and, with `local_window_size` w, s >= p - w. A query that sees no key (p < 0) gives
output 0 and logsumexp -inf.

Implementations:
  "cuda"    the split-KV kernels of cuda/decode.cu (bfloat16 / float16, head dim 64, 128 or 256,
            on the GPU): the key range of each sequence is cut into splits, one thread block
            each, all query heads of a kv head read each cache byte once, and the splits are merged
            with the logsumexp identity.
  "gather"  a fallback that works anywhere (it is what runs on the CPU): it gathers the paged
            cache into a dense [B, capacity, K, H] copy with jnp.take and calls
            jax_flash.flash_attention with a mask that expresses the end-aligned causal rule. It
            reads and writes the whole capacity every call; its logsumexp has the precision of
            the input dtype.
  None      "cuda" when it can serve the call, else "gather".

flash_decode is an inference API: the "cuda" implementation has no gradient.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _extension
from jax_flash._validate import check_seq_lengths, resolve_scale, resolve_softcap
from jax_flash.schedules import decode as decode_schedule

IMPLEMENTATIONS = ("cuda", "gather")
_CACHE_TARGET = "jax_flash_decode_cache_fwd"
_APPEND_TARGET = "jax_flash_decode_append_fwd"
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class _Call(NamedTuple):
  """The static description of one flash_decode call."""
  batch: int
  q_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  capacity: int
  paged: bool
  appends: bool
  scale: float
  softcap: float
  window_left: int   # -1 = unbounded
  num_splits: int    # 0 = automatic


def flash_decode(query, k_cache, v_cache, cache_seqlens, *, block_table=None, scale=None,
                 softcap=None, local_window_size=None, num_splits="auto", k_new=None, v_new=None,
                 return_lse=False, implementation=None):
  """Attention of the T newest tokens against a KV cache (the module docstring has the contract).

  Args:
    query: [B, T, N, H].
    k_cache, v_cache: [B, S, K, H], or pages [num_pages, page_size, K, H] with `block_table`.
    cache_seqlens: int [B], tokens in the cache of each sequence (before appending k_new).
    block_table: int32 [B, max_pages] for a paged cache, else None.
    scale: score scale, default 1/sqrt(H).
    softcap: scores become softcap * tanh(scores / softcap) when given.
    local_window_size: int w: a query at position p sees keys p - w .. p only.
    num_splits: "auto" or the number of pieces the "cuda" kernel cuts each key range into.
    k_new, v_new: [B, T, K, H] rows to append at positions cache_seqlens[b] + t (both or none).
    return_lse: also return the logsumexp of each row, float32 [B, T, N].
    implementation: None, "cuda" or "gather".

  Returns:
    out [B, T, N, H]; then lse [B, T, N] when return_lse; then the updated k_cache and v_cache
    when k_new is given. (A single array when there is nothing but out.)
  """
  call = _describe(query, k_cache, v_cache, cache_seqlens, block_table, scale, softcap,
                   local_window_size, num_splits, k_new, v_new)
  impl = _choose_implementation(implementation, call, query.dtype)
  lengths = cache_seqlens.astype(jnp.int32)
  run = _cuda_decode if impl == "cuda" else _gather_decode
  out, lse, k_cache, v_cache = run(call, query, k_cache, v_cache, lengths, block_table, k_new,
                                   v_new)
  results = (out,) + ((lse,) if return_lse else ()) + ((k_cache, v_cache) if call.appends else ())
  return results[0] if len(results) == 1 else results


# ---- validation ---------------------------------------------------------------------------------

def _shape(x) -> str:
  return str(list(getattr(x, "shape", ()))) if hasattr(x, "shape") else type(x).__name__


def _check_array(name: str, x, ndim: int, layout: str):
  if getattr(x, "ndim", None) != ndim:
    raise ValueError(f"{name} must be a {ndim}-D array {layout}; got {_shape(x)}")


def _check_new_rows(k_new, v_new, query, num_kv_heads: int):
  if (k_new is None) != (v_new is None):
    raise ValueError("k_new and v_new must be given together (or neither); got "
                     f"k_new={_shape(k_new)}, v_new={_shape(v_new)}")
  if k_new is None:
    return
  b, t, _, h = query.shape
  want = (b, t, num_kv_heads, h)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if getattr(x, "shape", None) != want or x.dtype != query.dtype:
      raise ValueError(f"{name} must be [B, T, K, H] = {list(want)} with query's dtype "
                       f"{query.dtype}; got {getattr(x, 'dtype', None)}{_shape(x)}")


def _check_block_table(block_table, k_cache, batch: int) -> int:
  """Capacity of a sequence in the paged layout."""
  if getattr(block_table, "ndim", None) != 2 or block_table.shape[0] != batch or \
      block_table.dtype != jnp.int32:
    raise ValueError(f"block_table must be an int32 array [B, max_pages] with B = {batch}; got "
                     f"{getattr(block_table, 'dtype', None)}{_shape(block_table)}")
  page_size = k_cache.shape[1]
  if page_size < 1 or page_size & (page_size - 1):
    raise ValueError(f"k_cache's page size (dim 1 of [num_pages, page_size, K, H]) must be a "
                     f"power of two; got {page_size}")
  return block_table.shape[1] * page_size


def _window(local_window_size) -> int:
  if local_window_size is None:
    return -1
  if not isinstance(local_window_size, (int, np.integer)) or local_window_size < 0:
    raise ValueError(f"local_window_size must be a non-negative int (keys p - w .. p) or None; "
                     f"got {local_window_size!r}")
  return int(local_window_size)


def _splits(num_splits) -> int:
  if isinstance(num_splits, str) and num_splits == "auto":
    return 0
  if isinstance(num_splits, (int, np.integer)) and not isinstance(num_splits, bool) and \
      1 <= num_splits <= decode_schedule.MAX_SPLITS:
    return int(num_splits)
  raise ValueError(f"num_splits must be 'auto' or an int in [1, {decode_schedule.MAX_SPLITS}]; "
                   f"got {num_splits!r}")


def _describe(query, k_cache, v_cache, cache_seqlens, block_table, scale, softcap,
              local_window_size, num_splits, k_new, v_new) -> _Call:
  _check_array("query", query, 4, "[B, T, N, H]")
  layout = "[num_pages, page_size, K, H]" if block_table is not None else "[B, S, K, H]"
  _check_array("k_cache", k_cache, 4, layout)
  _check_array("v_cache", v_cache, 4, layout)
  if jnp.dtype(query.dtype).name not in _FLOAT_DTYPES:
    raise ValueError(f"query dtype must be one of {_FLOAT_DTYPES}; got {query.dtype}")
  if not k_cache.dtype == v_cache.dtype == query.dtype:
    raise ValueError(f"k_cache and v_cache must have query's dtype {query.dtype}; got "
                     f"{k_cache.dtype}, {v_cache.dtype}")
  if v_cache.shape != k_cache.shape:
    raise ValueError(f"v_cache must have the shape of k_cache {_shape(k_cache)}; got "
                     f"{_shape(v_cache)}")
  b, t, n, h = query.shape
  k = k_cache.shape[2]
  if k_cache.shape[3] != h:
    raise ValueError(f"k_cache head dim must equal query's ({h}); got {_shape(k_cache)}")
  if k == 0 or n % k != 0:
    raise ValueError(f"k_cache heads K={k} must divide query heads N={n}; got query "
                     f"{_shape(query)}, k_cache {_shape(k_cache)}")
  if block_table is None:
    if k_cache.shape[0] != b:
      raise ValueError(f"k_cache batch must equal query's ({b}) when block_table is None; got "
                       f"{_shape(k_cache)}")
    capacity = k_cache.shape[1]
  else:
    capacity = _check_block_table(block_table, k_cache, b)
  check_seq_lengths("cache_seqlens", cache_seqlens, b, optional=False)
  _check_new_rows(k_new, v_new, query, k)
  return _Call(batch=b, q_len=t, num_heads=n, num_kv_heads=k, head_dim=h, capacity=capacity,
               paged=block_table is not None, appends=k_new is not None,
               scale=resolve_scale(scale, h), softcap=resolve_softcap(softcap),
               window_left=_window(local_window_size), num_splits=_splits(num_splits))


def _cuda_unavailable_reason(call: _Call, dtype) -> str | None:
  # The decode schedule's own checks (backend, kernels built, device architecture) first.
  reason = decode_schedule.DECODE.unavailable_reason()
  if reason:
    return reason
  if {_CACHE_TARGET, _APPEND_TARGET} - _extension.available_targets("gpu"):
    return "the extension was built without the CUDA decode kernels (nvcc at build time)"
  if jnp.dtype(dtype).name not in decode_schedule.DECODE.dtypes:
    return f"needs one of {sorted(decode_schedule.DECODE.dtypes)}; got {jnp.dtype(dtype).name}"
  return decode_schedule.kernel_limits(call.batch, call.q_len, call.num_heads,
                                       call.num_kv_heads, call.head_dim, call.capacity)


def _choose_implementation(implementation, call: _Call, dtype) -> str:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}; got "
                     f"{implementation!r}")
  if implementation == "gather":
    return "gather"
  reason = _cuda_unavailable_reason(call, dtype)
  if implementation == "cuda" and reason is not None:
    raise ValueError(f"implementation='cuda' cannot serve this call: {reason}")
  return "cuda" if reason is None else "gather"


# ---- the CUDA kernels ---------------------------------------------------------------------------

def _cuda_decode(call: _Call, query, k_cache, v_cache, lengths, block_table, k_new, v_new):
  b, t, n, _ = query.shape
  max_keys = call.capacity + (t if call.appends else 0)
  workspaces = decode_schedule.workspaces(b, t, n, call.num_kv_heads, call.head_dim, max_keys,
                                          call.num_splits)
  table = block_table if call.paged else jnp.zeros((1, 1), jnp.int32)
  attributes = dict(scale=np.float32(call.scale), softcap=np.float32(call.softcap),
                    window_left=np.int32(call.window_left), paged=bool(call.paged),
                    num_splits=np.int32(call.num_splits))
  results = (jax.ShapeDtypeStruct(query.shape, query.dtype),
             jax.ShapeDtypeStruct((b, n, t), jnp.float32), *workspaces)
  if not call.appends:
    kernel = jax.ffi.ffi_call(_CACHE_TARGET, results, vmap_method="sequential")
    out, lse, *_ = kernel(query, k_cache, v_cache, lengths, table, **attributes)
  else:
    caches = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
              jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    kernel = jax.ffi.ffi_call(_APPEND_TARGET, caches + results, vmap_method="sequential",
                              input_output_aliases={1: 0, 2: 1})
    k_cache, v_cache, out, lse, *_ = kernel(query, k_cache, v_cache, lengths, table, k_new, v_new,
                                            **attributes)
  return out, jnp.transpose(lse, (0, 2, 1)), k_cache, v_cache


# ---- the gather fallback ------------------------------------------------------------------------

def _append_rows(cache, rows, positions, block_table, capacity: int):
  """cache with rows [B, T, K, H] stored at positions [B, T] (rows past the capacity dropped)."""
  b = rows.shape[0]
  if block_table is None:
    batch_index = jnp.broadcast_to(jnp.arange(b)[:, None], positions.shape)
    return cache.at[batch_index, positions].set(rows, mode="drop")
  page_size = cache.shape[1]
  table_index = jnp.minimum(positions // page_size, block_table.shape[1] - 1)
  pages = jnp.take_along_axis(block_table, table_index, axis=1)
  pages = jnp.where(positions < capacity, pages, cache.shape[0])  # out of range: dropped
  return cache.at[pages, positions % page_size].set(rows, mode="drop")


def _dense(cache, block_table):
  """The logical cache [B, capacity, K, H] (a gathered copy when paged)."""
  if block_table is None:
    return cache
  pages = jnp.take(cache, block_table, axis=0, mode="clip")  # [B, max_pages, page, K, H]
  b, m, p = pages.shape[:3]
  return pages.reshape((b, m * p) + cache.shape[2:])


def _gather_decode(call: _Call, query, k_cache, v_cache, lengths, block_table, k_new, v_new):
  # Imported here: jax_flash.api imports the schedules, which this module's importers load first.
  from jax_flash.api import flash_attention
  t = call.q_len
  cache_len = jnp.clip(lengths, 0, call.capacity)
  if call.appends:
    positions = cache_len[:, None] + jnp.arange(t)[None, :]
    k_cache = _append_rows(k_cache, k_new, positions, block_table, call.capacity)
    v_cache = _append_rows(v_cache, v_new, positions, block_table, call.capacity)
    kv_len = cache_len + t
  else:
    kv_len = cache_len
  query_pos = kv_len[:, None] - t + jnp.arange(t)[None, :]       # [B, T]
  key_pos = jnp.arange(call.capacity)[None, None, :]               # [1, 1, S]
  keep = key_pos <= query_pos[:, :, None]
  if call.window_left >= 0:
    keep &= key_pos >= query_pos[:, :, None] - call.window_left
  out, lse = flash_attention(
      query, _dense(k_cache, block_table), _dense(v_cache, block_table), mask=keep[:, None],
      key_value_seq_lengths=jnp.minimum(kv_len, call.capacity), scale=call.scale,
      softcap=call.softcap or None, return_residual=True)
  return out, lse.astype(jnp.float32), k_cache, v_cache


def default_implementation(dtype, head_dim: int) -> str:
  """The implementation flash_decode(implementation=None) takes for this dtype and head dim on
  the default backend (for typical sizes)."""
  probe = _Call(1, 1, 1, 1, head_dim, 1, False, False, 1.0, 0.0, -1, 0)
  return "cuda" if _cuda_unavailable_reason(probe, dtype) is None else "gather"


__all__ = ["flash_decode", "default_implementation", "IMPLEMENTATIONS"]
