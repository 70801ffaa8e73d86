"""Reading a boolean mask symbolically: which (query t, key s) pairs does it keep?

A mask built from iotas (`jnp.tril`, `arange(T)[:, None] >= arange(S)`, the window and padding
masks of `jax.nn.dot_product_attention`) is a conjunction of linear inequalities between axis
indices. `keep_of` evaluates the mask's defining subgraph over a small abstract domain:

  Lin    an integer affine function of axis indices        (iota, arange constants, + - *)
  LinT   Lin plus or minus a runtime tensor                 (arange(S) < lengths[:, None])
  Ind    a boolean used as a 0/1 number                     (mask.astype(f32), then != 0)
  Pred   a conjunction of atoms                             (comparisons, &, ~, where)

Atoms are `Le(expr)` (expr <= 0, expr a Lin or LinT) and `Tensor(value)` (an opaque boolean
array, kept as a mask operand). `classify` turns a conjunction into the kernel's vocabulary:
a band lo <= s - t <= hi (causal, sliding window), static or per-batch key/query lengths, and
mask tensors. Anything outside the domain becomes a `Tensor` atom of the smallest subexpression
that could not be read, so the answer is always exact; only how much of it is symbolic varies.
Axes are named by labels: the caller gives each dimension of the scores a label.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash.rewrite import compat
from jax_flash.rewrite.graph import Graph, Value
from jax_flash.rewrite.operands import unit_reshape_labels

# Above this many elements a constant mask is not evaluated at trace time to look for a band.
MAX_CONCRETE_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class Lin:
  """sum(coeff * index(label)) + const, over integer axis indices."""
  coeffs: tuple = ()
  const: int = 0

  @staticmethod
  def of(label_coeffs: dict, const: int = 0) -> "Lin":
    return Lin(tuple(sorted((k, c) for k, c in label_coeffs.items() if c != 0)), const)

  def as_dict(self) -> dict:
    return dict(self.coeffs)

  def plus(self, other: "Lin", sign: int = 1) -> "Lin":
    merged = self.as_dict()
    for k, c in other.coeffs:
      merged[k] = merged.get(k, 0) + sign * c
    return Lin.of(merged, self.const + sign * other.const)

  def times(self, k: int) -> "Lin":
    return Lin.of({l: c * k for l, c in self.coeffs}, self.const * k)

  @property
  def labels(self) -> frozenset:
    return frozenset(l for l, _ in self.coeffs)


@dataclasses.dataclass(frozen=True)
class Opaque:
  """A runtime tensor, indexed by the labels of its dimensions (None: a size-1 dim)."""
  value: Value
  labels: tuple

  def __hash__(self):
    return hash((id(self.value), self.labels))

  def __eq__(self, other):
    return isinstance(other, Opaque) and other.value is self.value and other.labels == self.labels


@dataclasses.dataclass(frozen=True)
class LinT:
  lin: Lin
  tensor: Opaque
  sign: int


@dataclasses.dataclass(frozen=True)
class Le:
  """expr <= 0, expr a Lin or a LinT."""
  expr: object


@dataclasses.dataclass(frozen=True)
class Tensor:
  tensor: Opaque
  negated: bool = False


@dataclasses.dataclass(frozen=True)
class Pred:
  atoms: frozenset = frozenset()
  false: bool = False

  def conj(self, other: "Pred") -> "Pred":
    if self.false or other.false:
      return FALSE
    return Pred(self.atoms | other.atoms)


@dataclasses.dataclass(frozen=True)
class Ind:
  pred: Pred


TRUE = Pred()
FALSE = Pred(false=True)


def _negate(pred: Pred):
  if pred.false:
    return TRUE
  if not pred.atoms:
    return FALSE
  if len(pred.atoms) != 1:
    return None                       # a disjunction: outside the domain
  (atom,) = pred.atoms
  if isinstance(atom, Le):            # not (x <= 0)  <=>  -x + 1 <= 0 over the integers
    return Pred(frozenset({Le(_shift(_flip(atom.expr), 1))}))
  return Pred(frozenset({Tensor(atom.tensor, not atom.negated)}))


class MaskReader:
  """Evaluates mask subgraphs of one Graph over the symbolic domain (memoized)."""

  def __init__(self, graph: Graph):
    self.graph = graph
    self._memo: dict = {}
    self._concrete: dict = {}

  def keep(self, value: Value, labels: tuple, negated: bool = False) -> Pred:
    """The predicate `value` (or its negation) as a Pred; never fails (falls back to Tensor)."""
    sym = self.sym(value, labels)
    pred = sym if isinstance(sym, Pred) else None
    if pred is not None and negated:
      pred = _negate(pred)
    if pred is None:
      return Pred(frozenset({Tensor(Opaque(value, labels), negated)}))
    return pred

  def sym(self, value: Value, labels: tuple):
    key = (id(value), labels)
    if key not in self._memo:
      result = self._sym(value, labels)
      if result is None:
        result = self._opaque(value, labels)
      self._memo[key] = result
    return self._memo[key]

  def _opaque(self, value: Value, labels: tuple):
    if np.dtype(value.dtype) == np.bool_:
      return Pred(frozenset({Tensor(Opaque(value, labels))}))
    return Opaque(value, labels)

  def _sym(self, value: Value, labels: tuple):
    if value.is_const:
      array = value.concrete(MAX_CONCRETE_ELEMENTS)
      return None if array is None else self._constant(value, array, labels)
    node = value.producer
    if node is None:
      return None
    rule = _RULES.get(node.prim)
    return None if rule is None else rule(self, node, labels)

  def _constant(self, value: Value, array, labels: tuple):
    if array.dtype == np.bool_ and array.size >= 1 and np.all(array == array.reshape(-1)[0]):
      return TRUE if bool(array.reshape(-1)[0]) else FALSE
    if not jnp.issubdtype(array.dtype, jnp.number):
      return None
    scalar = self.graph.scalar(value)
    if scalar is not None:
      return Lin(const=int(scalar)) if float(scalar).is_integer() else None
    varying = [i for i, d in enumerate(array.shape) if d > 1]
    if len(varying) != 1 or labels[varying[0]] is None:
      return None
    line = array.reshape(-1)
    if np.all(line == line[0] + np.arange(line.size)) and float(line[0]).is_integer():
      return Lin.of({labels[varying[0]]: 1}, int(line[0]))
    return None

  def concrete(self, value: Value):
    """The numpy value of `value` when the graph computes it from constants alone."""
    key = id(value)
    if key not in self._concrete:
      self._concrete[key] = self._evaluate(value)
    return self._concrete[key]

  def _evaluate(self, value: Value):
    if value.is_const:
      return value.concrete(MAX_CONCRETE_ELEMENTS)
    node = value.producer
    if (node is None or node.eqn.effects or any(True for _ in compat.jaxpr_params(node.params))
        or math.prod(value.shape) > MAX_CONCRETE_ELEMENTS or len(node.outputs) != 1):
      return None
    inputs = [self.concrete(x) for x in node.inputs]
    if any(x is None for x in inputs):
      return None
    with jax.ensure_compile_time_eval():
      return np.asarray(compat.bind(node.eqn.primitive, node.params, inputs))


# ---- transfer rules: node -> symbolic value of its (single) output, given output labels ----

def _map_broadcast(reader, node, labels):
  x = node.inputs[0]
  out_shape = node.outputs[0].shape
  dims = node.params["broadcast_dimensions"]
  in_labels = tuple(labels[d] if x.shape[i] == out_shape[d] else None for i, d in enumerate(dims))
  return reader.sym(x, in_labels)


def _map_reshape(reader, node, labels):
  x = node.inputs[0]
  in_labels = unit_reshape_labels(x.shape, node.outputs[0].shape, labels)
  return None if in_labels is None else reader.sym(x, in_labels)


def _map_transpose(reader, node, labels):
  perm = node.params["permutation"]
  in_labels = [None] * len(perm)
  for out_dim, in_dim in enumerate(perm):
    in_labels[in_dim] = labels[out_dim]
  return reader.sym(node.inputs[0], tuple(in_labels))


def _iota(reader, node, labels):
  label = labels[node.params["dimension"]]
  return Lin() if label is None else Lin.of({label: 1})


def operand_labels(shape, labels, out_shape) -> tuple:
  """Labels of an elementwise operand: lax broadcasts rank-0 operands and size-1 dims."""
  if len(shape) != len(out_shape):
    return (None,) * len(shape)
  return tuple(l if d == o else None for l, d, o in zip(labels, shape, out_shape))


def _operands(reader, node, labels):
  out_shape = node.outputs[0].shape
  return [reader.sym(x, operand_labels(x.shape, labels, out_shape)) for x in node.inputs]


def _as_number(sym):
  if isinstance(sym, Pred) and not sym.atoms:
    return Lin(const=0 if sym.false else 1)
  return sym


def _combine(a, b, sign: int):
  """a + sign * b as Lin or LinT (at most one tensor term), or None outside the domain."""
  if isinstance(a, Lin) and isinstance(b, Lin):
    return a.plus(b, sign)
  if isinstance(a, Lin) and isinstance(b, Opaque):
    return LinT(a, b, sign)
  if isinstance(a, Opaque) and isinstance(b, Lin):
    return LinT(b.times(sign), a, 1)
  if isinstance(a, LinT) and isinstance(b, Lin):
    return LinT(a.lin.plus(b, sign), a.tensor, a.sign)
  if isinstance(a, Lin) and isinstance(b, LinT):
    return LinT(a.plus(b.lin, sign), b.tensor, sign * b.sign)
  return None


def _add_like(sign):
  def rule(reader, node, labels):
    a, b = (_as_number(s) for s in _operands(reader, node, labels))
    return _combine(a, b, sign)
  return rule


def _mul(reader, node, labels):
  a, b = _operands(reader, node, labels)
  if isinstance(a, Ind) and isinstance(b, Ind):
    return Ind(a.pred.conj(b.pred))
  a, b = _as_number(a), _as_number(b)
  if isinstance(a, Lin) and isinstance(b, Lin):
    if not a.coeffs:
      return b.times(a.const)
    if not b.coeffs:
      return a.times(b.const)
  return None


def _neg(reader, node, labels):
  a = _as_number(reader.sym(node.inputs[0], labels))
  return a.times(-1) if isinstance(a, Lin) else None


def _le_zero(diff) -> Pred:
  if isinstance(diff, Lin) and not diff.coeffs:
    return TRUE if diff.const <= 0 else FALSE
  return Pred(frozenset({Le(diff)}))


def _shift(diff, k: int):
  return _combine(diff, Lin(const=k), 1)


def _flip(diff):
  return diff.times(-1) if isinstance(diff, Lin) else LinT(diff.lin.times(-1), diff.tensor,
                                                           -diff.sign)


def _compare(kind):
  def rule(reader, node, labels):
    a, b = _operands(reader, node, labels)
    if kind in ("ne", "eq"):
      indicator, other = (a, b) if isinstance(a, Ind) else (b, a)
      if isinstance(indicator, Ind) and _as_number(other) == Lin(const=0):
        return indicator.pred if kind == "ne" else _negate(indicator.pred)
    a, b = _as_number(a), _as_number(b)
    diff = _combine(a, b, -1)
    if diff is None:
      return None
    if kind == "le":
      return _le_zero(diff)
    if kind == "lt":
      return _le_zero(_shift(diff, 1))
    if kind == "ge":
      return _le_zero(_flip(diff))
    if kind == "gt":
      return _le_zero(_shift(_flip(diff), 1))
    if kind == "eq":
      return _le_zero(diff).conj(_le_zero(_flip(diff)))
    return None
  return rule


def _and(reader, node, labels):
  a, b = _operands(reader, node, labels)
  if isinstance(a, Pred) and isinstance(b, Pred):
    return a.conj(b)
  return None


def _or(reader, node, labels):
  a, b = _operands(reader, node, labels)
  if not (isinstance(a, Pred) and isinstance(b, Pred)):
    return None
  for x, y in ((a, b), (b, a)):
    if x.false:
      return y
    if not x.atoms:
      return TRUE
  return None


def _not(reader, node, labels):
  a = reader.sym(node.inputs[0], labels)
  return _negate(a) if isinstance(a, Pred) else None


def _select(reader, node, labels):
  if len(node.inputs) != 3:
    return None
  pred, case_false, case_true = _operands(reader, node, labels)
  if not all(isinstance(x, Pred) for x in (pred, case_false, case_true)):
    return None
  if case_false.false:                # where(p, x, False) = p & x
    return pred.conj(case_true)
  if case_true.false:                 # where(p, False, x) = ~p & x
    negated = _negate(pred)
    return None if negated is None else negated.conj(case_false)
  if not case_false.atoms and not case_true.atoms:
    return TRUE
  return None


def _convert(reader, node, labels):
  x = node.inputs[0]
  inner = reader.sym(x, labels)
  src, dst = np.dtype(x.dtype), np.dtype(node.params["new_dtype"])
  if src == np.bool_ and dst != np.bool_:
    return Ind(inner) if isinstance(inner, Pred) else None
  if dst == np.bool_:
    return None
  if isinstance(inner, (Lin, LinT)) and np.issubdtype(src, np.integer):
    return inner
  return None


_RULES = {
    "broadcast_in_dim": _map_broadcast,
    "reshape": _map_reshape,
    "squeeze": _map_reshape,
    "expand_dims": _map_reshape,
    "transpose": _map_transpose,
    "iota": _iota,
    "add": _add_like(1),
    "sub": _add_like(-1),
    "mul": _mul,
    "neg": _neg,
    "lt": _compare("lt"), "le": _compare("le"), "gt": _compare("gt"), "ge": _compare("ge"),
    "eq": _compare("eq"), "ne": _compare("ne"),
    "and": _and, "or": _or, "not": _not,
    "select_n": _select,
    "convert_element_type": _convert,
    "copy": lambda reader, node, labels: reader.sym(node.inputs[0], labels),
    "copy_p": lambda reader, node, labels: reader.sym(node.inputs[0], labels),
}


# ---- classification: a conjunction -> the kernel's mask vocabulary ----

@dataclasses.dataclass
class Keep:
  """What one mask keeps, in the kernel's terms (s: the key label, query: a query label)."""
  query: str | None = None                  # the query label the band / query bounds refer to
  lo: float = -math.inf                     # lo <= s - t
  hi: float = math.inf                      # s - t <= hi
  kv_bound: float = math.inf                # s < kv_bound
  q_bound: float = math.inf                 # t < q_bound
  kv_lengths: list = dataclasses.field(default_factory=list)   # (Opaque, offset): s < T + off
  q_lengths: list = dataclasses.field(default_factory=list)    # (Opaque, offset): t < T + off
  tensors: list = dataclasses.field(default_factory=list)      # Tensor atoms left as masks

  def merge(self, other: "Keep") -> bool:
    """Intersect with `other`; False when they refer to different query labels."""
    if other.query is not None:
      if self.query not in (None, other.query):
        return False
      self.query = other.query
    self.lo, self.hi = max(self.lo, other.lo), min(self.hi, other.hi)
    self.kv_bound, self.q_bound = min(self.kv_bound, other.kv_bound), min(self.q_bound,
                                                                          other.q_bound)
    self.kv_lengths += other.kv_lengths
    self.q_lengths += other.q_lengths
    self.tensors += other.tensors
    return True


