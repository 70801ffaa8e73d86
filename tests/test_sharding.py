"""Sharded attention on 8 host devices: custom partitioning, ring attention, shard_map.

The device count of the CPU backend is fixed when jax starts, and other test modules of the same
pytest process have started it already; so the multi-device checks run in one subprocess (this
file run as a script, with XLA_FLAGS set before jax is imported) and each check is reported as
its own test. Every check compares the sharded call with the unsharded one and with the float64
reference, and reads the compiled HLO for collectives.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # must precede `import jax`
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import functools
import json
import re
import subprocess
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import reference, ring
from attention_cases import GRAD_REL, OUT_ATOL, as_f64, relative_l2

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter",
               "collective-broadcast")
_RESULT_MARKER = "SHARDING_CHECK_RESULTS:"
_CHECKS = {}


def _check(fn):
  _CHECKS[fn.__name__] = fn
  return fn


# -- helpers used inside the 8-device subprocess -------------------------------------------------

def _rng():
  return np.random.default_rng(int(os.environ["JAX_FLASH_SEED"]))


def _mesh(shape=(2, 4), names=("x", "y"), axis_type=AxisType.Auto):
  """The mesh a check asks for, on the 8 host devices; on fewer devices (2 GPUs) the outer axes
  shrink first, so the inner ones (heads, ring) stay split."""
  shape = list(shape)
  while np.prod(shape) > jax.device_count():
    shape[next(i for i, d in enumerate(shape) if d > 1)] //= 2
  return jax.make_mesh(tuple(shape), names, axis_types=(axis_type,) * len(names))


def _dtype() -> str:
  """float32 on the CPU kernel; the GPU kernels take bfloat16 / float16 only."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


# Relative L2 distance allowed between a sharded call and the unsharded one: the ring merges
# per-block outputs that the kernel rounded to the input dtype.
_VS_UNSHARDED = {"float32": 1e-5, "bfloat16": 1e-2}


def _normal(rng, *shape, dtype=None):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype or _dtype())


def _collectives(jitted, *args) -> set:
  text = jitted.lower(*args).compile().as_text()
  return {c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", text)}


def _attention_case(rng, b, t, s, n, k, h, *, lengths=False):
  q, kk, v = _normal(rng, b, t, n, h), _normal(rng, b, s, k, h), _normal(rng, b, s, k, h)
  dout = _normal(rng, b, t, n, h)
  q_lens = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32) if lengths else None
  kv_lens = jnp.asarray(rng.integers(1, s + 1, b), jnp.int32) if lengths else None
  return q, kk, v, dout, q_lens, kv_lens


def _loss_and_grads(attention, dout):
  """The attention output and the gradient of <out, dout> wrt q, k, v (so dout is the cotangent
  the reference's backward takes)."""
  def loss(q, k, v, *rest):
    return jnp.sum(attention(q, k, v, *rest) * dout)
  return attention, jax.grad(loss, argnums=(0, 1, 2))


def _assert_matches_reference(out, grads, q, k, v, dout, **kw):
  want_out, _ = reference.attention_forward_f64(as_f64(q), as_f64(k), as_f64(v), **kw)
  np.testing.assert_allclose(as_f64(out), want_out, atol=OUT_ATOL[_dtype()], rtol=0)
  want_grads = reference.attention_backward_f64(as_f64(q), as_f64(k), as_f64(v), as_f64(dout),
                                                **kw)[:3]
  for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
    error = relative_l2(got, want)
    assert error < GRAD_REL[_dtype()], f"{name} relative L2 error {error}"


def _assert_close_to_unsharded(got, want, what):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    error = relative_l2(g, as_f64(w))
    assert error < _VS_UNSHARDED[_dtype()], f"{what}: relative L2 to unsharded {error}"


