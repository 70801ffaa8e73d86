"""Matching one attention site around a softmax, or saying in one sentence why it is not one.

From a softmax p = softmax(x, axis) the matcher walks
  forward:   p -> (convert | transpose)* -> dot_general with V               (the PV product)
  backward:  x -> (convert | transpose | scale | softcap | + bias | where(mask, ., fill))*
                -> dot_general of Q and K                                    (the QK product)
and then checks that the two products and the softmax agree on the axes: the softmax normalizes
the key axis, which the PV product contracts; the PV product batches only over axes the QK
product batches over or keeps for queries (never the query axis itself). Every intermediate
(scores, logits, probabilities) must have no user outside the site. The result, a `Site`, knows
everything the emitter needs and everything `explain` reports.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jax_flash.rewrite import compat, masks, operands
from jax_flash.rewrite.graph import Graph, Node, Value
from jax_flash.rewrite.masks import Keep, MaskReader, Opaque, Tensor
from jax_flash.rewrite.softmax import Softmax


class NoMatch(Exception):
  """Not an attention site the kernel can replace; the message says why (one sentence)."""


@dataclasses.dataclass
class MaskSource:
  """One mask in the program: a `where` on the scores, or an additive -inf/0 bias."""
  pred: Value
  labels: tuple
  negated: bool           # keep where pred is False
  fill: float
  keep: Keep | None = None


@dataclasses.dataclass
class Site:
  softmax: Softmax
  qk: Node
  pv: Node
  region: set                    # nodes replaced by the kernel call
  q: operands.Operand
  k: operands.Operand
  v: operands.Operand
  sizes: dict                    # label -> size
  query: str | None              # the query (T) label
  key: str                       # the key (S) label
  head: str                      # the contracted head dim of q and k
  value_head: str                # the free dim of v
  batch_group: list              # labels flattened into the kernel's B
  kv_heads: list                 # labels flattened into the kernel's K
  group_heads: list              # labels only queries vary along (GQA groups)
  out_labels: tuple              # labels of the PV product's output dims
  out_shape: tuple
  out_dtype: object
  dtype: object                  # the kernel's q/k/v dtype
  scale: float
  softcap: float | None
  biases: list                   # Operand per additive bias (sign folded into `scale` field)
  mask_sources: list             # MaskSource
  keep: Keep                     # the union of what the masks keep, in kernel terms
  repeat: tuple | None = None    # (label, kv label): K / V hold `label` // groups (jnp.repeat)
  schedule: str = "auto"
  notes: list = dataclasses.field(default_factory=list)


def fill_threshold(dtype) -> float:
  """Fills at or below this are negligible: exp(fill - max) is 0 for any sane row max."""
  return max(-1e9, -0.5 * float(jnp.finfo(dtype).max))


def _depends_on_random(value: Value, budget: int = 64) -> bool:
  seen, stack = set(), [value]
  while stack and budget > 0:
    node = stack.pop().producer
    if node is None or id(node) in seen:
      continue
    seen.add(id(node))
    budget -= 1
    if node.prim in compat.RANDOM_PRIMITIVES:
      return True
    stack.extend(node.inputs)
  return False


def _dot_labels(node: Node):
  """Labels for a dot_general: (lhs labels, rhs labels, out labels, contracted label)."""
  (lc, rc), (lb, rb) = node.params["dimension_numbers"]
  lhs, rhs = node.inputs
  lhs_labels, rhs_labels = [None] * lhs.aval.ndim, [None] * rhs.aval.ndim
  out = []
  for i, (l, r) in enumerate(zip(lb, rb)):
    lhs_labels[l] = rhs_labels[r] = f"b{i}"
    out.append(f"b{i}")
  for i, (l, r) in enumerate(zip(lc, rc)):
    lhs_labels[l] = rhs_labels[r] = f"c{i}"
  for side, labels, name in ((lhs, lhs_labels, "l"), (rhs, rhs_labels, "r")):
    for d in range(side.aval.ndim):
      if labels[d] is None:
        labels[d] = f"{name}{d}"
        out.append(labels[d])
  return tuple(lhs_labels), tuple(rhs_labels), tuple(out), len(lc)


# ---- the probabilities: softmax -> PV product ----

def _dropout_ahead(value: Value, budget: int = 8) -> bool:
  """Whether a few steps downstream of `value` something mixes in random bits (dropout)."""
  frontier, seen = [value], set()
  while frontier and budget > 0:
    current = frontier.pop()
    for user in current.users:
      if id(user) in seen or user.prim == "dot_general":
        continue
      seen.add(id(user))
      budget -= 1
      if any(_depends_on_random(x) for x in user.inputs if x is not current):
        return True
      frontier.extend(user.outputs)
  return False


def _probabilities_to_pv(softmax: Softmax):
  """(pv node, index of p in it, nodes between, permutation of p dims at the product)."""
  value, nodes = softmax.probs, []
  perm = list(range(len(value.shape)))
  while True:
    if value.is_output:
      raise NoMatch("the attention probabilities are an output of the function")
    users = value.users
    if _dropout_ahead(value):
      raise NoMatch("dropout is applied to the attention probabilities (a random mask); the "
                    "fused kernel has no dropout")
    if len(users) != 1:
      names = ", ".join(sorted({u.prim for u in users}))
      raise NoMatch(f"the attention probabilities have {len(users)} users ({names}), not just "
                    "the product with V")
    user = users[0]
    if user.prim == "dot_general":
      return user, user.inputs.index(value), nodes, perm
    if user.prim == "transpose":
      perm = [perm[i] for i in user.params["permutation"]]
    elif user.prim not in ("convert_element_type", "copy", "copy_p"):
      raise NoMatch(f"the attention probabilities feed `{user.prim}`, not a product with V")
    nodes.append(user)
    value = user.outputs[0]


# ---- the logits: QK product -> softmax input ----

@dataclasses.dataclass
class _Op:
  kind: str          # "scale" | "softcap" | "bias" | "mask" | "transpose" | "convert"
  node: Node
  value: float = 1.0
  other: Value | None = None
  negated: bool = False
  extra: list = dataclasses.field(default_factory=list)   # more nodes of the op (softcap)


def _softcap_of(graph: Graph, tanh_out: Value, cap: float):
  """The x of cap * tanh(x / cap), with the inner nodes, else None."""
  tanh = tanh_out.producer
  if tanh is None or tanh.prim != "tanh":
    return None
  inner = tanh.inputs[0].producer
  if inner is None or inner.prim not in ("div", "mul"):
    return None
  found = operands._scalar_factor(graph, inner)
  if found is None or not math.isclose(found[0] * cap, 1.0, rel_tol=1e-6):
    return None
  return found[1], [tanh, inner]


def _walk_logits(graph: Graph, value: Value) -> tuple[Node, list]:
  """(QK dot_general, ops from the softmax input back to it)."""
  node = value.producer
  if node is None:
    raise NoMatch("the softmax input is not computed from a product of two tensors")
  prim = node.prim
  if prim == "dot_general":
    return node, []
  if prim in ("convert_element_type", "copy", "copy_p", "transpose"):
    qk, ops = _walk_logits(graph, node.inputs[0])
    return qk, ops + [_Op("transpose" if prim == "transpose" else "convert", node)]
  if prim in ("mul", "div"):
    return _walk_scale(graph, node)
  if prim in ("add", "sub"):
    return _walk_bias(graph, node)
  if prim == "select_n" and len(node.inputs) == 3:
    return _walk_mask(graph, node)
  raise NoMatch(f"`{prim}` between the QK product and the softmax is not a scale, softcap, "
                "bias or mask")


def _walk_scale(graph, node):
  found = operands._scalar_factor(graph, node)
  if found is None:
    if any(x.shape == () or graph.scalar(x) is None and math.prod(x.shape) == 1
           for x in node.inputs):
      raise NoMatch("the scores are scaled by a value that is not a compile-time constant")
    raise NoMatch(f"the scores are multiplied by a tensor (`{node.prim}`), which is not a "
                  "scale, bias or mask")
  factor, chain = found
  if node.prim == "mul":
    softcap = _softcap_of(graph, chain, factor)
    if softcap is not None:
      inner, extra = softcap
      qk, ops = _walk_logits(graph, inner)
      return qk, ops + [_Op("softcap", node, factor, extra=extra)]
  qk, ops = _walk_logits(graph, chain)
  return qk, ops + [_Op("scale", node, factor)]


def _walk_bias(graph, node):
  a, b = node.inputs
  pairs = ((a, b, 1.0), (b, a, 1.0)) if node.prim == "add" else ((a, b, -1.0),)
  failure = None
  for chain, other, sign in pairs:
    try:
      qk, ops = _walk_logits(graph, chain)
    except NoMatch as e:
      failure = failure or e
      continue
    return qk, ops + [_Op("bias", node, sign, other=other)]
  raise failure


def _walk_mask(graph, node):
  pred, case_false, case_true = node.inputs
  fill_false, fill_true = graph.scalar(case_false), graph.scalar(case_true)
  if fill_false is not None and fill_true is None:
    chain, fill, negated = case_true, fill_false, False     # where(pred, x, fill)
  elif fill_true is not None and fill_false is None:
    chain, fill, negated = case_false, fill_true, True      # where(pred, fill, x)
  else:
    raise NoMatch("a select on the scores does not pick between the scores and a constant fill")
  qk, ops = _walk_logits(graph, chain)
  return qk, ops + [_Op("mask", node, fill, other=pred, negated=negated)]


# ---- the site ----

class Matcher:
  """Matches sites in one Graph (one jaxpr body, plain jit calls flattened)."""

  def __init__(self, graph: Graph, select_schedule):
    self.graph = graph
    self.reader = MaskReader(graph)
    self.select_schedule = select_schedule     # (site) -> schedule name; raises NoMatch

  def match(self, softmax: Softmax) -> Site:
    pv, p_index, p_nodes, p_perm = _probabilities_to_pv(softmax)
    qk, ops = _walk_logits(self.graph, softmax.logits)
    region = {qk, pv, *softmax.nodes, *p_nodes}
    for op in ops:
      region.add(op.node)
      region.update(op.extra)
    site = self._structure(softmax, qk, pv, p_index, p_perm, ops, region)
    self._check_closed(site)
    site.schedule = self.select_schedule(site)
    return site

  # -- axes --

  def _structure(self, softmax, qk, pv, p_index, p_perm, ops, region) -> Site:
    lhs, rhs, x_labels, n_contract = _dot_labels(qk)
    if n_contract != 1:
      raise NoMatch(f"the QK product contracts {n_contract} axes, not one head dim")
    sizes = {}
    for side, labels in ((qk.inputs[0], lhs), (qk.inputs[1], rhs)):
      sizes.update(zip(labels, side.shape))
    fold = _fold_ops(self.graph, ops, x_labels)
    key = fold.labels[softmax.axis]
    if key.startswith("b"):
      raise NoMatch("the softmax normalizes an axis the QK product batches over, not the key "
                    "axis")
    key_side = 0 if key in lhs else 1
    q_labels, k_labels = (rhs, lhs) if key_side == 0 else (lhs, rhs)
    k_free = [l for l in k_labels if l.startswith(("l", "r"))]
    if k_free != [key]:
      raise NoMatch(f"the key operand of the QK product has {len(k_free)} free axes; attention "
                    "needs exactly the key axis")
    head = next(l for l in q_labels if l.startswith("c"))
    query_free = [l for l in q_labels if l.startswith(("l", "r"))]

    p_labels = tuple(fold.labels[i] for i in p_perm)
    v_labels, out_labels = self._pv_labels(pv, p_index, p_labels, key, sizes)
    value_head = next(l for l in v_labels if l.startswith("v"))

    q_op = operands.strip(self.graph, qk.inputs[1 - key_side], q_labels, scales=True)
    k_op = operands.strip(self.graph, qk.inputs[key_side], k_labels, scales=True,
                          broadcasts=True, repeats=True)
    v_op = operands.strip(self.graph, pv.inputs[1 - p_index], v_labels, broadcasts=True,
                          repeats=True)
    if k_op.repeat != v_op.repeat:
      k_op, v_op = k_op.unrepeated or k_op, v_op.unrepeated or v_op

    biases, mask_sources = [], list(fold.masks)
    for other, labels, sign in fold.biases:
      mask = self._additive_mask(other, labels, sign, fold.dtype)
      if mask is not None:
        mask_sources.append(mask)
      else:
        bias = operands.strip(self.graph, other, labels, broadcasts=True)
        bias.scale = sign
        biases.append(bias)

    site = Site(
        softmax=softmax, qk=qk, pv=pv, region=region, q=q_op, k=k_op, v=v_op, sizes=sizes,
        query=None, key=key, head=head, value_head=value_head, batch_group=[], kv_heads=[],
        group_heads=[], out_labels=out_labels, out_shape=tuple(pv.outputs[0].shape),
        out_dtype=pv.outputs[0].dtype, dtype=None,
        scale=fold.scale * q_op.scale * k_op.scale, softcap=fold.softcap, biases=biases,
        mask_sources=mask_sources, keep=Keep())
    self._read_masks(site, query_free)
    self._choose_layout(site, query_free)
    self._settle_masks(site)
    self._apply_repeat(site)
    site.dtype = _kernel_dtype(site)
    site.notes = _semantic_notes(site)
    return site

  def _pv_labels(self, pv, p_index, p_labels, key, sizes):
    """(labels of V's dims, labels of the PV output dims)."""
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    p_contract, v_contract = (lc, rc) if p_index == 0 else (rc, lc)
    p_batch, v_batch = (lb, rb) if p_index == 0 else (rb, lb)
    if len(p_contract) != 1 or p_labels[p_contract[0]] != key:
      raise NoMatch("the product with V does not contract the axis the softmax normalizes")
    v = pv.inputs[1 - p_index]
    v_labels = [None] * v.aval.ndim
    v_labels[v_contract[0]] = key
    for pd, vd in zip(p_batch, v_batch):
      v_labels[vd] = p_labels[pd]
    self._v_batch = [p_labels[pd] for pd in p_batch]
    free = [d for d in range(v.aval.ndim) if v_labels[d] is None]
    if len(free) != 1:
      raise NoMatch(f"the value operand has {len(free)} free axes; attention needs exactly one "
                    "(its head dim)")
    v_labels[free[0]] = "v"
    sizes["v"] = v.shape[free[0]]
    p_free = [p_labels[d] for d in range(len(p_labels)) if d not in p_contract and d not in p_batch]
    batch = [p_labels[d] for d in p_batch]
    out = batch + (p_free + ["v"] if p_index == 0 else ["v"] + p_free)
    return tuple(v_labels), tuple(out)

  def _additive_mask(self, other, labels, sign, dtype) -> MaskSource | None:
    """A bias `where(mask, 0, fill)` with a negligible fill is a mask."""
    stripped = operands.strip(self.graph, other, labels, broadcasts=True)
    node = stripped.source.producer
    while node is not None and node.prim == "convert_element_type":
      node = node.inputs[0].producer
    if sign != 1.0 or node is None or node.prim != "select_n" or len(node.inputs) != 3:
      return None
    pred, case_false, case_true = node.inputs
    c_false, c_true = self.graph.scalar(case_false), self.graph.scalar(case_true)
    pred_labels = masks.operand_labels(pred.shape, stripped.labels, node.outputs[0].shape)
    for zero, fill, negated in ((c_true, c_false, False), (c_false, c_true, True)):
      if zero == 0.0 and fill is not None and fill <= fill_threshold(dtype):
        return MaskSource(pred, pred_labels, negated, fill)
    return None

  # -- masks and layout --

  def _read_masks(self, site: Site, query_free):
    for source in site.mask_sources:
      pred = self.reader.keep(source.pred, source.labels, source.negated)
      source.keep = masks.classify(self.reader, pred, site.key, query_free)
      if source.keep is None:
        source.keep = _tensor_keep(source)

  def _choose_layout(self, site: Site, query_free):
    """Pick the query label (one V does not vary along) and the kernel's B / K / group dims."""
    in_v = set(site.v.labels) | set(self._v_batch)
    candidates = [l for l in query_free if l not in in_v]
    if query_free and not candidates:
      raise NoMatch("the product with V batches over the query axis")
    if not candidates:               # one query row per (batch, head): q has no query axis
      site.query = None
      _set_groups(site, None)
      return
    referenced = [s.keep.query for s in site.mask_sources if s.keep.query in candidates]
    if referenced:
      site.query = referenced[0]
    else:
      big = [l for l in candidates if site.sizes[l] > 1] or candidates
      site.query = min(big, key=lambda l: (self._layout_cost(site, l), query_free.index(l)))
    for source in site.mask_sources:
      if source.keep.query not in (None, site.query):
        source.keep = _tensor_keep(source)
    _set_groups(site, site.query)

  def _layout_cost(self, site, query) -> int:
    trial = dataclasses.replace(site)
    _set_groups(trial, query)
    return sum(operands.arrangement_cost(op.labels, groups, site.sizes)
               for op, groups in ((site.q, q_groups(trial)), (site.k, k_groups(trial)),
                                  (site.v, v_groups(trial))))

  def _settle_masks(self, site: Site):
    """Merge the masks' Keeps; a mask the kernel cannot express symbolically is a tensor."""
    batch = set(site.batch_group)
    t_size = site.sizes.get(site.query, 1) if site.query else 1
    s_size = site.sizes[site.key]
    for source in site.mask_sources:
      keep = source.keep
      lengths_ok = all(set(l for l in t.labels if l) <= batch
                       for t, _ in keep.kv_lengths + keep.q_lengths)
      if not lengths_ok or window_params(keep, t_size, s_size) is None:
        source.keep = _tensor_keep(source)
      site.keep.merge(source.keep)
    if window_params(site.keep, t_size, s_size) is None:
      raise NoMatch("the masks' band of kept keys cannot be expressed as causal / window")

  def _apply_repeat(self, site: Site):
    """GQA by `jnp.repeat` of K and V heads: K / V keep their own (fewer) heads.

    Query head n = kv * groups + g reads kv head n // groups: with the repeated label last among
    the kernel's kv heads, the flattened query heads split the same way, so only K and V get a
    new label (their unrepeated head dim) and no array is reshaped."""
    if site.k.repeat is None:
      return
    label, groups = site.k.repeat
    if not site.kv_heads or site.kv_heads[-1] != label:
      # The repeated heads are not the kernel's innermost kv heads: use the repeated arrays.
      site.k, site.v = site.k.unrepeated, site.v.unrepeated
      return
    kv_label = label + "/kv"
    site.sizes[kv_label] = site.sizes[label] // groups
    site.repeat = (label, kv_label)
    for op in (site.k, site.v):
      op.labels = tuple(kv_label if l == label else l for l in op.labels)

  # -- safety --

  def _check_closed(self, site: Site):
    """No intermediate of the site may be used outside it."""
    region = site.region
    for node in region:
      if node is site.pv:
        continue
      role = _role(site, node)
      for value in node.outputs:
        if value.is_output:
          raise NoMatch(f"the {role} are also an output of the function")
        outside = [u for u in value.users if u not in region]
        if outside:
          if any(_feeds(u, region) for u in outside):
            raise NoMatch(f"a mask or bias is computed from the {role} themselves")
          raise NoMatch(f"the {role} are also used by `{outside[0].prim}` outside the attention")


def _tensor_keep(source: MaskSource) -> Keep:
  return Keep(tensors=[Tensor(Opaque(source.pred, source.labels), source.negated)])


def _role(site: Site, node: Node) -> str:
  if node is site.qk:
    return "attention scores"
  if site.softmax.probs in node.outputs or not _upstream_of(node, site.softmax.logits) and (
      node not in site.softmax.nodes):
    return "attention probabilities"
  if node in site.softmax.nodes:
    return "softmax intermediates"
  return "attention scores"


def _upstream_of(node: Node, value: Value, budget: int = 64) -> bool:
  stack = [value]
  while stack and budget > 0:
    v = stack.pop()
    if v.producer is None:
      continue
    if v.producer is node:
      return True
    budget -= 1
    stack.extend(v.producer.inputs)
  return False


def _feeds(node: Node, region, budget: int = 256) -> bool:
  """Whether `node`'s outputs flow into a node of `region` (a mask computed from the scores)."""
  stack, seen = list(node.outputs), set()
  while stack and budget > 0:
    value = stack.pop()
    for user in value.users:
      if user in region:
        return True
      if id(user) not in seen:
        seen.add(id(user))
        budget -= 1
        stack.extend(user.outputs)
  return False


@dataclasses.dataclass
class _Fold:
  labels: tuple
  scale: float = 1.0
  softcap: float | None = None
  biases: list = dataclasses.field(default_factory=list)    # (value, labels, sign)
  masks: list = dataclasses.field(default_factory=list)     # MaskSource
  dtype: object = None


def _fold_ops(graph: Graph, ops, labels) -> _Fold:
  """Apply the logits ops in program order to the QK labels; collect scale / bias / masks."""
  fold = _Fold(tuple(labels))
  for op in ops:
    fold.dtype = op.node.outputs[0].dtype
    if op.kind == "transpose":
      fold.labels = tuple(fold.labels[i] for i in op.node.params["permutation"])
    elif op.kind == "scale":
      if fold.softcap is not None or fold.biases:
        raise NoMatch("the scores are scaled after the softcap or bias, not before")
      if op.value <= 0:
        raise NoMatch(f"the scores are scaled by {op.value:g}, which is not positive")
      fold.scale *= op.value
      for mask in fold.masks:
        mask.fill *= op.value
    elif op.kind == "softcap":
      if fold.softcap is not None or fold.biases or fold.masks:
        raise NoMatch("the softcap is applied after a bias or mask, unlike the kernel")
      fold.softcap = op.value
    elif op.kind == "bias":
      labels = masks.operand_labels(op.other.shape, fold.labels, op.node.outputs[0].shape)
      fold.biases.append((op.other, labels, op.value))
    elif op.kind == "mask":
      pred = op.other
      labels = masks.operand_labels(pred.shape, fold.labels, op.node.outputs[0].shape)
      fold.masks.append(MaskSource(pred, labels, op.negated, op.value))
  if fold.dtype is None:
    fold.dtype = np.float32
  for mask in fold.masks:
    if not (mask.fill <= fill_threshold(fold.dtype)):
      raise NoMatch(f"the mask fill {mask.fill:g} is not negligible: masked keys would keep "
                    f"a weight of exp({mask.fill:g} - max)")
  return fold


def _set_groups(site: Site, query):
  order = [l for l in site.q.labels if l is not None and l != site.head]
  if query in order:
    position = order.index(query)
    before, after = order[:position], order[position + 1:]
  else:                              # no query axis: the outermost label is the batch
    before, after = order[:1], order[1:]
  in_kv = {l for op in (site.k, site.v) for l in op.labels if l is not None}
  site.batch_group = before
  site.kv_heads = [l for l in after if l in in_kv]
  site.group_heads = [l for l in after if l not in in_kv]


def q_groups(site: Site):
  return [site.batch_group, [site.query] if site.query else [], site.kv_heads + site.group_heads,
          [site.head]]


def kv_head_group(site: Site) -> list:
  if site.repeat is None:
    return list(site.kv_heads)
  label, kv_label = site.repeat
  return [kv_label if l == label else l for l in site.kv_heads]


def k_groups(site: Site):
  return [site.batch_group, [site.key], kv_head_group(site), [site.head]]


def v_groups(site: Site):
  return [site.batch_group, [site.key], kv_head_group(site), [site.value_head]]


def score_groups(site: Site):
  return [site.batch_group, site.kv_heads + site.group_heads,
          [site.query] if site.query else [], [site.key]]


def window_params(keep: Keep, t_size: int, s_size: int):
  """(is_causal, local_window_size) for the band of `keep`, or None when not expressible."""
  hi = keep.hi if keep.hi < s_size - 1 else math.inf
  lo = keep.lo if keep.lo > -(t_size - 1) else -math.inf
  if hi < 0 or lo > 0 or (math.isfinite(hi) and math.isfinite(lo) and lo > hi):
    return None
  is_causal = hi == 0
  if math.isinf(lo) and (math.isinf(hi) or is_causal):
    return is_causal, None
  left = int(-lo) if math.isfinite(lo) else max(t_size - 1, 0)
  right = int(hi) if math.isfinite(hi) else max(s_size - 1, 0)
  return is_causal, (left, right)


def _kernel_dtype(site: Site):
  dtypes = {np.dtype(op.source.dtype) for op in (site.q, site.k, site.v)}
  return np.result_type(*dtypes) if len(dtypes) > 1 else dtypes.pop()


def _semantic_notes(site: Site) -> list[str]:
  """Where the fused function differs from the original: only rows with no kept key."""
  keep = site.keep
  if not _rows_can_be_empty(site):
    return []
  fills = sorted({s.fill for s in site.mask_sources})
  original = []
  if any(math.isinf(f) for f in fills):
    original.append("NaN (the -inf fill makes the softmax 0/0)")
  if any(math.isfinite(f) for f in fills):
    original.append("the mean of V over all keys (the finite fill cancels out)")
  if not original:
    return []
  rows = "rows past the query lengths and rows" if keep.q_lengths or math.isfinite(
      keep.q_bound) else "rows"
  return [f"{rows} whose every key is masked give 0 when fused; the original gives "
          + " or ".join(original)]


def _rows_can_be_empty(site: Site) -> bool:
  keep = site.keep
  if keep.tensors or keep.kv_lengths or keep.q_lengths:
    return True
  t_size = site.sizes.get(site.query, 1) if site.query else 1
  s_size = site.sizes[site.key]
  t = np.arange(min(t_size, keep.q_bound if math.isfinite(keep.q_bound) else t_size))
  low = np.maximum(0, t + keep.lo) if math.isfinite(keep.lo) else np.zeros_like(t)
  high = np.full_like(t, min(s_size, keep.kv_bound if math.isfinite(keep.kv_bound) else s_size)
                      - 1)
  if math.isfinite(keep.hi):
    high = np.minimum(high, t + int(keep.hi))
  return bool(np.any(low > high)) or (math.isfinite(keep.q_bound) and keep.q_bound < t_size)
