"""From a matched Site to one `jax_flash.flash_attention` call (and the schedule it would use).

The kernel layout is fixed: q [B, T, N, H], k / v [B, S, K, H], bias / mask [B|1, N|1, T|1,
S|1], lengths [B]. A site's labels are grouped into those dims (`patterns.q_groups` ...) and
every operand is arranged accordingly; the kernel output is arranged back into the layout of
the program's PV product, and cast to its dtype.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash.rewrite import operands
from jax_flash.rewrite.patterns import (Site, k_groups, q_groups, score_groups, v_groups,
                                        window_params)


@dataclasses.dataclass
class KernelOperands:
  """The operands of a site's kernel call, each an `Operand` and its kernel groups."""
  q: tuple
  k: tuple
  v: tuple
  biases: list          # (Operand, groups)
  masks: list           # (Operand, groups, negated)
  kv_lengths: list      # (Operand, groups, offset)
  q_lengths: list


def kernel_operands(site: Site, strip) -> KernelOperands:
  """`strip(value, labels)` traces masks and lengths to their unbroadcast source arrays."""
  scores = score_groups(site)
  batch = [site.batch_group]
  return KernelOperands(
      q=(site.q, q_groups(site)), k=(site.k, k_groups(site)), v=(site.v, v_groups(site)),
      biases=[(b, scores) for b in site.biases],
      masks=[(strip(t.tensor.value, t.tensor.labels), scores, t.negated)
             for t in site.keep.tensors],
      kv_lengths=[(strip(t.value, t.labels), batch, off) for t, off in site.keep.kv_lengths],
      q_lengths=[(strip(t.value, t.labels), batch, off) for t, off in site.keep.q_lengths])


def _prepare(site: Site, read, operand, groups):
  return operands.arrange(read(operand.source), operand.labels, groups, site.sizes)


def _group_size(site: Site, labels, group) -> int:
  present = [l for l in labels if l is not None]
  return math.prod(site.sizes[l] for l in group) if any(l in present for l in group) else 1


def _shape(site: Site, operand, groups) -> tuple:
  return tuple(_group_size(site, operand.labels, g) for g in groups)


def _lengths(site: Site, read, entries, static_bound, full: int):
  batch = math.prod(site.sizes[l] for l in site.batch_group)
  lengths = None
  for operand, groups, offset in entries:
    x = jnp.broadcast_to(jnp.reshape(_prepare(site, read, operand, groups), (-1,)), (batch,))
    x = x.astype(jnp.int32) + np.int32(offset)
    lengths = x if lengths is None else jnp.minimum(lengths, x)
  if math.isfinite(static_bound) and static_bound < full:
    bound = jnp.full((batch,), int(static_bound), jnp.int32)
    lengths = bound if lengths is None else jnp.minimum(lengths, bound)
  return lengths


def _window(site: Site):
  t_size = site.sizes[site.query] if site.query else 1
  return window_params(site.keep, t_size, site.sizes[site.key])


def call_kernel(site: Site, ops: KernelOperands, read, flash_attention):
  """Emit the kernel call for `site`; `read(value)` gives the traced array of a graph value."""
  dtype = site.dtype
  q, k, v = (_prepare(site, read, op, groups).astype(dtype) for op, groups in (ops.q, ops.k,
                                                                                ops.v))
  bias = None
  for operand, groups in ops.biases:
    term = _prepare(site, read, operand, groups)
    term = term if operand.scale == 1.0 else term * np.asarray(operand.scale, term.dtype)
    bias = term if bias is None else bias + term
  mask = None
  for operand, groups, negated in ops.masks:
    term = _prepare(site, read, operand, groups).astype(bool)
    term = jnp.logical_not(term) if negated else term
    mask = term if mask is None else jnp.logical_and(mask, term)
  t_size = site.sizes[site.query] if site.query else 1
  s_size = site.sizes[site.key]
  is_causal, window = _window(site)
  out = flash_attention(
      q, k, v, bias, mask, scale=site.scale, is_causal=is_causal,
      query_seq_lengths=_lengths(site, read, ops.q_lengths, site.keep.q_bound, t_size),
      key_value_seq_lengths=_lengths(site, read, ops.kv_lengths, site.keep.kv_bound, s_size),
      local_window_size=window, softcap=site.softcap, schedule=site.schedule)
  groups = [site.batch_group, [site.query] if site.query else [],
            site.kv_heads + site.group_heads, [site.value_head]]
  out = operands.unarrange(out, groups, site.out_labels, site.out_shape, site.sizes)
  return out.astype(site.out_dtype)


def kernel_structs(site: Site, ops: KernelOperands):
  """ShapeDtypeStructs of (q, k, v, bias, mask) and the call's keyword arguments, for checking
  the call and choosing its schedule without arrays."""
  struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  q, k, v = (struct(_shape(site, op, groups), site.dtype) for op, groups in (ops.q, ops.k,
                                                                             ops.v))
  bias = mask = None
  if ops.biases:
    shapes = [_shape(site, op, groups) for op, groups in ops.biases]
    bias = struct(tuple(max(d) for d in zip(*shapes)),
                  np.result_type(*[op.source.dtype for op, _ in ops.biases]))
  if ops.masks:
    shapes = [_shape(site, op, groups) for op, groups, _ in ops.masks]
    mask = struct(tuple(max(d) for d in zip(*shapes)), np.bool_)
  batch = q.shape[0]
  lengths = lambda entries, bound, full: (
      struct((batch,), np.int32) if entries or (math.isfinite(bound) and bound < full) else None)
  t_size = q.shape[1]
  is_causal, window = _window(site)
  kwargs = dict(scale=site.scale, is_causal=is_causal,
                query_seq_lengths=lengths(ops.q_lengths, site.keep.q_bound, t_size),
                key_value_seq_lengths=lengths(ops.kv_lengths, site.keep.kv_bound, k.shape[1]),
                local_window_size=window, softcap=site.softcap)
  return (q, k, v, bias, mask), kwargs
