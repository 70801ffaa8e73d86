"""Analysis and re-emission of one jaxpr: the heart of `fuse`.

`Plan(closed_jaxpr)` flattens the jaxpr (graph.py), matches every softmax it finds
(patterns.py) and plans the bodies of higher-order equations (scan, cond, while, remat,
custom_jvp / custom_vjp, jit with shardings) the same way, recursively.

`Plan.emit(args)` evaluates the jaxpr under whatever trace is current (jit, grad, vmap, or
none), equation by equation, binding the same primitives with the same params, except that
  * a fused site's PV product is replaced by the kernel call and its other nodes are skipped;
  * values nothing needs any more (the scores' inputs only attention used, the mask built from
    iotas) are not computed (a liveness pass, like dead-code elimination);
  * plain jit calls that contain part of a fused site are inlined, other calls are re-emitted
    as they were;
  * higher-order equations whose bodies contain fused sites get the rewritten bodies.
"""
from __future__ import annotations

import math

import jax
import numpy as np

from jax_flash.rewrite import compat, kernel, operands, report
from jax_flash.rewrite.graph import Graph, Level, Node, Value
from jax_flash.rewrite.patterns import Matcher, NoMatch, Site
from jax_flash.rewrite.softmax import find_softmaxes


class Options:
  """How sites are served: the schedule name, and the two jax_flash entry points used."""

  def __init__(self, schedule: str = "auto"):
    self.schedule = schedule

  def flash_attention(self):
    from jax_flash.api import flash_attention
    return flash_attention

  def select_schedule(self, site: Site, ops: kernel.KernelOperands) -> str:
    """The schedule that will serve `site` (a ValueError from jax_flash when none can)."""
    from jax_flash import _dispatch, _validate
    arrays, statics = kernel.kernel_shapes(site, ops)
    shape, config = _validate.build_config(**arrays, **statics)
    return _dispatch.select(self.schedule, shape, arrays["query"].dtype, config).name


class Plan:
  """The analysis of one ClosedJaxpr and everything nested in it."""

  def __init__(self, closed_jaxpr, options: Options, location: str = "top level",
               unfusable: str | None = None, known_inputs=()):
    self.closed_jaxpr = closed_jaxpr
    self.options = options
    self.location = location
    self.unfusable = unfusable      # why no site in this body can be fused, if none can
    self.graph = Graph(closed_jaxpr)
    # Scalars the caller passes in unchanged (a scale or fill computed outside a scan body)
    # are the constants they are: the matcher reads them as such.
    for value, known in zip(self.graph.inputs, known_inputs):
      if known is not None and math.prod(value.shape) == 1:
        value.const = np.full(value.shape, known, value.dtype)
    self.sites: dict[Node, tuple[Site, kernel.KernelOperands]] = {}   # PV node -> site
    self.reports: list[report.SiteReport] = []
    self.region: set[Node] = set()
    self.subplans: dict[Node, dict] = {}
    self._match_sites()
    self._plan_bodies()
    self.inlined = self._inlined_levels()

  @property
  def changed(self) -> bool:
    return bool(self.sites) or any(p.changed for subs in self.subplans.values()
                                   for p in subs.values())

  def all_reports(self) -> list[report.SiteReport]:
    found = list(self.reports)
    for subs in self.subplans.values():
      for plan in subs.values():
        found += plan.all_reports()
    return found

  # -- analysis --

  def _match_sites(self):
    matcher = Matcher(self.graph, self._select)
    claimed: set[Node] = set()
    for index, softmax in enumerate(find_softmaxes(self.graph)):
      where = f"{self.location}, softmax #{index}"
      try:
        site = matcher.match(softmax)
        if site.region & claimed:
          raise NoMatch("it overlaps another attention site")
        if self.unfusable:
          raise NoMatch(self.unfusable)
      except NoMatch as e:
        self.reports.append(report.SiteReport(where, False, str(e)))
        continue
      claimed |= site.region
      self.sites[site.pv] = (site, self._operands(site))
      self.region |= site.region
      self.reports.append(report.SiteReport(where, True, None, report.describe(site),
                                            site.schedule, site.notes))

  def _operands(self, site: Site) -> kernel.KernelOperands:
    return kernel.kernel_operands(
        site, lambda value, labels: operands.strip(self.graph, value, labels, broadcasts=True))

  def _select(self, site: Site) -> str:
    try:
      return self.options.select_schedule(site, self._operands(site))
    except ValueError as e:
      raise NoMatch(f"the kernel cannot serve it: {e}") from None
    except ImportError as e:
      raise NoMatch(f"the jax_flash kernel is not available: {e}") from None

  def _plan_bodies(self):
    for node in self.graph.nodes:
      if node in self.region:
        continue
      subs = {}
      for key, index, jaxpr in compat.jaxpr_params(node.params):
        closed = compat.as_closed(jaxpr)
        if not all(hasattr(a, "shape") for a in closed.in_avals):
          continue
        name = node.params.get("name")
        where = (f"{node.prim}{f'[{name}]' if name else ''}.{key}"
                 f"{'' if index is None else f'[{index}]'}")
        unfusable = None
        if compat.is_open_jaxpr(jaxpr) and node.prim not in compat.REMAT_NAMES:
          unfusable = (f"it is inside `{node.prim}`, whose body the pass cannot re-emit (a "
                       "body without constants)")
        known = [None if v is None else self.graph.scalar(v)
                 for v in _invariant_operands(node, key, len(closed.in_avals))]
        subs[(key, index)] = Plan(closed, self.options, f"{self.location} > {where}", unfusable,
                                  known)
      if subs:
        self.subplans[node] = subs

  def _inlined_levels(self) -> set[int]:
    """Plain jit calls to inline: those holding part of a fused site or one of its inputs."""
    levels: set[int] = set()
    nodes = set(self.region)
    for _, ops in self.sites.values():
      nodes |= {v.producer for v in ops.inputs() if v.producer is not None}
    for subs_node, subs in self.subplans.items():
      if any(p.changed for p in subs.values()):
        nodes.add(subs_node)
    for node in nodes:
      levels |= {id(level) for level in node.level.ancestors() if level.parent is not None}
    return levels

  # -- emission --

  def emit(self, args):
    """The outputs of the jaxpr on `args`, with every planned rewrite applied."""
    if not self.changed:
      return jax.core.eval_jaxpr(self.closed_jaxpr.jaxpr, self.closed_jaxpr.consts, *args)
    items = self._items(self.graph.root)
    live = _liveness(items, self.graph.outputs)
    env: dict[int, object] = {id(v): a for v, a in zip(self.graph.inputs, args)}

    def read(value: Value):
      return value.const if value.is_const else env[id(value)]

    for item in items:
      if id(item) not in live:
        continue
      outs = self._emit_item(item, read)
      for value, out in zip(item.outputs, outs):
        env[id(value)] = out
    return [read(v) for v in self.graph.outputs]

  def _items(self, level: Level) -> list:
    items = []
    for index, eqn in enumerate(level.jaxpr.eqns):
      child = level.children.get(index)
      if child is not None:
        if id(child) in self.inlined:
          items += self._items(child)
        else:
          items.append(_Item("call", eqn, child.call_inputs, child.call_outputs))
        continue
      node = level.nodes[index]
      if node in self.sites:
        site, ops = self.sites[node]
        items.append(_Item("site", eqn, ops.inputs(), node.outputs, site=(site, ops)))
      elif node not in self.region:
        items.append(_Item("node", eqn, node.inputs, node.outputs, node=node))
    return items

  def _emit_item(self, item, read):
    if item.kind == "site":
      site, ops = item.site
      return [kernel.call_kernel(site, ops, read, self.options.flash_attention())]
    invals = [read(v) for v in item.inputs]
    subs = self.subplans.get(item.node) if item.kind == "node" else None
    with compat.eqn_context(item.eqn):
      if subs and any(p.changed for p in subs.values()):
        outs = _bind_rewritten(item.eqn, subs, invals)
      else:
        outs = compat.bind(item.eqn.primitive, item.eqn.params, invals)
    return outs if item.eqn.primitive.multiple_results else [outs]


