"""A flat dataflow view of a ClosedJaxpr, seen through plain `jit` calls.

The matcher walks producers and users of values; jnp wraps small helpers (`where`, `tril`) in
plain jit calls, so an attention subgraph usually crosses several call boundaries. `build`
expands every plain jit call in place: the call's inputs and outputs and the callee's invars and
outvars become the same `Value` objects, so a walk never notices the boundary. The original
nesting is kept (`Level`) because the emitter re-emits untouched calls as they were.

Every other equation, including higher-order ones (scan, cond, while, remat, custom_jvp/vjp,
jit with shardings), is one opaque `Node`; the pass rewrites their bodies separately.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash.rewrite import compat


class Value:
  """One array in the flattened program (a jaxpr Var, Literal or constant, or a call alias)."""
  __slots__ = ("aval", "const", "producer", "users", "is_output", "__weakref__")

  def __init__(self, aval, producer=None, const=None):
    self.aval = aval
    self.const = const            # concrete value for literals and closed-over constants
    self.producer = producer      # the Node that computes it (None for inputs and constants)
    self.users: list[Node] = []
    self.is_output = False

  @property
  def is_const(self) -> bool:
    return self.const is not None

  def concrete(self, max_size: int):
    """The constant as a numpy array when it is known at trace time (not a tracer closed over
    from an outer transformation) and has at most `max_size` elements; else None."""
    if self.const is None or isinstance(self.const, jax.core.Tracer):
      return None
    if math.prod(self.shape) > max_size:
      return None
    return np.asarray(self.const)

  @property
  def shape(self):
    return self.aval.shape

  @property
  def dtype(self):
    return self.aval.dtype

  def __repr__(self):
    return f"Value({self.aval.str_short()})"


class Node:
  """One primitive application; `eqn` is the original equation (params, effects, context)."""
  __slots__ = ("eqn", "inputs", "outputs", "level", "index")

  def __init__(self, eqn, inputs, level, index):
    self.eqn = eqn
    self.inputs: list[Value] = inputs
    self.outputs: list[Value] = []
    self.level = level
    self.index = index

  @property
  def prim(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self) -> dict:
    return self.eqn.params

  def __repr__(self):
    return f"Node({self.prim})"


class Level:
  """One jaxpr body in the nesting of plain jit calls (the root is the traced function)."""

  def __init__(self, jaxpr, parent, call_eqn=None):
    self.jaxpr = jaxpr
    self.parent = parent
    self.call_eqn = call_eqn                 # the jit equation in the parent that calls it
    self.varmap: dict = {}
    self.nodes: dict[int, Node] = {}         # equation index -> Node (non-call equations)
    self.children: dict[int, Level] = {}     # equation index -> Level (plain jit calls)
    self.call_inputs: list[Value] = []
    self.call_outputs: list[Value] = []

  def read(self, atom) -> Value:
    if isinstance(atom, compat.Literal):
      return Value(atom.aval, const=np.asarray(atom.val))
    return self.varmap[atom]

  def ancestors(self):
    level = self
    while level is not None:
      yield level
      level = level.parent


class Graph:
  """The flattened view of one ClosedJaxpr: nodes in program order, plus the nesting."""

  def __init__(self, closed_jaxpr):
    self.closed_jaxpr = closed_jaxpr
    self.nodes: list[Node] = []
    inputs = [Value(v.aval) for v in closed_jaxpr.jaxpr.invars]
    self.root = self._build(closed_jaxpr.jaxpr, closed_jaxpr.consts, inputs, None, None)
    self.inputs = inputs
    self.outputs = [self.root.read(v) for v in closed_jaxpr.jaxpr.outvars]
    for value in self.outputs:
      value.is_output = True
    for node in self.nodes:
      for value in node.inputs:
        value.users.append(node)
    self._scalar_cache: dict[int, float | None] = {}

  def _build(self, jaxpr, consts, inputs, parent, call_eqn) -> Level:
    level = Level(jaxpr, parent, call_eqn)
    level.call_inputs = list(inputs)
    for var, const in zip(jaxpr.constvars, consts):
      level.varmap[var] = Value(var.aval, const=const)
    for var, value in zip(jaxpr.invars, inputs):
      level.varmap[var] = value
    for index, eqn in enumerate(jaxpr.eqns):
      ins = [level.read(a) for a in eqn.invars]
      if eqn.primitive.name in compat.JIT_NAMES and compat.is_plain_jit(eqn.params):
        callee = eqn.params["jaxpr"]
        child = self._build(callee.jaxpr, callee.consts, ins, level, eqn)
        level.children[index] = child
        outs = [child.read(v) for v in callee.jaxpr.outvars]
      else:
        node = Node(eqn, ins, level, index)
        outs = [Value(v.aval, producer=node) for v in eqn.outvars]
        node.outputs = outs
        level.nodes[index] = node
        self.nodes.append(node)
      for var, value in zip(eqn.outvars, outs):
        level.varmap[var] = value
    level.call_outputs = [level.read(v) for v in jaxpr.outvars]
    return level

  def scalar(self, value: Value) -> float | None:
    """The value as a Python float when it is one compile-time constant (a literal, a uniform
    constant array, or arithmetic on those such as `1 / sqrt(64.)`), else None."""
    key = id(value)
    if key not in self._scalar_cache:
      self._scalar_cache[key] = _scalar(self, value)
    return self._scalar_cache[key]


# Constant arrays larger than this are not scanned for being one repeated scalar.
_MAX_UNIFORM_CHECK = 1 << 12

_SCALAR_UNARY = {
    "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "exp": np.exp, "log": np.log,
    "neg": np.negative, "abs": np.abs, "tanh": np.tanh,
}
_SCALAR_BINARY = {
    "mul": np.multiply, "div": np.divide, "add": np.add, "sub": np.subtract,
    "max": np.maximum, "min": np.minimum, "pow": np.power,
}
_SCALAR_SHAPE_OPS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                               "transpose", "copy", "copy_p"})


def _scalar(graph: Graph, value: Value) -> float | None:
  if value.is_const:
    array = value.concrete(_MAX_UNIFORM_CHECK)
    if array is None or array.size == 0 or not jnp.issubdtype(array.dtype, jnp.number):
      return None
    first = array.reshape(-1)[0]
    if array.size > 1 and not np.all(array == first):
      return None
    return float(first)
  node = value.producer
  if node is None:
    return None
  prim = node.prim
  if prim in _SCALAR_SHAPE_OPS:
    return graph.scalar(node.inputs[0])
  if prim == "convert_element_type":
    inner = graph.scalar(node.inputs[0])
    return None if inner is None else _round_to(inner, value.dtype)
  with np.errstate(all="ignore"):
    if prim in _SCALAR_UNARY:
      inner = graph.scalar(node.inputs[0])
      return None if inner is None else _round_to(_SCALAR_UNARY[prim](inner), value.dtype)
    if prim == "integer_pow":
      inner = graph.scalar(node.inputs[0])
      return None if inner is None else _round_to(inner ** node.params["y"], value.dtype)
    if prim in _SCALAR_BINARY:
      a, b = (graph.scalar(x) for x in node.inputs)
      if a is None or b is None:
        return None
      return _round_to(_SCALAR_BINARY[prim](np.float64(a), np.float64(b)), value.dtype)
  return None


def _round_to(x, dtype) -> float | None:
  """x as the nearest value of `dtype` (the graph computes in that dtype)."""
  with np.errstate(all="ignore"):
    try:
      return float(np.asarray(x, dtype=np.float64).astype(dtype))
    except (OverflowError, ValueError):
      return None
