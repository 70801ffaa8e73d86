"""The attention kernels under `jax.jit` with sharded inputs: `custom_partitioning` rules.

`_kernel_call` routes every FFI call through `partitioned(raw, kind)`. Under a multi-device jit
the call becomes one custom partitioning op whose Shardy `sharding_rule` (and, for the GSPMD
partitioner, `infer_sharding_from_operands` / `propagate_user_sharding`) tells the compiler how
its dimensions may be split, and whose `partition` callback returns the per-device computation:

- batch (B) and heads: every device runs the kernel on its own shard, no collective. Query and
  kv heads split on the same mesh axes, and only on axes whose size divides the kv heads, so
  the query heads of one kv head stay together (GQA groups whole); see `_head_factors`.
  Sequence lengths follow B; bias / mask follow B and N on the dims where they are full
  (broadcast dims of size 1 are factors of their own and never split).
- sequence (T = S, self-attention without bias, mask or window): query and key sequence share
  one factor, so sharding either shards both, and `partition` runs ring attention
  (`jax_flash.ring`) over those mesh axes: ppermutes of K/V only. A causal call is reordered
  into the zigzag layout on the way in (two ppermutes per tensor) and back on the way out, so
  the ring is load-balanced although the caller's sharding is contiguous.
- anything else (head dim, a sequence split of a call the ring cannot serve, a head split that
  would break a GQA group, sizes the mesh axes do not divide): replicated on that dim; the
  compiler gathers what the kernel needs.

Inside `shard_map` (all axes manual) or on one device the op is inlined: the kernel runs as is.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor,
                                                  SdyShardingRule, custom_partitioning)
from jax.interpreters.mlir import ir
from jax.sharding import AxisType, NamedSharding, PartitionSpec, auto_axes

from jax_flash._config import AttentionConfig

# Roles of the FFI operands / results (docs/architecture.md), in order.
_ROLES = {
    "forward": (("q", "kv", "kv", "bias", "mask", "lengths", "lengths"), ("q", "lse")),
    "backward": (("q", "kv", "kv", "bias", "mask", "lengths", "lengths", "q", "lse", "q"),
                 ("q", "kv", "kv", "dbias")),
}
_DUMMY_SHAPE = (1, 1, 1, 1)


def partitioned(raw, kind: str):
  """Wrap raw(schedule, config, q, k, v, bias|None, mask|None, q_lens, kv_lens[, out, lse,
  dout]) -> tuple in a custom partitioning op. The result has raw's signature and results
  (a backward's dbias stays None without a bias)."""
  op = _partitioning_op(raw, kind)

  @functools.wraps(raw)
  def call(schedule, config, *arrays):
    bias, mask = arrays[3], arrays[4]
    if (bias is not None) != config.has_bias or (mask is not None) != config.has_mask:
      raise ValueError(f"bias / mask presence ({bias is not None}, {mask is not None}) does not "
                       f"match the config ({config.has_bias}, {config.has_mask})")
    standard = list(arrays)
    standard[3] = jnp.zeros(_DUMMY_SHAPE, jnp.float32) if bias is None else bias
    standard[4] = jnp.ones(_DUMMY_SHAPE, jnp.bool_) if mask is None else mask
    results = _vary_like(arrays, _run_auto(op, kind, schedule, config, standard))
    if kind == "backward" and not config.has_bias:
      results = (*results[:3], None)
    return tuple(results)

  return call


def _vary_like(inputs, results):
  """Inside `shard_map` an FFI call's results are typed as invariant across the manual mesh axes
  whatever its inputs; they vary like the inputs (custom_vjp and collectives check this)."""
  axes = frozenset().union(*(_varying_axes(x) for x in inputs if x is not None))
  return tuple(_cast_varying(r, tuple(sorted(axes - _varying_axes(r)))) for r in results)


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  for name in ("mat", "manual_axis_type"):  # jax 0.10 spells it so; earlier releases `vma`
    manual = getattr(aval, name, None)
    if hasattr(manual, "varying"):
      return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def _cast_varying(x, axes: tuple):
  if not axes:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)


