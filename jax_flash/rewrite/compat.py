"""The jax internals the rewrite pass relies on, in one place (checked against jax 0.10 and 0.11).

Everything else in the pass reads jaxprs through these names only: the Literal / Var / jaxpr
classes of `jax.extend.core` (jax 0.11 made ClosedJaxpr an alias of Jaxpr, which carries its
constants; `.jaxpr`, `.consts`, `.constvars`, `.invars` read the same in both),
`Primitive.get_bind_params` (which returned `(subfuns, params)` in older jax and returns one
params dict now), and the primitive names of the higher-order primitives whose bodies the pass
descends into.
"""
from __future__ import annotations

import contextlib

import jax
from jax.extend import core as jex_core

Literal = jex_core.Literal
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr

JIT_NAMES = frozenset({"jit", "pjit"})
REMAT_NAMES = frozenset({"remat2", "checkpoint", "remat"})
CUSTOM_JVP_NAMES = frozenset({"custom_jvp_call"})
RANDOM_PRIMITIVES = frozenset({
    "random_bits", "random_wrap", "random_unwrap", "random_seed", "random_split",
    "random_fold_in", "threefry2x32", "rng_bit_generator", "rng_uniform"})


def bind(primitive, params: dict, invals):
  """primitive.bind with `params` as stored in an equation (the eval_jaxpr way)."""
  bind_params = primitive.get_bind_params(params)
  if isinstance(bind_params, tuple):      # older jax: (subfuns, params)
    subfuns, bind_params = bind_params
    return primitive.bind(*subfuns, *invals, **bind_params)
  return primitive.bind(*invals, **bind_params)


def eqn_context(eqn):
  """The context an equation was traced under (compute type, thread-local config)."""
  ctx = getattr(eqn, "ctx", None)
  manager = getattr(ctx, "manager", None)
  return manager if manager is not None else contextlib.nullcontext()


def is_unspecified(sharding) -> bool:
  return type(sharding).__name__ in ("UnspecifiedValue", "AUTO") or sharding is None


def is_plain_jit(params: dict) -> bool:
  """A jit equation whose only effect is grouping: no shardings, donation or layouts.

  Such a call can be inlined into its caller without changing what the program computes or how
  it is partitioned, so the pass sees through it (jnp helpers like `_where` are plain jits).
  """
  shardings = tuple(params.get("in_shardings", ())) + tuple(params.get("out_shardings", ()))
  layouts = tuple(params.get("in_layouts", ())) + tuple(params.get("out_layouts", ()))
  return (all(is_unspecified(s) for s in shardings)
          and not any(params.get("donated_invars", ()))
          and all(layout is None for layout in layouts)
          and not params.get("compiler_options_kvs", ()))


def is_open_jaxpr(jaxpr) -> bool:
  """A jaxpr param that may not carry constants (jax 0.10's Jaxpr; since jax 0.11 every Jaxpr
  is also a ClosedJaxpr and carries its own)."""
  return ClosedJaxpr is not Jaxpr and isinstance(jaxpr, Jaxpr) and not isinstance(jaxpr,
                                                                                 ClosedJaxpr)


def as_closed(jaxpr):
  return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())


def jaxpr_params(params: dict):
  """(key, index, value) for every jaxpr held in `params`; index is None for a bare value."""
  for key, value in params.items():
    if isinstance(value, (Jaxpr, ClosedJaxpr)):
      yield key, None, value
    elif isinstance(value, (tuple, list)):
      for i, item in enumerate(value):
        if isinstance(item, (Jaxpr, ClosedJaxpr)):
          yield key, i, item


def replace_jaxpr_params(params: dict, replacements) -> dict:
  """A copy of `params` with {(key, index): new jaxpr} substituted."""
  new = dict(params)
  for (key, index), value in replacements.items():
    if index is None:
      new[key] = value
    else:
      items = list(new[key])
      items[index] = value
      new[key] = type(params[key])(items)
  return new


def shape_struct(aval):
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
