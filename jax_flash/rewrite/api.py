"""`fuse` and `explain`: trace a function to a jaxpr, plan the rewrite, re-emit or report."""
from __future__ import annotations

import collections
import functools

import jax
import numpy as np

from jax_flash.rewrite.interpreter import Options, Plan
from jax_flash.rewrite.report import Report

_CACHE_SIZE = 64


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


class _Traced:
  """fn traced on the array leaves of (args, kwargs); every other leaf is a trace constant."""

  def __init__(self, fn, args, kwargs):
    leaves, self.treedef = jax.tree_util.tree_flatten((args, kwargs))
    self.is_array = [_is_array(leaf) for leaf in leaves]
    self.arrays = [leaf for leaf, a in zip(leaves, self.is_array) if a]
    self.statics = [leaf for leaf, a in zip(leaves, self.is_array) if not a]
    self.leaves = leaves
    self.fn = fn

  def key(self):
    """A cache key for the trace, or None when a static leaf is unhashable."""
    avals = tuple((tuple(a.shape), str(a.dtype), getattr(jax.typeof(a), "weak_type", False))
                  for a in self.arrays)
    try:
      statics = tuple(self.statics)
      hash(statics)
    except TypeError:
      return None
    return (self.treedef, tuple(self.is_array), statics, avals)

  def flat_fn(self, *arrays):
    it = iter(arrays)
    leaves = [next(it) if a else leaf for leaf, a in zip(self.leaves, self.is_array)]
    args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
    return self.fn(*args, **kwargs)

  def trace(self):
    """(ClosedJaxpr, output treedef)."""
    closed, out_shape = jax.make_jaxpr(self.flat_fn, return_shape=True)(*self.arrays)
    return closed, jax.tree_util.tree_structure(out_shape)


def _plan(traced: _Traced, options: Options, cache=None):
  key = traced.key() if cache is not None else None
  if key is not None and key in cache:
    return cache[key]
  closed, out_tree = traced.trace()
  entry = (Plan(closed, options), out_tree)
  if key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
    cache[key] = entry
    while len(cache) > _CACHE_SIZE:
      cache.popitem(last=False)
  return entry


def fuse(fn, *, schedule: str = "auto"):
  """`fn` with every recognized attention subgraph computed by `jax_flash.flash_attention`.

  The returned function has fn's signature. When called (or traced by jit / grad / vmap), it
  traces fn to a jaxpr, finds softmax(scale * Q Kᵀ + bias, masked) V subgraphs (also inside
  jit, scan, cond, while, remat and custom_jvp / custom_vjp bodies), and evaluates the jaxpr
  with each of them replaced by one kernel call; everything else is evaluated as it was.
  Array arguments (jax / numpy arrays) are traced; any other argument (Python numbers, strings,
  configs) is a trace-time constant, as with jit's static arguments. `schedule` is passed to
  every kernel call. See `explain` for what is fused and why not.
  """
  if not callable(fn):
    raise ValueError(f"fn must be callable; got {type(fn).__name__}")
  if not isinstance(schedule, str):
    raise ValueError(f"schedule must be a string ('auto' or a name from jax_flash.schedules()); "
                     f"got {type(schedule).__name__}")
  options = Options(schedule)
  cache = collections.OrderedDict()

  @functools.wraps(fn)
  def fused(*args, **kwargs):
    traced = _Traced(fn, args, kwargs)
    plan, out_tree = _plan(traced, options, cache)
    return jax.tree_util.tree_unflatten(out_tree, plan.emit(traced.arrays))

  fused._jax_flash_fuse = (fn, options)
  return fused


def explain(fn, *args, **kwargs) -> Report:
  """For every candidate attention site of fn(*args, **kwargs): whether `fuse` replaces it, the
  recognized form (layout, heads, scale, mask, bias, softcap), the kernel schedule, and the
  reason when it is not fused. `print(explain(...))` gives a readable summary.

  `fn` may be the plain function or `fuse(fn, schedule=...)` (then that schedule is reported).
  """
  fn, options = getattr(fn, "_jax_flash_fuse", (fn, Options()))
  plan, _ = _plan(_Traced(fn, args, kwargs), options)
  return Report(plan.all_reports())