def _run_auto(op, kind, schedule, config, standard):
  """Run the op; on a mesh with Explicit axes (sharding in types) run it in auto mode, where
  custom partitioning works. Each result is typed like the input it mirrors (out and dq like q,
  dk like k, dv like v), the logsumexp and dbias like the query's batch / heads / sequence."""
  q_sharding = jax.typeof(standard[0]).sharding
  mesh = q_sharding.mesh
  explicit = tuple(name for name, axis_type in zip(mesh.axis_names, mesh.axis_types)
                   if axis_type == AxisType.Explicit)
  if not explicit:
    return op(schedule, config, *standard)
  batch, seq, heads, _ = _spec_axes(q_sharding, 4)
  typed = _Plan(batch, heads, seq)
  out_roles = _ROLES[kind][1]
  shapes = _result_shapes(kind, config, standard[0].shape, standard[1].shape)
  out_shardings = tuple(
      jax.typeof(standard[mirror]).sharding if mirror is not None
      else NamedSharding(mesh, typed.spec(role, shape))
      for role, shape, mirror in zip(out_roles, shapes, _MIRRORED_INPUT[kind]))
  return auto_axes(lambda *arrays: op(schedule, config, *arrays), axes=explicit,
                   out_sharding=out_shardings)(*standard)


# The operand each result has the shape and sharding of (None: derived from the query's).
_MIRRORED_INPUT = {"forward": (0, None), "backward": (0, 1, 2, None)}


def _result_shapes(kind, config, q_shape, k_shape):
  b, t, n, _ = q_shape
  if kind == "forward":
    return q_shape, (b, n, t)
  dbias = (b, n, t, k_shape[1]) if config.has_bias else _DUMMY_SHAPE
  return q_shape, k_shape, k_shape, dbias


def _partitioning_op(raw, kind: str):
  def body(schedule, config, *standard):
    return _local(raw, kind, schedule, config, standard)

  op = custom_partitioning(body, static_argnums=(0, 1))
  op.def_partition(
      partition=functools.partial(_partition, raw, kind),
      infer_sharding_from_operands=functools.partial(_infer_result_shardings, kind),
      propagate_user_sharding=functools.partial(_propagate_user_sharding, kind),
      sharding_rule=functools.partial(_sharding_rule, kind))
  return op


def _local(raw, kind: str, schedule, config: AttentionConfig, standard):
  """The kernel on whole (or per-device) arrays; dummies back to None for raw."""
  args = list(standard)
  args[3] = args[3] if config.has_bias else None
  args[4] = args[4] if config.has_mask else None
  results = tuple(raw(schedule, config, *args))
  if kind == "backward" and results[3] is None:
    results = (*results[:3], jnp.zeros(_DUMMY_SHAPE, jnp.float32))
  return results


def ring_eligible(config: AttentionConfig, q_shape, k_shape) -> bool:
  """Whether a sequence split of this call can run as ring attention (else it is gathered)."""
  return (not (config.has_bias or config.has_mask or config.has_window)
          and q_shape[1] == k_shape[1])