def classify(reader: MaskReader, pred: Pred, key_label: str, query_labels) -> Keep | None:
  """The Keep of a conjunction, or None when an atom is outside the kernel's vocabulary."""
  if pred.false:
    return None
  keep = Keep()
  for atom in pred.atoms:
    part = _classify_atom(reader, atom, key_label, frozenset(query_labels))
    if part is None or not keep.merge(part):
      return None
  return keep


def _classify_atom(reader, atom, key_label, query_labels) -> Keep | None:
  if isinstance(atom, Tensor):
    return _classify_tensor(reader, atom, key_label, query_labels)
  if isinstance(atom.expr, Lin):
    return _classify_linear(atom.expr, key_label, query_labels)
  return _classify_length(atom.expr, key_label, query_labels)


def _classify_linear(lin: Lin, key_label, query_labels) -> Keep | None:
  """lin <= 0 with lin = a*s + b*t + c."""
  coeffs = lin.as_dict()
  a = coeffs.pop(key_label, 0)
  if len(coeffs) > 1 or (coeffs and next(iter(coeffs)) not in query_labels):
    return None
  query, b = next(iter(coeffs.items())) if coeffs else (None, 0)
  c = lin.const
  if a and b:
    if a != -b:
      return None
    if a > 0:                                # s - t <= -c / a
      return Keep(query=query, hi=math.floor(-c / a))
    return Keep(query=query, lo=math.ceil(c / -a))     # s - t >= c / -a
  if a:                                       # a*s + c <= 0
    return Keep(kv_bound=math.floor(-c / a) + 1) if a > 0 else _lower_bound(-c / a)
  if b:
    return Keep(query=query, q_bound=math.floor(-c / b) + 1) if b > 0 else _lower_bound(-c / b)
  return Keep() if c <= 0 else None