def _invariant_operands(node: Node, key: str, count: int) -> list:
  """For each input of the body `key` of `node`, the outer value it always equals (None for
  loop-carried or unknown inputs)."""
  inputs, params = node.inputs, node.params
  if node.prim == "scan":
    consts = inputs[:params["num_consts"]]
  elif node.prim == "cond":
    consts = inputs[1:]
  elif node.prim == "while":
    cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
    consts = inputs[:cond_n] if key == "cond_jaxpr" else inputs[cond_n:cond_n + body_n]
  elif node.prim in _SAME_INPUTS and len(inputs) == count:
    consts = inputs
  else:
    consts = []
  return list(consts[:count]) + [None] * (count - len(consts))


# Higher-order primitives whose body receives exactly the equation's operands.
_SAME_INPUTS = compat.JIT_NAMES | compat.REMAT_NAMES | compat.CUSTOM_JVP_NAMES | {
    "custom_vjp_call", "shard_map"}


class _Item:
  """One step of emission: a node, a kernel call, or an untouched jit call."""
  __slots__ = ("kind", "eqn", "inputs", "outputs", "node", "site")

  def __init__(self, kind, eqn, inputs, outputs, node=None, site=None):
    self.kind, self.eqn, self.inputs, self.outputs = kind, eqn, inputs, outputs
    self.node, self.site = node, site


def _liveness(items, outputs) -> set[int]:
  needed = {id(v) for v in outputs}
  live = set()
  for item in reversed(items):
    if item.eqn.effects or any(id(v) in needed for v in item.outputs):
      live.add(id(item))
      needed |= {id(v) for v in item.inputs}
  return live


def _bind_rewritten(eqn, subs: dict, invals):
  """Bind `eqn` with the rewritten bodies of its changed sub-jaxprs."""
  if eqn.primitive.name in compat.REMAT_NAMES:
    (plan,) = subs.values()
    body = jax.checkpoint(lambda *a: plan.emit(a), prevent_cse=eqn.params["prevent_cse"],
                          policy=eqn.params["policy"])
    return body(*invals)
  replacements = {}
  for (key, index), plan in subs.items():
    if not plan.changed:
      continue
    structs = [compat.shape_struct(a) for a in plan.closed_jaxpr.in_avals]
    new = jax.make_jaxpr(lambda *a, plan=plan: plan.emit(a))(*structs)
    replacements[(key, index)] = new
  params = compat.replace_jaxpr_params(eqn.params, replacements)
  return compat.bind(eqn.primitive, params, invals)