# -- Shardy: the factor rule ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Factors:
  """Factor names of one call's dimensions."""
  q_heads: object              # "heads", "q_heads" or CompoundFactor("kv_heads", "group")
  kv_heads: str
  q_seq: str
  kv_seq: str
  need_replication: tuple
  sizes: tuple                 # ((factor, size), ...) for factors only used in compounds

  @classmethod
  def of(cls, config: AttentionConfig, q_shape, k_shape, mesh) -> "_Factors":
    q_heads, kv_heads, sizes, replicated = _head_factors(q_shape[2], k_shape[2], mesh)
    if ring_eligible(config, q_shape, k_shape):
      return cls(q_heads, kv_heads, "seq", "seq", replicated, sizes)
    return cls(q_heads, kv_heads, "q_seq", "kv_seq", replicated + ("q_seq", "kv_seq"), sizes)

  def mapping(self, role: str, shape, tag: str) -> ArrayMapping:
    if role == "q":
      return ArrayMapping("batch", self.q_seq, self.q_heads, "head_dim")
    if role == "kv":
      return ArrayMapping("batch", self.kv_seq, self.kv_heads, "head_dim")
    if role == "lse":
      return ArrayMapping("batch", self.q_heads, self.q_seq)
    if role == "lengths":
      return ArrayMapping("batch")
    full = ("batch", self.q_heads, self.q_seq, self.kv_seq)
    # A broadcast dim (size 1) is a factor of its own: it never shards.
    return ArrayMapping(*(f"{tag}_{d}" if size == 1 else full[d] for d, size in enumerate(shape)))


