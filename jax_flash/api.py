"""flash_attention: the public entry point, with the signature of jax.nn.dot_product_attention."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash import _dispatch, _kernel_call
from jax_flash._validate import build_config


def flash_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    softcap=None, return_residual=False, schedule="auto", deterministic=False):
  """Exact attention, fused: softmax(scale * Q Kᵀ + bias, masked) V, never an N×N matrix in memory.

  Layout and semantics are those of `jax.nn.dot_product_attention`:
    query [B, T, N, H], key / value [B, S, K, H] with N % K == 0 (GQA / MQA);
    bias: additive, 4-D broadcastable to [B, N, T, S]; mask: boolean, same broadcasting, True =
    keep; scale defaults to 1/sqrt(H); is_causal keeps key s <= query t (top-left aligned);
    query_seq_lengths / key_value_seq_lengths [B] mark the valid prefix of each sequence;
    local_window_size w or (left, right) keeps t - left <= s <= t + right.
  Additions: `softcap` (scores become softcap * tanh(scores / softcap), before the bias),
  `schedule` ("auto", or one of `jax_flash.schedules()`) and `deterministic`: when True the
  gradients are bitwise identical from run to run. The cpu and v1 backwards always are; v3's is
  on request (it then adds dQ partials in a fixed order, at a measured cost, docs/perf-notes.md);
  v2's adds dQ with fp32 atomics and cannot be, so "auto" passes it over and schedule="v2" with
  deterministic=True raises ValueError.

  Fully-masked rows (no key kept, or t >= query_seq_lengths[b]) give output 0 and logsumexp
  -inf. (jax.nn.dot_product_attention returns the mean of V for a fully-masked row instead.)

  With `return_residual=True` also returns the logsumexp of each row, [B, T, N], in key.dtype,
  under stop_gradient, as jax.nn does.
  """
  shape, config = build_config(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, softcap=softcap, deterministic=deterministic)
  chosen = _dispatch.select(schedule, shape, query.dtype, config)
  q_lens = _lengths(query_seq_lengths, shape.batch, shape.q_len)
  kv_lens = _lengths(key_value_seq_lengths, shape.batch, shape.kv_len)
  q, k, v = (_pad_head_dim(x, chosen.head_dim_multiple) for x in (query, key, value))
  out, lse = _attention(chosen, config, q, k, v, bias, mask, q_lens, kv_lens)
  out = out[..., :shape.head_dim]
  if return_residual:
    return out, jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(key.dtype))
  return out


def _lengths(lengths, batch: int, full: int):
  if lengths is None:
    return jnp.full((batch,), full, jnp.int32)
  return lengths.astype(jnp.int32)


def _pad_head_dim(x, multiple: int):
  """Zero-pad the head dim to the kernel's tile multiple: zeros add nothing to any score."""
  extra = -x.shape[-1] % multiple
  if extra == 0:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(schedule, config, q, k, v, bias, mask, q_lens, kv_lens):
  return _kernel_call.forward(schedule, config, q, k, v, bias, mask, q_lens, kv_lens)


def _attention_fwd(schedule, config, q, k, v, bias, mask, q_lens, kv_lens):
  out, lse = _kernel_call.forward(schedule, config, q, k, v, bias, mask, q_lens, kv_lens)
  return (out, lse), (q, k, v, bias, mask, q_lens, kv_lens, out, lse)


def _attention_bwd(schedule, config, residuals, cotangents):
  q, k, v, bias, mask, q_lens, kv_lens, out, lse = residuals
  dout, _ = cotangents  # the logsumexp leaves the API under stop_gradient
  dq, dk, dv, dbias_full = _kernel_call.backward(
      schedule, config, q, k, v, bias, mask, q_lens, kv_lens, out, lse, dout.astype(q.dtype))
  return dq, dk, dv, _reduce_to(dbias_full, bias), None, None, None


def _reduce_to(full_gradient, bias):
  """Sum the full [B, N, T, S] score gradient over the dims the bias broadcasts along."""
  if bias is None:
    return None
  axes = tuple(i for i, d in enumerate(bias.shape) if d == 1 and full_gradient.shape[i] != 1)
  return jnp.sum(full_gradient, axis=axes, keepdims=True).astype(bias.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)
