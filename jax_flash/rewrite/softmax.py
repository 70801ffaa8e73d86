"""Finding softmaxes in a Graph: the anchors from which attention sites are matched.

Two spellings reach a jaxpr:
  written out (also what `jax.nn.softmax` emits by default):
      m = stop_gradient?(max(-inf?, reduce_max(x, axis)))      (optional: exp(x) / sum is fine)
      e = exp(x - broadcast(m));  p = e / broadcast(reduce_sum(e, axis))   (or e * (1 / sum))
    with 16-bit x, jax.nn.softmax sums in float32: reduce_sum(convert(e)), converted back before
    the division; such float-to-float casts around the sum are accepted (the fused kernel sums
    in float32 throughout).
  `custom_jvp_call` whose body is the above (`jax.nn.softmax` under jax_softmax_custom_jvp).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jax_flash.rewrite.graph import Graph, Node, Value

_KEEPDIMS_OPS = frozenset({"broadcast_in_dim", "reshape", "expand_dims"})
_CAST = "convert_element_type"


@dataclasses.dataclass
class Softmax:
  logits: Value          # x
  probs: Value           # p
  axis: int              # the dimension of x that is normalized
  nodes: list            # every node of the softmax (they become dead once fused)


def _through(value: Value, prims) -> tuple[Value, list]:
  """Walk producers while they are in `prims`; returns the first other value and the nodes."""
  nodes = []
  while value.producer is not None and value.producer.prim in prims:
    nodes.append(value.producer)
    value = value.producer.inputs[0]
  return value, nodes


def _reduction(value: Value, prim: str):
  """(input, axis, nodes) when `value` is a keepdims-broadcast of a one-axis `prim`."""
  value, nodes = _through(value, _KEEPDIMS_OPS)
  node = value.producer
  if node is None or node.prim != prim or len(node.params["axes"]) != 1:
    return None
  return node.inputs[0], int(node.params["axes"][0]), nodes + [node]


def _denominator(graph: Graph, node: Node):
  """(numerator, sum-broadcast) of p = e / s or p = e * (1 / s), else None."""
  a, b = node.inputs
  if node.prim == "div":
    return a, b
  if node.prim != "mul":
    return None
  for num, recip in ((a, b), (b, a)):
    inner, nodes = _through(recip, _KEEPDIMS_OPS)
    producer = inner.producer
    if producer is None:
      continue
    if producer.prim == "div" and graph.scalar(producer.inputs[0]) == 1.0:
      return num, recip
    if producer.prim == "integer_pow" and producer.params["y"] == -1:
      return num, recip
  return None


def _float_casts(value: Value) -> tuple[Value, list]:
  """Walk producers through float-to-float convert_element_type; the first other value."""
  nodes = []
  while (value.producer is not None and value.producer.prim == _CAST
         and jnp.issubdtype(value.dtype, jnp.floating)
         and jnp.issubdtype(value.producer.inputs[0].dtype, jnp.floating)):
    nodes.append(value.producer)
    value = value.producer.inputs[0]
  return value, nodes


def _sum_of(graph: Graph, denominator: Value):
  """(e, axis, nodes) for denominator = keepdims(reduce_sum(e)) or its reciprocal, float
  casts allowed around the sum."""
  value, nodes = _through(denominator, _KEEPDIMS_OPS)
  value, casts = _float_casts(value)
  value, more_keepdims = _through(value, _KEEPDIMS_OPS)
  nodes += casts + more_keepdims
  producer = value.producer
  if producer is not None and producer.prim == "div" and graph.scalar(producer.inputs[0]) == 1.0:
    nodes.append(producer)
    value = producer.inputs[1]
  elif producer is not None and producer.prim == "integer_pow" and producer.params["y"] == -1:
    nodes.append(producer)
    value = producer.inputs[0]
  found = _reduction(value, "reduce_sum")
  if found is None:
    return None
  e, axis, more = found
  e, casts = _float_casts(e)
  return e, axis, nodes + more + casts


def _max_shift(graph: Graph, shift: Value, x: Value, axis: int):
  """Nodes of shift = keepdims(stop_gradient?(max(-inf?, reduce_max(x, axis)))), transposes
  allowed anywhere in between; None when the shift is not the row max of x."""
  nodes, value = [], shift
  while value.producer is not None:
    node = value.producer
    if node.prim in _KEEPDIMS_OPS or node.prim in ("stop_gradient", "transpose"):
      value = node.inputs[0]
    elif node.prim == "max":
      a, b = node.inputs
      initial, value = (a, b) if graph.scalar(a) is not None else (b, a)
      if graph.scalar(initial) != -math.inf:
        return None
    elif node.prim == "reduce_max" and len(node.params["axes"]) == 1:
      if int(node.params["axes"][0]) != _axis_in(node.inputs[0], x, axis):
        return None
      return nodes + [node]
    else:
      return None
    nodes.append(node)
  return None


def _axis_in(source: Value, x: Value, axis: int) -> int | None:
  """The axis of `source` that is `axis` of x, when x is source or a transpose of it.

  (The shift only has to be constant along the softmax axis for exp(x - shift) / sum to be the
  softmax; requiring it to be the row max keeps the numerics of the original too.)"""
  if source is x:
    return axis
  node = x.producer
  if node is not None and node.prim == "transpose" and node.inputs[0] is source:
    return node.params["permutation"][axis]
  return None


def match_written(graph: Graph, node: Node) -> Softmax | None:
  """The softmax whose final division (or multiplication) is `node`, if it is one."""
  parts = _denominator(graph, node)
  if parts is None:
    return None
  numerator, denominator = parts
  found = _sum_of(graph, denominator)
  if found is None or found[0] is not numerator:
    return None
  _, axis, sum_nodes = found
  exp = numerator.producer
  if exp is None or exp.prim != "exp":
    return None
  nodes = [node, exp] + sum_nodes
  shifted = exp.inputs[0]
  sub = shifted.producer
  if sub is not None and sub.prim == "sub":
    x, shift = sub.inputs
    if x.shape == shifted.shape:
      max_nodes = _max_shift(graph, shift, x, axis)
      if max_nodes is not None:
        return Softmax(x, node.outputs[0], axis, nodes + [sub] + max_nodes)
  return Softmax(shifted, node.outputs[0], axis, nodes)


def match_custom_jvp(graph: Graph, node: Node) -> Softmax | None:
  """A `custom_jvp_call` whose body is a softmax of its first operand (jax.nn.softmax)."""
  body = node.params.get("call_jaxpr")
  if body is None or len(node.outputs) != 1 or not node.inputs:
    return None
  inner = Graph(body)
  # Operands after the first (jax.nn.softmax's `initial`) are seen as the constants they are.
  for inner_input, outer_input in zip(inner.inputs[1:], node.inputs[1:]):
    value = graph.scalar(outer_input)
    if value is None:
      return None
    inner_input.const = np.asarray(value, inner_input.dtype)
  out = inner.outputs[0]
  if out.producer is None:
    return None
  found = match_written(inner, out.producer)
  if found is None or found.logits is not inner.inputs[0]:
    return None
  return Softmax(node.inputs[0], node.outputs[0], found.axis, [node])


def find_softmaxes(graph: Graph) -> list[Softmax]:
  found = []
  for node in graph.nodes:
    if node.prim in ("div", "mul"):
      softmax = match_written(graph, node)
    elif node.prim == "custom_jvp_call":
      softmax = match_custom_jvp(graph, node)
    else:
      continue
    if softmax is not None:
      found.append(softmax)
  return found