def _head_factors(num_heads: int, num_kv_heads: int, mesh):
  """(query heads, kv heads, compound sizes, factors needing replication).

  Under GQA the query heads are (kv_heads, group) with `group` never sharded, so Shardy splits
  query and kv heads together and groups stay whole. Shardy would split a mesh axis into
  sub-axes when the axes sharding the heads do not divide kv_heads, and jax cannot hand such a
  sharding to `partition`; so the compound is used only when every mesh axis together divides
  kv_heads. Otherwise query and kv heads are separate factors and `partition` itself keeps the
  groups whole (it splits heads only on axes that divide kv_heads, else gathers them)."""
  if num_heads == num_kv_heads:
    return "heads", "heads", (), ("head_dim",)
  if num_kv_heads % math.prod(mesh.shape.values()) == 0:
    return (CompoundFactor("kv_heads", "group"), "kv_heads",
            (("group", num_heads // num_kv_heads),), ("head_dim", "group"))
  return "q_heads", "kv_heads", (), ("head_dim",)


def _sharding_rule(kind, schedule, config, mesh, operand_types, result_types):
  del schedule
  operand_shapes = [_type_shape(t) for t in operand_types]
  result_shapes = [_type_shape(t) for t in result_types]
  factors = _Factors.of(config, operand_shapes[0], operand_shapes[1], mesh)
  in_roles, out_roles = _ROLES[kind]
  operands = tuple(factors.mapping(r, s, f"in{i}")
                   for i, (r, s) in enumerate(zip(in_roles, operand_shapes)))
  results = tuple(factors.mapping(r, s, f"out{i}")
                  for i, (r, s) in enumerate(zip(out_roles, result_shapes)))
  # Shardy wants special factors in the order the factors first appear in the rule.
  order = list(dict.fromkeys(f for m in operands + results for d in m
                             for f in ((d,) if isinstance(d, str) else d)))
  return SdyShardingRule(
      operands, results, need_replication_factors=tuple(sorted(factors.need_replication,
                                                               key=order.index)),
      **dict(factors.sizes))


def _type_shape(mlir_type) -> tuple:
  return tuple(ir.RankedTensorType(mlir_type).shape)


# -- the partition: which mesh axes split what, and the per-device computation -------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
  """Mesh axes that split the batch, the heads (query and kv alike) and the sequence."""
  batch: tuple = ()
  heads: tuple = ()
  seq: tuple = ()

  @classmethod
  def of(cls, mesh, q_sharding, config: AttentionConfig, q_shape, k_shape) -> "_Plan":
    """Keep the query's axes where the kernel can honour them, drop the rest (replicate)."""
    batch_axes, seq_axes, head_axes, _ = _spec_axes(q_sharding, 4)
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    seq_blocks = size(seq_axes) * (2 if config.is_causal else 1)  # causal: zigzag halves
    seq_ok = ring_eligible(config, q_shape, k_shape) and q_shape[1] % seq_blocks == 0
    return cls(batch=batch_axes if q_shape[0] % size(batch_axes) == 0 else (),
               heads=head_axes if k_shape[2] % size(head_axes) == 0 else (),
               seq=seq_axes if seq_ok else ())

  def spec(self, role: str, shape) -> PartitionSpec:
    b, n, t = _entry(self.batch), _entry(self.heads), _entry(self.seq)
    if role in ("q", "kv"):
      return PartitionSpec(b, t, n, None)
    if role == "lse":
      return PartitionSpec(b, n, t)
    if role == "lengths":
      return PartitionSpec(b)
    # bias / mask / dbias: only their full batch and head dims split (never rings: see
    # ring_eligible).
    return PartitionSpec(b if shape[0] > 1 else None, n if shape[1] > 1 else None, None, None)

  def shardings(self, mesh, roles, shapes):
    return tuple(NamedSharding(mesh, self.spec(r, s)) for r, s in zip(roles, shapes))


def _entry(axes: tuple):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _spec_axes(sharding, ndim: int) -> tuple:
  """Per dim, the tuple of mesh axes a NamedSharding splits it over."""
  spec = tuple(getattr(sharding, "spec", ()))
  spec += (None,) * (ndim - len(spec))
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec)


def _partition(raw, kind, schedule, config, mesh, arg_shapes, result_shape):
  shapes = [a.shape for a in arg_shapes]
  plan = _Plan.of(mesh, arg_shapes[0].sharding, config, shapes[0], shapes[1])
  in_roles, out_roles = _ROLES[kind]

  def per_device(*standard):
    if plan.seq:
      return _ring(kind, schedule, config, plan.seq, standard)
    return _local(raw, kind, schedule, config, standard)

  return (mesh, per_device, plan.shardings(mesh, out_roles, [r.shape for r in result_shape]),
          plan.shardings(mesh, in_roles, shapes))


def _infer_result_shardings(kind, schedule, config, mesh, arg_shapes, result_shape):
  """GSPMD: result shardings from the operands' (what `partition` will produce)."""
  del schedule
  shapes = [a.shape for a in arg_shapes]
  plan = _Plan.of(mesh, arg_shapes[0].sharding, config, shapes[0], shapes[1])
  return plan.shardings(mesh, _ROLES[kind][1], [r.shape for r in result_shape])


def _propagate_user_sharding(kind, schedule, config, mesh, user_shape):
  """GSPMD: the result shardings to suggest given how a user of the results is sharded."""
  del schedule
  batch_axes, seq_axes, head_axes, _ = _spec_axes(user_shape[0].sharding, 4)
  seq_ok = not (config.has_bias or config.has_mask or config.has_window)
  plan = _Plan(batch_axes, head_axes, seq_axes if seq_ok else ())
  return plan.shardings(mesh, _ROLES[kind][1], [r.shape for r in user_shape])


def _ring(kind, schedule, config: AttentionConfig, axes: tuple, standard):
  """Ring attention over `axes` on contiguous sequence blocks (zigzag inside when causal)."""
  from jax_flash import ring  # ring imports the kernel call, which imports this module

  layout = "zigzag" if config.is_causal else "contiguous"
  spec = ring.RingSpec(axes, layout)
  if config.is_causal:
    into = functools.partial(ring.contiguous_to_zigzag, axis_name=axes)
    back = functools.partial(ring.zigzag_to_contiguous, axis_name=axes)
  else:
    into = back = lambda x, axis=1: x
  q, k, v, _, _, q_lens, kv_lens = standard[:7]
  q, k, v = into(q), into(k), into(v)
  if kind == "forward":
    out, lse = ring.ring_forward(schedule, config, spec, q, k, v, q_lens, kv_lens)
    return back(out), back(lse, axis=2)
  out, lse, dout = standard[7:]
  dq, dk, dv = ring.ring_backward(schedule, config, spec, q, k, v, q_lens, kv_lens, into(out),
                                  into(lse, axis=2), into(dout))
  return back(dq), back(dk), back(dv), jnp.zeros(_DUMMY_SHAPE, jnp.float32)
