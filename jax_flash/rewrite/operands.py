"""Operands of an attention site: the arrays that reach the kernel, with named axes.

Each axis of the scores gets a label when the QK product is found. An operand (query, key,
value, bias, mask, lengths) is traced back from where attention uses it through operations that
only rename axes or scale: transposes, squeezes and size-1 reshapes, broadcasts (keys and values
shared across heads, masks shared across batch), `jnp.repeat` of heads (GQA) and multiplication
by a constant scalar (the softmax scale, also when pre-applied to q or k). What remains is the
`source` array the program already has, with the label of each of its dims, so the kernel gets
it without copies when its layout already is BTNH.

`arrange` brings a source into a kernel layout: a list of label groups, each group one kernel
dim (the flattened product of its labels), broadcasting along labels the source lacks.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_flash.rewrite.graph import Graph, Value


@dataclasses.dataclass
class Operand:
  source: Value
  labels: tuple             # the label of each dim of `source` (None: constant along it)
  scale: float = 1.0        # the operand is `scale * source`
  repeat: tuple | None = None   # (label, groups): the labeled dim holds index // groups
  nodes: list = dataclasses.field(default_factory=list)   # the nodes stripped off
  unrepeated: "Operand | None" = None   # the operand as it was before the repeat was stripped


def unit_reshape_labels(in_shape, out_shape, out_labels):
  """Labels of a reshape that only inserts or removes size-1 dims (None otherwise)."""
  if [d for d in in_shape if d != 1] != [d for d in out_shape if d != 1]:
    return None
  big = iter([l for l, d in zip(out_labels, out_shape) if d != 1])
  return tuple(next(big) if d != 1 else None for d in in_shape)


def _repeat_labels(graph: Graph, node, labels):
  """For reshape(broadcast_in_dim(x)) merging (kv, groups) dims where the broadcast made the
  groups dim: (x, labels of x, (label, groups), [broadcast node]); else None."""
  x = node.inputs[0]
  out_shape, in_shape = node.outputs[0].shape, x.shape
  if len(in_shape) != len(out_shape) + 1:
    return None
  merged = next((i for i in range(len(out_shape))
                 if in_shape[:i] == out_shape[:i] and in_shape[i + 2:] == out_shape[i + 1:]
                 and in_shape[i] * in_shape[i + 1] == out_shape[i]), None)
  if merged is None or labels[merged] is None or in_shape[merged + 1] == 1:
    return None
  broadcast = x.producer
  if broadcast is None or broadcast.prim != "broadcast_in_dim":
    return None
  src = broadcast.inputs[0]
  dims = broadcast.params["broadcast_dimensions"]
  group_dim = merged + 1
  if any(d == group_dim and src.shape[i] != 1 for i, d in enumerate(dims)):
    return None                       # the group dim is real data, not a repeat
  if any(d == merged and src.shape[i] != in_shape[merged] for i, d in enumerate(dims)):
    return None
  in_labels = list(labels[:merged]) + [labels[merged], None] + list(labels[merged + 1:])
  src_labels = tuple(in_labels[d] if src.shape[i] == in_shape[d] and in_shape[d] != 1 else None
                     for i, d in enumerate(dims))
  return src, src_labels, (labels[merged], in_shape[group_dim]), [node, broadcast]


def strip(graph: Graph, value: Value, labels: tuple, *, scales: bool = False,
          broadcasts: bool = False, repeats: bool = False) -> Operand:
  """Trace `value` back to its source array (see the module docstring)."""
  op = Operand(value, tuple(labels))
  while op.source.producer is not None:
    node = op.source.producer
    prim, x = node.prim, node.inputs[0]
    if prim == "transpose":
      perm = node.params["permutation"]
      new = [None] * len(perm)
      for out_dim, in_dim in enumerate(perm):
        new[in_dim] = op.labels[out_dim]
      op.source, op.labels = x, tuple(new)
    elif prim in ("squeeze", "expand_dims", "reshape") and unit_reshape_labels(
        x.shape, node.outputs[0].shape, op.labels) is not None:
      op.labels = unit_reshape_labels(x.shape, node.outputs[0].shape, op.labels)
      op.source = x
    elif prim == "reshape" and repeats and op.repeat is None and _repeat_labels(
        graph, node, op.labels) is not None:
      op.unrepeated = dataclasses.replace(op, nodes=list(op.nodes))
      op.source, op.labels, op.repeat, nodes = _repeat_labels(graph, node, op.labels)
      op.nodes += nodes[:-1]
      node = nodes[-1]
    elif prim == "broadcast_in_dim" and broadcasts:
      out_shape = node.outputs[0].shape
      dims = node.params["broadcast_dimensions"]
      op.labels = tuple(op.labels[d] if x.shape[i] == out_shape[d] else None
                        for i, d in enumerate(dims))
      op.source = x
    elif prim in ("mul", "div") and scales and _scalar_factor(graph, node) is not None:
      factor, op.source = _scalar_factor(graph, node)
      op.scale *= factor
    else:
      break
    op.nodes.append(node)
  return op


def _scalar_factor(graph: Graph, node):
  """(factor, tensor) for tensor * c, c * tensor or tensor / c with a constant scalar c."""
  a, b = node.inputs
  out_shape = node.outputs[0].shape
  pairs = ((a, b), (b, a)) if node.prim == "mul" else ((a, b),)
  for tensor, other in pairs:
    c = graph.scalar(other)
    if c is not None and tensor.shape == out_shape and math.isfinite(c) and c != 0:
      return (c if node.prim == "mul" else 1.0 / c), tensor
  return None


# ---- kernel layouts ----

def arrangement_cost(labels, groups, sizes) -> int:
  """How much `arrange` must move: 1 for a transpose, 2 for a materializing broadcast."""
  present = [l for l in labels if l is not None]
  target = [l for g in groups for l in g if l in present]
  cost = int(present != target)
  for group in groups:
    if any(l in present for l in group) and any(l not in present and sizes[l] > 1
                                                for l in group):
      cost += 2
  return cost


def arrange(x, labels, groups, sizes):
  """`x` (dims named by `labels`) as the array with one dim per group (see module docstring)."""
  keep = [i for i, l in enumerate(labels) if l is not None]
  present = [labels[i] for i in keep]
  if len(keep) != x.ndim:
    x = jnp.reshape(x, [x.shape[i] for i in keep])
  order = [l for g in groups for l in g if l in present]
  perm = [present.index(l) for l in order]
  if perm != list(range(len(perm))):
    x = jax.lax.transpose(x, perm)
  full = []          # the labels of the broadcast result, in order
  for group in groups:
    if any(l in present for l in group):
      full += list(group)
  full_shape = [sizes[l] for l in full]
  if list(x.shape) != full_shape:
    x = jax.lax.broadcast_in_dim(x, full_shape, [full.index(l) for l in order])
  target = [math.prod(sizes[l] for l in g) if any(l in present for l in g) else 1
            for g in groups]
  if list(x.shape) != target:
    x = jnp.reshape(x, target)
  return x


def unarrange(x, groups, out_labels, out_shape, sizes):
  """Inverse of `arrange` for an array with every group's labels: to `out_labels` order."""
  flat = [l for g in groups for l in g]
  x = jnp.reshape(x, [sizes[l] for l in flat]) if list(x.shape) != [sizes[l] for l in flat] else x
  wanted = [l for l in out_labels if l is not None and l in flat]
  missing = [l for l in flat if l not in wanted]
  extra = [l for l in out_labels if l is not None and l not in flat]
  if any(sizes[l] != 1 for l in missing + extra):
    raise AssertionError(f"kernel output and program output disagree on {missing + extra}")
  x = jnp.reshape(x, [sizes[l] for l in flat if l in wanted]) if missing else x
  present = [l for l in flat if l in wanted]
  perm = [present.index(l) for l in wanted]
  if perm != list(range(len(perm))):
    x = jax.lax.transpose(x, perm)
  if tuple(x.shape) != tuple(out_shape):
    x = jnp.reshape(x, out_shape)
  return x