def _lower_bound(bound: float) -> Keep | None:
  """index >= bound: always true when bound <= 0, else outside the vocabulary."""
  return Keep() if bound <= 0 else None


def _classify_length(expr: LinT, key_label, query_labels) -> Keep | None:
  """a*index + c + sign*T <= 0 with a = 1, sign = -1: index < T + (1 - c)."""
  coeffs = expr.lin.as_dict()
  if len(coeffs) != 1 or expr.sign != -1:
    return None
  (label, a), = coeffs.items()
  if a != 1:
    return None
  offset = 1 - expr.lin.const
  if label == key_label:
    return Keep(kv_lengths=[(expr.tensor, offset)])
  if label in query_labels:
    return Keep(query=label, q_lengths=[(expr.tensor, offset)])
  return None


def _classify_tensor(reader, atom: Tensor, key_label, query_labels) -> Keep:
  """A constant boolean tensor that is a band in (s - t) becomes the band, else a mask."""
  array = reader.concrete(atom.tensor.value)
  if array is not None:
    band = _band_of(array ^ atom.negated, atom.tensor.labels, key_label, query_labels)
    if band is not None:
      return band
  return Keep(tensors=[atom])


def _band_of(array, labels, key_label, query_labels) -> Keep | None:
  """Keep for a concrete mask equal to lo <= s - t <= hi (or a prefix of s or t), else None."""
  array = np.asarray(array, bool)
  for axis in reversed(range(array.ndim)):
    if labels[axis] in (key_label, *query_labels) and array.shape[axis] > 1:
      continue
    if not np.all(array == array.take([0], axis=axis)):
      return None
  kept = [(l, d) for l, d in zip(labels, array.shape) if l in (key_label, *query_labels) and d > 1]
  index = tuple(slice(None) if (l, d) in kept else 0 for l, d in zip(labels, array.shape))
  matrix = array[index]
  names = [l for l, _ in kept]
  if len(names) > 2 or (len(names) == 2 and key_label not in names):
    return None
  if not names:
    return Keep() if bool(matrix) else None
  if names == [key_label]:
    return _prefix(matrix, lambda n: Keep(kv_bound=n))
  if key_label not in names:
    return _prefix(matrix, lambda n: Keep(query=names[0], q_bound=n))
  if names[0] == key_label:
    matrix = matrix.T
  query = names[0] if names[1] == key_label else names[1]
  t = np.arange(matrix.shape[0])[:, None]
  s = np.arange(matrix.shape[1])[None, :]
  if not matrix.any():
    return None
  lo, hi = int((s - t)[matrix].min()), int((s - t)[matrix].max())
  if not np.array_equal(matrix, (s - t >= lo) & (s - t <= hi)):
    return None
  return Keep(query=query, lo=lo, hi=hi)


def _prefix(line, make) -> Keep | None:
  n = int(line.sum())
  return make(n) if n > 0 and line[:n].all() else None
