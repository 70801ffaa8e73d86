"""The float64 NumPy reference: the executable definition of what every schedule computes.

Materializes the full [B, N, T, S] score matrix, so it is for tests and the bench only.
Semantics are those of docs/architecture.md, fully-masked rows included (out 0, lse -inf).
"""
from __future__ import annotations

import numpy as np


def _f64(x):
  return None if x is None else np.asarray(x, dtype=np.float64)


def keep_mask(batch, num_heads, q_len, kv_len, mask=None, q_seqlens=None, kv_seqlens=None, *,
              is_causal=False, window_left=-1, window_right=-1, q_offset=0) -> np.ndarray:
  """Boolean [B, N, T, S]: which (query, key) pairs take part. q_offset: the position of the first
  query row in its sequence, when the rows are a slice of it (causal, windows and q_seqlens
  apply to row q_offset + t)."""
  t = q_offset + np.arange(q_len)[:, None]
  s = np.arange(kv_len)[None, :]
  keep = np.ones((q_len, kv_len), bool)
  if is_causal:
    keep &= s <= t
  if window_left >= 0:
    keep &= s >= t - window_left
  if window_right >= 0:
    keep &= s <= t + window_right
  keep = np.broadcast_to(keep, (batch, num_heads, q_len, kv_len)).copy()
  if mask is not None:
    keep &= np.broadcast_to(np.asarray(mask, bool), keep.shape)
  q_lens = np.full(batch, q_offset + q_len) if q_seqlens is None else np.asarray(q_seqlens)
  kv_lens = np.full(batch, kv_len) if kv_seqlens is None else np.asarray(kv_seqlens)
  keep &= (q_offset + np.arange(q_len)[None, :] < q_lens[:, None])[:, None, :, None]
  keep &= (np.arange(kv_len)[None, :] < kv_lens[:, None])[:, None, None, :]
  return keep


def _expand_kv(x, num_heads):
  """[B, S, K, H] -> [B, N, S, H] with query head n reading kv head n // (N // K)."""
  group = num_heads // x.shape[2]
  return np.repeat(np.transpose(x, (0, 2, 1, 3)), group, axis=1)


def _scores(q, k, bias, scale, softcap):
  """(capped scores x before bias, final scores) as [B, N, T, S]."""
  raw = scale * np.einsum("btnh,bnsh->bnts", q, k, optimize=True)
  capped = softcap * np.tanh(raw / softcap) if softcap else raw
  final = capped + (0.0 if bias is None else np.broadcast_to(bias, capped.shape))
  return capped, final


def attention_forward_f64(q, k, v, bias=None, mask=None, q_seqlens=None, kv_seqlens=None, *,
                          scale, softcap=0.0, is_causal=False, window_left=-1, window_right=-1,
                          q_offset=0):
  """(out [B, T, N, H], lse [B, N, T]) in float64; q_offset as in keep_mask."""
  q, k, v, bias = _f64(q), _f64(k), _f64(v), _f64(bias)
  b, t, n, _ = q.shape
  kx, vx = _expand_kv(k, n), _expand_kv(v, n)
  _, x = _scores(q, kx, bias, scale, softcap)
  keep = keep_mask(b, n, t, k.shape[1], mask, q_seqlens, kv_seqlens, is_causal=is_causal,
                   window_left=window_left, window_right=window_right, q_offset=q_offset)
  p, lse = _masked_softmax(x, keep)
  out = np.einsum("bnts,bnsh->btnh", p, vx, optimize=True)
  return out, lse


def _masked_softmax(x, keep):
  x = np.where(keep, x, -np.inf)
  row_max = np.max(x, axis=-1, keepdims=True)
  safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.where(keep, np.exp(x - safe_max), 0.0)
  total = e.sum(-1, keepdims=True)
  p = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
  with np.errstate(divide="ignore"):
    lse = np.where(total[..., 0] > 0, np.log(np.where(total > 0, total, 1.0))[..., 0]
                   + safe_max[..., 0], -np.inf)
  return p, lse


def attention_backward_f64(q, k, v, dout, bias=None, mask=None, q_seqlens=None, kv_seqlens=None,
                           *, scale, softcap=0.0, is_causal=False, window_left=-1,
                           window_right=-1, q_offset=0):
  """(dq, dk, dv, dbias_full [B, N, T, S]) in float64, the exact gradient of attention_forward_f64."""
  q, k, v, dout, bias = _f64(q), _f64(k), _f64(v), _f64(dout), _f64(bias)
  b, t, n, _ = q.shape
  group = n // k.shape[2]
  kx, vx = _expand_kv(k, n), _expand_kv(v, n)
  capped, x = _scores(q, kx, bias, scale, softcap)
  keep = keep_mask(b, n, t, k.shape[1], mask, q_seqlens, kv_seqlens, is_causal=is_causal,
                   window_left=window_left, window_right=window_right, q_offset=q_offset)
  p, _ = _masked_softmax(x, keep)
  dvx = np.einsum("bnts,btnh->bnsh", p, dout, optimize=True)
  dp = np.einsum("btnh,bnsh->bnts", dout, vx, optimize=True)
  ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
  dbias = ds
  if softcap:
    ds = ds * (1.0 - (capped / softcap) ** 2)
  dq = scale * np.einsum("bnts,bnsh->btnh", ds, kx, optimize=True)
  dkx = scale * np.einsum("bnts,btnh->bnsh", ds, q, optimize=True)

  def fold(x):  # [B, N, S, H] -> [B, S, K, H], summing the query heads of each group
    return np.transpose(x.reshape(b, n // group, group, *x.shape[2:]).sum(2), (0, 2, 1, 3))

  return dq, fold(dkx), fold(dvx), dbias
