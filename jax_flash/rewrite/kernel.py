"""From a matched Site to one `jax_flash.flash_attention` call.

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

  def inputs(self) -> list:
    """Every graph value the kernel call reads."""
    entries = [self.q, self.k, self.v] + self.biases + self.masks + self.kv_lengths + \
        self.q_lengths
    return [entry[0].source for entry in entries]


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


def kernel_arguments(site: Site, ops: KernelOperands, read):
  """(arrays, statics): the keyword arguments of the site's `flash_attention` call.

  `read(value)` gives the array of a graph value (traced, or abstract for `kernel_shapes`)."""
  q, k, v = (_prepare(site, read, op, groups).astype(site.dtype) for op, groups in (ops.q, ops.k,
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
  is_causal, window = window_params(site.keep, t_size, s_size)
  arrays = dict(
      query=q, key=k, value=v, bias=bias, mask=mask,
      query_seq_lengths=_lengths(site, read, ops.q_lengths, site.keep.q_bound, t_size),
      key_value_seq_lengths=_lengths(site, read, ops.kv_lengths, site.keep.kv_bound, s_size))
  statics = dict(scale=site.scale, is_causal=is_causal, local_window_size=window,
                 softcap=site.softcap)
  return arrays, statics


def call_kernel(site: Site, ops: KernelOperands, read, flash_attention):
  """Emit the kernel call for `site`, its output in the layout and dtype of the PV product."""
  arrays, statics = kernel_arguments(site, ops, read)
  out = flash_attention(**arrays, **statics, schedule=site.schedule)
  groups = [site.batch_group, [site.query] if site.query else [],
            site.kv_heads + site.group_heads, [site.value_head]]
  out = operands.unarrange(out, groups, site.out_labels, site.out_shape, site.sizes)
  return out.astype(site.out_dtype)


def kernel_shapes(site: Site, ops: KernelOperands):
  """(arrays as ShapeDtypeStructs, statics) of the kernel call, without computing anything: for
  validating the call and choosing its schedule at analysis time."""
  values = [v for v in ops.inputs() if not v.is_const]
  statics = {}

  def build(*arrays):
    env = {id(v): a for v, a in zip(values, arrays)}
    built, found = kernel_arguments(site, ops, lambda v: v.const if v.is_const else env[id(v)])
    statics.update(found)
    return built

  shapes = jax.eval_shape(build, *[jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values])
  return shapes, statics