def _sharded_case(mesh, q_spec, kv_spec, *, n, k, is_causal=False, lengths=False, b=4, t=32,
                  h=16, allowed=frozenset()):
  """flash_attention under jit with NamedSharding inputs == unsharded == reference, and the
  compiled forward and backward contain no collectives beyond `allowed`."""
  rng = _rng()
  q, kk, v, dout, q_lens, kv_lens = _attention_case(rng, b, t, t, n, k, h, lengths=lengths)
  attention = functools.partial(jax_flash.flash_attention, is_causal=is_causal)
  def call(q, k, v, q_lens, kv_lens):
    return attention(q, k, v, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
  forward, grads = _loss_and_grads(call, dout)
  plain = (q, kk, v, q_lens, kv_lens)
  want_out, want_grads = forward(*plain), grads(*plain)
  put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
  sharded = (put(q, q_spec), put(kk, kv_spec), put(v, kv_spec), put(q_lens, P(q_spec[0])),
             put(kv_lens, P(q_spec[0])))
  jit_forward, jit_grads = jax.jit(forward), jax.jit(grads)
  out, got_grads = jit_forward(*sharded), jit_grads(*sharded)
  _assert_close_to_unsharded((out, got_grads), (want_out, want_grads), "sharded call")
  _assert_matches_reference(out, got_grads, q, kk, v, dout, q_seqlens=q_lens, kv_seqlens=kv_lens,
                            scale=1 / np.sqrt(h), is_causal=is_causal)
  for what, jitted in (("forward", jit_forward), ("backward", jit_grads)):
    found = _collectives(jitted, *sharded)
    assert found <= set(allowed), f"{what} HLO has collectives {sorted(found - set(allowed))}"
  assert _split_axes(out.sharding.spec, mesh) == _split_axes(q_spec, mesh), (
      f"output sharded {out.sharding.spec}, query {q_spec}")


def _split_axes(spec, mesh):
  """Per dim of a 4-D array, the mesh axes of size > 1 splitting it."""
  entries = tuple(spec) + (None,) * (4 - len(tuple(spec)))
  as_tuple = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
  return tuple(tuple(a for a in as_tuple(e) if mesh.shape[a] > 1) for e in entries)


# -- the checks ----------------------------------------------------------------------------------

@_check
def batch_and_heads_no_collectives():
  _sharded_case(_mesh(), P("x", None, "y"), P("x", None, "y"), n=8, k=8, lengths=True)


@_check
def gqa_heads_split_with_groups_whole():
  # kv heads 4 over y (4 devices): one kv head and its 2 query heads per device.
  _sharded_case(_mesh(), P("x", None, "y"), P("x", None, "y"), n=8, k=4, is_causal=True)


@_check
def gqa_heads_compound_factor():
  # kv heads divisible by the whole mesh: Shardy links query and kv heads as (kv_heads, group).
  _sharded_case(_mesh((8,), ("x",)), P(None, None, "x"), P(None, None, "x"), n=16, k=8, b=2,
                h=8)


@_check
def gqa_heads_that_would_split_a_group_are_gathered():
  # 2 kv heads cannot be split 4 ways: heads are gathered, the answer stays right.
  _sharded_case(_mesh(), P("x", None, "y"), P("x"), n=8, k=2, allowed={"all-gather"})


@_check
def broadcast_bias_and_mask_follow_batch_and_heads():
  rng, mesh = _rng(), _mesh()
  b, t, n, h = 4, 24, 8, 16
  q, k, v, dout, _, _ = _attention_case(rng, b, t, t, n, n, h)
  bias = _normal(rng, 1, n, t, t, dtype="float32")
  mask = jnp.asarray(rng.random((b, 1, 1, t)) > 0.3).at[:, :, :, 0].set(True)
  forward, grads = _loss_and_grads(
      lambda q, k, v, bias, mask: jax_flash.flash_attention(q, k, v, bias, mask), dout)
  plain = (q, k, v, bias, mask)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  qkv = NamedSharding(mesh, P("x", None, "y"))
  sharded = (*(jax.device_put(x, qkv) for x in (q, k, v)), put(bias, P(None, "y")),
             put(mask, P("x")))
  jit_forward, jit_grads = jax.jit(forward), jax.jit(grads)
  out, got_grads = jit_forward(*sharded), jit_grads(*sharded)
  _assert_close_to_unsharded((out, got_grads), (forward(*plain), grads(*plain)), "bias/mask")
  _assert_matches_reference(out, got_grads, q, k, v, dout, bias=np.asarray(bias),
                            mask=np.asarray(mask), scale=1 / np.sqrt(h))
  for what, jitted in (("forward", jit_forward), ("backward", jit_grads)):
    assert not _collectives(jitted, *sharded), f"{what} HLO has collectives"


@_check
def ring_causal_zigzag_auto():
  _sharded_case(_mesh((8,), ("x",)), P(None, "x"), P(None, "x"), n=4, k=2, is_causal=True,
                lengths=True, b=2, t=48, allowed={"collective-permute"})


@_check
def ring_noncausal_auto_with_batch_axis():
  _sharded_case(_mesh(), P("x", "y"), P("x", "y"), n=4, k=4, lengths=True, t=36,
                allowed={"collective-permute"})


@_check
def ring_over_two_mesh_axes_with_head_split():
  _sharded_case(_mesh((2, 2, 2), ("x", "y", "z")), P(None, ("x", "y"), "z"),
                P(None, ("x", "y"), "z"), n=4, k=2, is_causal=True, b=2, t=40,
                allowed={"collective-permute"})


@_check
def sequence_split_with_a_bias_is_gathered():
  rng, mesh = _rng(), _mesh((8,), ("x",))
  q, k, v, dout, _, _ = _attention_case(rng, 2, 16, 16, 4, 4, 8)
  bias = _normal(rng, 1, 4, 16, 16, dtype="float32")
  forward, grads = _loss_and_grads(
      lambda q, k, v: jax_flash.flash_attention(q, k, v, bias, is_causal=True), dout)
  seq = NamedSharding(mesh, P(None, "x"))
  sharded = tuple(jax.device_put(x, seq) for x in (q, k, v))
  got = (jax.jit(forward)(*sharded), jax.jit(grads)(*sharded))
  _assert_close_to_unsharded(got, (forward(q, k, v), grads(q, k, v)), "gathered sequence")


@_check
def vmap_jit_and_sharding_together():
  rng, mesh = _rng(), _mesh()
  shape = (2, 2, 16, 4, 8)  # [V, B, T, N, H]; the vmapped axis is sharded over x, heads over y
  q, k, v, dout = (_normal(rng, *shape) for _ in range(4))
  vmapped = jax.vmap(functools.partial(jax_flash.flash_attention, is_causal=True))
  forward, grads = _loss_and_grads(vmapped, dout)
  spec = NamedSharding(mesh, P("x", None, None, "y"))
  sharded = tuple(jax.device_put(x, spec) for x in (q, k, v))
  jit_forward, jit_grads = jax.jit(forward), jax.jit(grads)
  got = (jit_forward(*sharded), jit_grads(*sharded))
  _assert_close_to_unsharded(got, (forward(q, k, v), grads(q, k, v)), "vmap")
  for jitted in (jit_forward, jit_grads):
    assert not _collectives(jitted, *sharded)


@_check
def explicit_axes_mesh():
  mesh = _mesh(axis_type=AxisType.Explicit)
  _sharded_case(mesh, P("x", None, "y"), P("x", None, "y"), n=4, k=4)
  _sharded_case(mesh, P(None, "y"), P(None, "y"), n=4, k=2, is_causal=True,
                allowed={"collective-permute"})


def _explicit_ring(layout: str, is_causal: bool):
  # A 4-device ring over y; the batch is split over x (sequence lengths with it).
  rng, mesh = _rng(), _mesh((2, 4), ("x", "y"))
  shards, b, t, n, k, h = mesh.shape["y"], 2, 48, 4, 2, 8
  q, kk, v, dout, q_lens, kv_lens = _attention_case(rng, b, t, t, n, k, h, lengths=True)
  local = functools.partial(ring.ring_attention, axis_name="y", is_causal=is_causal,
                            layout=layout)
  seq = P("x", "y")
  mapped = jax.shard_map(
      lambda q, k, v, ql, kl: local(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl),
      mesh=mesh, in_specs=(seq, seq, seq, P("x"), P("x")), out_specs=seq)
  to, back = (functools.partial(f, num_shards=shards, layout=layout)
              for f in (ring.to_layout, ring.from_layout))
  natural = lambda q, k, v: back(mapped(to(q), to(k), to(v), q_lens, kv_lens))
  forward, grads = _loss_and_grads(natural, dout)
  out, got_grads = jax.jit(forward)(q, kk, v), jax.jit(grads)(q, kk, v)
  _assert_matches_reference(out, got_grads, q, kk, v, dout, q_seqlens=q_lens,
                            kv_seqlens=kv_lens, scale=1 / np.sqrt(h), is_causal=is_causal)
  found = _collectives(jax.jit(lambda q, k, v: mapped(q, k, v, q_lens, kv_lens)),
                       to(q), to(kk), to(v))
  assert found <= {"collective-permute"}, f"ring forward HLO has {sorted(found)}"


@_check
def explicit_ring_zigzag_causal():
  _explicit_ring("zigzag", True)


@_check
def explicit_ring_contiguous_causal():
  _explicit_ring("contiguous", True)


@_check
def explicit_ring_zigzag_noncausal():
  _explicit_ring("zigzag", False)


@_check
def gspmd_partitioner():
  # Last: it switches the partitioner for the rest of the process.
  jax.config.update("jax_use_shardy_partitioner", False)
  mesh = _mesh()
  _sharded_case(mesh, P("x", None, "y"), P("x", None, "y"), n=8, k=4)
  _sharded_case(mesh, P(None, "y"), P(None, "y"), n=4, k=4, is_causal=True,
                allowed={"collective-permute"})


def _run_checks():
  results = {"_devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
  for name, check in _CHECKS.items():
    try:
      check()
      results[name] = "ok"
    except Exception:  # noqa: BLE001  (reported to the parent test, traceback and all)
      results[name] = traceback.format_exc()
  print(_RESULT_MARKER + json.dumps(results))


# -- the pytest side -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def multi_device_results(rng):
  seed = int(rng.integers(2**31))
  import_root = os.path.dirname(os.path.dirname(os.path.abspath(jax_flash.__file__)))
  env = dict(os.environ, JAX_FLASH_SEED=str(os.environ.get("JAX_FLASH_SEED", seed)),
             PYTHONPATH=os.pathsep.join([import_root, *sys.path]))
  if len(jax.devices("gpu") if jax.default_backend() == "gpu" else ()) < 2:
    env["JAX_PLATFORMS"] = "cpu"  # 8 host devices; with 2+ GPUs the checks run on the GPUs
  run = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                       capture_output=True, text=True, timeout=600)
  lines = [l for l in run.stdout.splitlines() if l.startswith(_RESULT_MARKER)]
  assert lines, f"the multi-device subprocess failed (rc {run.returncode}):\n{run.stderr[-6000:]}"
  results = json.loads(lines[-1][len(_RESULT_MARKER):])
  print(f"multi-device checks ran on {results['_devices']}")
  return results


@pytest.fixture(scope="module")
def rng():
  seed = int(os.environ.get("JAX_FLASH_SEED", int.from_bytes(os.urandom(4), "little")))
  print(f"seed={seed}")
  return np.random.default_rng(seed)


@pytest.mark.parametrize("name", list(_CHECKS))
def test_on_multiple_devices(multi_device_results, name):
  assert multi_device_results[name] == "ok", multi_device_results[name]


# -- single-process checks: argument validation and the layout helpers ---------------------------

def _qkv(t=8, s=8):
  return jnp.ones((1, t, 2, 8)), jnp.ones((1, s, 2, 8)), jnp.ones((1, s, 2, 8))


@pytest.mark.parametrize("kwargs, argument", [
    (dict(layout="striped"), "layout"),
    (dict(is_causal=1), "is_causal"),
    (dict(axis_name=3), "axis_name"),
    (dict(query_seq_lengths=jnp.ones((2,), jnp.int32)), "query_seq_lengths"),
])
def test_ring_attention_rejects_bad_arguments(kwargs, argument):
  kwargs = dict(dict(axis_name="x"), **kwargs)
  with pytest.raises(ValueError, match=argument):
    ring.ring_attention(*_qkv(), **kwargs)


def test_ring_attention_rejects_bad_block_lengths():
  with pytest.raises(ValueError, match="zigzag"):
    ring.ring_attention(*_qkv(t=7, s=7), axis_name="x")
  with pytest.raises(ValueError, match="is_causal"):
    ring.ring_attention(*_qkv(t=8, s=6), axis_name="x", is_causal=True)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_layout_round_trip(rng, layout):
  x = jnp.asarray(rng.standard_normal((2, 24, 3)))
  there = ring.to_layout(x, 3, layout)
  np.testing.assert_array_equal(ring.from_layout(there, 3, layout), x)
  if layout == "zigzag":  # device 0 holds chunks 0 and 5 of 6, device 1 chunks 1 and 4, ...
    chunks = np.arange(24).reshape(6, 4)
    want = np.concatenate([chunks[c] for c in (0, 5, 1, 4, 2, 3)])
    np.testing.assert_array_equal(there[0, :, 0], x[0, want, 0])


if __name__ == "__main__":
  _run_checks()
