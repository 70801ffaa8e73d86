"""The shared test base: every schedule runs through these cases against the float64 reference.

A schedule that cannot run here (no GPU, not built) is skipped with its reason; a case outside a
schedule's envelope (dtype, head dim, feature) is skipped with the schedule's own reason, so the
skips list exactly what each kernel does not cover.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import reference
from jax_flash._validate import build_config
from jax_flash.schedules import registered
from attention_cases import (GRAD_REL, OUT_ATOL, Case, as_f64, make_inputs, reference_backward,
                             reference_forward, relative_l2)

SCHEDULES = sorted(registered())
# Short-query schedules (decode) only take calls with few query rows; the base still runs them.

FORWARD_CASES = [
    # odd sizes
    Case(b=1, t=1, s=1, n=1, k=1, h=8),
    Case(b=2, t=17, s=17, n=4, k=2, h=32),
    Case(b=1, t=97, s=55, n=6, k=3, h=64),
    Case(b=1, t=1030, s=1030, n=2, k=1, h=64),
    Case(b=1, t=40, s=1100, n=2, k=2, h=64, is_causal=True),
    # v3's 192-row head dim 64 tile alone (non-causal, 12 heads: one round on an H200's 132 SMs)
    Case(b=1, t=2100, s=300, n=12, k=2, h=64),
    # ... and for rows [0, 1152) only, the rest on the 128-row tile in a second launch (132
    # heads); query lengths that end a sequence in either part
    Case(b=2, t=1252, s=100, n=66, k=6, h=64, seqlens=True),
    # v3's 192-row head dim 128 tile (non-causal, >= 4096 rows, keys that 80-key blocks do not
    # pad more than 128-key ones): alone (6 heads: one round on an H200's 132 SMs), and for rows
    # [0, 3840) only, the rest on the 128-row tile in a second launch (66 heads)
    Case(b=1, t=4096, s=160, n=6, k=2, h=128),
    Case(b=1, t=4096, s=80, n=66, k=6, h=128),
    # v3 in clusters of two CTAs sharing K / V loads (an even number of 128-row m-blocks; these
    # non-causal, the causal ones in test_v3_long_causal_rows_match_float64): GQA at head dims 64
    # and 128, keys not a multiple of the key block, sequence lengths (a tile without rows beside
    # one with rows runs masked)
    Case(b=2, t=256, s=300, n=4, k=2, h=128),
    Case(b=2, t=256, s=130, n=2, k=1, h=64),
    Case(b=1, t=512, s=200, n=2, k=2, h=256),
    Case(b=4, t=256, s=200, n=2, k=1, h=128, seqlens=True),
    # head dims 8..256, including ones that are not a multiple of 8
    Case(b=1, t=33, s=40, n=2, k=2, h=20),
    Case(b=1, t=33, s=40, n=2, k=1, h=72),
    Case(b=1, t=33, s=40, n=2, k=2, h=128),
    Case(b=1, t=33, s=40, n=2, k=2, h=256),
    # GQA ratios
    Case(b=2, t=17, s=97, n=8, k=1, h=64),
    Case(b=1, t=17, s=31, n=6, k=2, h=64),
    # features
    Case(is_causal=True, t=97, s=97, h=64),
    Case(is_causal=True, t=50, s=97, h=64),
    Case(window=(5, 3), t=97, s=97, h=64),
    Case(window=(0, 0), t=20, s=20, h=32),
    Case(is_causal=True, window=(16, 0), t=97, s=97, h=64),
    Case(bias=("1", "n", "t", "s"), t=31, s=45, h=64),
    Case(bias=("b", "1", "1", "s"), t=31, s=45, h=64),
    Case(mask=("b", "1", "t", "s"), t=31, s=45, h=64),
    Case(mask=("1", "1", "t", "s"), bias=("b", "n", "t", "s"), is_causal=True, t=45, s=45, h=64),
    Case(seqlens=True, t=40, s=70, h=64),
    Case(seqlens=True, is_causal=True, t=70, s=70, h=64),
    Case(softcap=5.0, t=33, s=40, h=64),
    Case(softcap=3.0, bias=("1", "1", "t", "s"), is_causal=True, t=33, s=33, h=64),
    Case(scale=0.5, t=17, s=20, h=64),
]
DTYPES = ("float32", "bfloat16", "float16")

GRAD_CASES = [
    Case(b=2, t=17, s=23, n=4, k=2, h=32),
    Case(b=1, t=97, s=97, n=2, k=1, h=64, is_causal=True),
    Case(b=1, t=45, s=60, n=4, k=4, h=64, window=(7, 2)),
    Case(b=2, t=31, s=31, n=2, k=2, h=64, bias=("1", "n", "t", "s"), mask=("b", "1", "t", "s")),
    Case(b=2, t=33, s=40, n=2, k=1, h=128, seqlens=True),
    Case(b=1, t=33, s=40, n=2, k=2, h=64, softcap=4.0, bias=("b", "1", "1", "s")),
    Case(b=1, t=1030, s=1030, n=1, k=1, h=32, is_causal=True),
    Case(b=1, t=17, s=17, n=2, k=2, h=20),
    Case(b=1, t=77, s=77, n=4, k=2, h=128, is_causal=True, softcap=5.0),
    # head dim 256: v3's backward splits the head dim of a 64-key block over its two warpgroups
    Case(b=1, t=33, s=40, n=2, k=1, h=256),
    Case(b=2, t=130, s=130, n=4, k=2, h=256, is_causal=True, seqlens=True),
    Case(b=1, t=97, s=97, n=2, k=2, h=256, window=(20, 5), softcap=4.0),
]


def _require(schedule: str, case: Case, deterministic: bool = False):
  """Skip when the schedule cannot run here or does not cover this case; returns nothing."""
  status = {s.name: s for s in jax_flash.schedules()}[schedule]
  if not status.available:
    pytest.skip(f"{schedule}: {status.reason}")
  x = jax.ShapeDtypeStruct((case.b, case.t, case.n, case.h), case.dtype)
  kv = jax.ShapeDtypeStruct((case.b, case.s, case.k, case.h), case.dtype)
  bias = jax.ShapeDtypeStruct(case.dims(case.bias), jnp.float32) if case.bias else None
  mask = jax.ShapeDtypeStruct(case.dims(case.mask), jnp.bool_) if case.mask else None
  shape, config = build_config(x, kv, kv, bias, mask, scale=case.scale, is_causal=case.is_causal,
                               query_seq_lengths=None, key_value_seq_lengths=None,
                               local_window_size=case.window, softcap=case.softcap,
                               deterministic=deterministic)
  reason = registered()[schedule].unsupported_reason(shape, case.dtype, config)
  if reason:
    pytest.skip(f"{schedule}: {reason}")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_forward_matches_float64(schedule, dtype, case, rng):
  case = dataclasses.replace(case, dtype=dtype)
  _require(schedule, case)
  _check_forward(schedule, case, make_inputs(case, rng))


def _check_forward(schedule: str, case: Case, x):
  """Runs the forward of `x` under jit and holds out and lse to the float64 reference."""
  statics = x.statics(case)
  out, lse = jax.jit(lambda q, k, v, **arrays: jax_flash.flash_attention(
      q, k, v, return_residual=True, schedule=schedule, **arrays, **statics))(
          x.q, x.k, x.v, **x.arrays())
  want_out, want_lse = reference_forward(case, x)
  assert out.shape == x.q.shape and out.dtype == x.q.dtype
  err = np.max(np.abs(as_f64(out) - want_out), initial=0.0)
  tol = OUT_ATOL[case.dtype]
  assert err <= tol, f"{case}: max abs error {err:.3g} > {tol}"
  lse = as_f64(jnp.transpose(lse, (0, 2, 1)))
  finite = np.isfinite(want_lse)
  np.testing.assert_array_equal(np.isfinite(lse), finite, err_msg="fully-masked rows differ")
  lse_tol = 4 * tol * max(1.0, np.max(np.abs(want_lse[finite]), initial=1.0))
  assert np.max(np.abs(lse[finite] - want_lse[finite]), initial=0.0) <= lse_tol


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [Case(t=300, s=300, n=2, k=1, h=128),
                                  Case(t=300, s=300, n=2, k=1, h=256, is_causal=True),
                                  Case(t=300, s=700, n=2, k=1, h=64)], ids=str)
@pytest.mark.parametrize("direction", ["rising", "falling"])
def test_row_maxima_that_move_along_the_keys_match_float64(schedule, dtype, case, direction,
                                                           rng):
  """Keys whose norms change along the sequence raise each row's running max, in the order a
  schedule visits the key blocks (v2 from the first, v3's forward from the last), by more than
  the conditional-rescaling bound (kRescaleThreshold = 8 in log2 units,
  cuda/softmax_constants.h) in some key blocks and by less in others: both the rescaling and
  the stale-max paths run (v3: P at the running max, and the fallback that takes the block's
  max when the sums of P reach 2^8), with probabilities up to 2^8."""
  case = dataclasses.replace(case, dtype=dtype)
  _require(schedule, case)
  x = make_inputs(case, rng)
  ends = (1.0, 12.0) if direction == "rising" else (12.0, 1.0)
  growth = jnp.linspace(*ends, case.s)[None, :, None, None]
  x = dataclasses.replace(x, k=(x.k.astype(jnp.float32) * growth).astype(dtype))
  _check_forward(schedule, case, x)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window_left=5, window_right=3),
                                dict(is_causal=True, q_seqlens=[40, 23])], ids=str)
def test_reference_of_a_row_slice_is_those_rows_of_the_whole(kw, rng):
  """reference's q_offset (rows given as a slice of their sequence) against the whole sequence's
  reference: what the long-sequence tests and the bench's check slices rely on."""
  q, k, v, dout = (rng.standard_normal((2, 48, 2, 8)) for _ in range(4))
  full_out, full_lse = reference.attention_forward_f64(q, k, v, scale=0.3, **kw)
  full_grads = reference.attention_backward_f64(q, k, v, dout, scale=0.3, **kw)
  rows = slice(20, 37)
  out, lse = reference.attention_forward_f64(q[:, rows], k, v, scale=0.3, q_offset=20, **kw)
  np.testing.assert_allclose(out, full_out[:, rows], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(lse, full_lse[:, :, rows], rtol=1e-12, atol=1e-12)  # -inf too
  dq = reference.attention_backward_f64(q[:, rows], k, v, dout[:, rows], scale=0.3, q_offset=20,
                                        **kw)[0]
  # dq of a row depends on that row alone; dk / dv sum over rows, so only dq compares.
  np.testing.assert_allclose(dq, full_grads[0][:, rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t,h", [(16384, 128), (4096, 128), (4096, 64), (2048, 256)])
def test_v3_long_causal_rows_match_float64(t, h, rng):
  """v3 under causal masking on long sequences, too long for the whole-matrix reference: rows at
  the start, the middle and the end against a float64 reference of those rows. These shapes run
  in clusters of two CTAs (use_cluster in cuda/v3_fwd_sm90.cu), whose longer tile of a band loads
  its last key blocks alone; 16384 rows at head dim 128 on the wide tile (alternative_rows)."""
  case = Case(b=1, t=t, s=t, n=1, k=1, h=h, dtype="bfloat16", is_causal=True)
  _require("v3", case)
  x = make_inputs(case, rng)
  out = jax.jit(lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=True,
                                                          schedule="v3"))(x.q, x.k, x.v)
  q, k, v = as_f64(x.q), as_f64(x.k), as_f64(x.v)
  for start in (0, case.t // 2 - 64, case.t - 128):
    want, _ = reference.attention_forward_f64(q[:, start:start + 128], k, v, is_causal=True,
                                              q_offset=start, scale=1 / np.sqrt(case.h))
    err = np.max(np.abs(as_f64(out[:, start:start + 128]) - want))
    assert err <= OUT_ATOL["bfloat16"], f"rows {start}..: max abs error {err:.3g}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_gradients_match_float64(schedule, dtype, case, rng):
  case = dataclasses.replace(case, dtype=dtype)
  _require(schedule, case)
  x = make_inputs(case, rng)
  dout = jnp.asarray(rng.standard_normal(x.q.shape), jnp.float32).astype(dtype)
  arrays = x.arrays()
  bias = arrays.pop("bias")
  statics = x.statics(case)

  grads = _gradients(schedule, case, x, dout)
  _assert_gradients_match(case, x, dout, grads)


def _gradients(schedule, case, x, dout, **options):
  """Gradients of sum(out * dout) w.r.t. q, k, v (and bias when the case has one)."""
  arrays = x.arrays()
  bias = arrays.pop("bias")
  statics = x.statics(case)

  def loss(q, k, v, bias):
    out = jax_flash.flash_attention(q, k, v, bias, schedule=schedule, **arrays, **statics,
                                    **options)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  return jax.jit(jax.grad(loss, argnums=argnums))(x.q, x.k, x.v, bias)


def _assert_gradients_match(case, x, dout, grads):
  dq, dk, dv, dbias_full = reference_backward(case, x, dout)
  wants = [dq, dk, dv]
  if x.bias is not None:
    axes = tuple(i for i, d in enumerate(x.bias.shape) if d == 1)
    wants.append(dbias_full.sum(axis=axes, keepdims=True))
  for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, wants):
    assert got.shape == want.shape, name
    rel = relative_l2(got, want)
    assert rel <= GRAD_REL[case.dtype], f"{case}: {name} relative L2 error {rel:.3g}"


# Many key blocks adding into the same dQ rows: where atomics would reorder the sums.
DETERMINISM_CASES = [
    Case(b=2, t=700, s=900, n=4, k=2, h=64, is_causal=True),
    Case(b=1, t=513, s=1030, n=2, k=2, h=128, seqlens=True, softcap=6.0),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("case", DETERMINISM_CASES, ids=str)
def test_deterministic_gradients_are_bitwise_repeatable(schedule, dtype, case, rng):
  case = dataclasses.replace(case, dtype=dtype)
  _require(schedule, case, deterministic=True)
  x = make_inputs(case, rng)
  dout = jnp.asarray(rng.standard_normal(x.q.shape), jnp.float32).astype(dtype)
  first = _gradients(schedule, case, x, dout, deterministic=True)
  _assert_gradients_match(case, x, dout, first)
  for _ in range(3):
    again = _gradients(schedule, case, x, dout, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
      np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                    np.asarray(b.astype(jnp.float32)), err_msg=name)


# The backend-generic API tests run in the widest dtype this backend's schedules take.
API_DTYPE = "float32" if jax.default_backend() == "cpu" else "float16"
API_ATOL = {"float32": 2e-5, "float16": 4e-3}[API_DTYPE]
# Batched and per-slice runs may differ in atomic summation order (GPU backward).
BATCH_ATOL = {"float32": 1e-5, "float16": 2e-3}[API_DTYPE]


def test_fully_masked_rows_are_zero(rng):
  case = Case(b=1, t=8, s=8, n=2, k=2, h=16, mask=("1", "1", "t", "s"), dtype=API_DTYPE)
  x = make_inputs(case, rng)
  mask = x.mask.at[0, 0, 3, :].set(False)
  out, lse = jax_flash.flash_attention(x.q, x.k, x.v, mask=mask, return_residual=True)
  np.testing.assert_array_equal(np.asarray(out[0, 3]), 0.0)
  assert np.all(np.isneginf(np.asarray(lse[0, 3])))
  grad = jax.grad(lambda q: jnp.sum(jax_flash.flash_attention(q, x.k, x.v, mask=mask)))(x.q)
  np.testing.assert_array_equal(np.asarray(grad[0, 3]), 0.0)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(is_causal=True), dict(local_window_size=(3, 1)), dict(scale=0.2),
], ids=str)
def test_agrees_with_jax_nn(kwargs, rng):
  case = Case(b=2, t=19, s=19, n=4, k=2, h=32, dtype=API_DTYPE)
  x = make_inputs(case, rng)
  bias = jnp.asarray(rng.standard_normal((1, 4, 19, 19)), jnp.float32)
  # Every row keeps its own key, which the window and causal masking keep too: no row is fully
  # masked, where jax.nn's mean of V and our 0 differ by design (docs/architecture.md). Column 0
  # alone left rows of the window case fully masked in ~1% of seeds (e.g. 1165838422).
  mask = jnp.asarray((rng.random((2, 1, 19, 19)) > 0.2) | np.eye(19, dtype=bool))
  f32 = [t.astype(jnp.float32) for t in (x.q, x.k, x.v)]
  want, want_lse = jax.nn.dot_product_attention(*f32, bias, mask, implementation="xla",
                                                return_residual=True, **kwargs)
  got, got_lse = jax_flash.flash_attention(x.q, x.k, x.v, bias, mask, return_residual=True,
                                           **kwargs)
  np.testing.assert_allclose(as_f64(got), np.asarray(want), atol=API_ATOL)
  np.testing.assert_allclose(as_f64(got_lse), np.asarray(want_lse), atol=4 * API_ATOL)


def _fused_forward_calls(hlo: str) -> int:
  return sum(hlo.count(f"@jax_flash_{name}_fwd(") for name in registered())


def test_vmap_is_one_batched_kernel_call(rng):
  case = Case(b=2, t=17, s=23, n=4, k=2, h=32, bias=("1", "n", "t", "s"), seqlens=True,
              dtype=API_DTYPE)
  xs = [make_inputs(case, rng) for _ in range(3)]
  q = jnp.stack([x.q for x in xs])
  k = jnp.stack([x.k for x in xs])
  bias = jnp.stack([x.bias for x in xs])
  v, q_lens = xs[0].v, xs[0].q_lens   # unbatched operands broadcast

  def f(q, k, bias):
    return jax_flash.flash_attention(q, k, v, bias, is_causal=True, query_seq_lengths=q_lens)

  got = jax.jit(jax.vmap(f))(q, k, bias)
  for i in range(3):
    np.testing.assert_allclose(as_f64(got[i]), as_f64(f(q[i], k[i], bias[i])), atol=BATCH_ATOL)
  hlo = jax.jit(jax.vmap(f)).lower(q, k, bias).as_text()
  assert _fused_forward_calls(hlo) == 1, hlo
  loss = lambda q: jnp.sum(jax.vmap(f)(q, k, bias).astype(jnp.float32) ** 2)
  grad = jax.grad(loss)(q)
  for i in range(3):
    want = jax.grad(lambda qi: jnp.sum(f(qi, k[i], bias[i]).astype(jnp.float32) ** 2))(q[i])
    np.testing.assert_allclose(as_f64(grad[i]), as_f64(want), atol=BATCH_ATOL * 10)


def _softcapped_causal(q, k, v, bias):
  return jax_flash.flash_attention(q, k, v, bias, is_causal=True, softcap=3.0)


@pytest.mark.skipif(API_DTYPE != "float32", reason="finite differences need float32 kernels")
def test_check_grads(rng):
  case = Case(b=1, t=9, s=11, n=2, k=1, h=8, bias=("1", "n", "t", "s"))
  x = make_inputs(case, rng)
  # f32 finite differences: a large step keeps rounding noise (~1e-7 |f| / eps) under the
  # tolerance, while a wrong gradient formula is off by O(1).
  check_grads(_softcapped_causal, (x.q, x.k, x.v, x.bias), order=1, modes=["rev"], eps=1e-2,
              atol=1e-2, rtol=1e-2)


def test_checkpoint_gives_the_same_gradients(rng):
  case = Case(b=1, t=9, s=11, n=2, k=1, h=8, bias=("1", "n", "t", "s"), dtype=API_DTYPE)
  x = make_inputs(case, rng)
  loss = lambda q, k, v, b: jnp.sum(_softcapped_causal(q, k, v, b).astype(jnp.float32) ** 2)
  for got, want in zip(jax.grad(jax.checkpoint(loss), (0, 1, 2, 3))(x.q, x.k, x.v, x.bias),
                       jax.grad(loss, (0, 1, 2, 3))(x.q, x.k, x.v, x.bias)):
    np.testing.assert_allclose(as_f64(got), as_f64(want), atol=BATCH_ATOL)


def test_schedules_lists_every_schedule_with_reasons():
  statuses = jax_flash.schedules()
  names = {s.name for s in statuses}
  assert "cpu" in names
  for s in statuses:
    assert s.available or s.reason, s
    assert str(s).startswith(s.name)
  if jax.default_backend() == "cpu":
    assert {s.name for s in statuses if s.available} == {"cpu"}


BAD_INPUTS = [
    (dict(q_shape=(2, 8, 4)), "query"),
    (dict(k_shape=(2, 8, 3, 16)), "key heads"),
    (dict(k_shape=(3, 8, 2, 16)), "key batch"),
    (dict(k_shape=(2, 8, 2, 8)), "key head dim"),
    (dict(v_shape=(2, 9, 2, 16)), "value"),
    (dict(dtype_k=jnp.float16), "share one dtype"),
    (dict(dtype=jnp.int32), "query dtype"),
    (dict(q_shape=(2, 8, 4, 300), k_shape=(2, 8, 2, 300), v_shape=(2, 8, 2, 300)), "head dim"),
    (dict(bias=jnp.zeros((2, 3, 8, 8))), "bias"),
    (dict(bias=jnp.zeros((8, 8))), "bias"),
    (dict(mask=jnp.ones((2, 4, 8, 8), jnp.float32)), "mask must be a boolean"),
    (dict(mask=jnp.ones((2, 4, 8, 7), bool)), "mask"),
    (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.ones((2,), jnp.float32)), "key_value_seq_lengths"),
    (dict(local_window_size=(-1, 2)), "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(scale=float("nan")), "scale"),
    (dict(schedule="v9"), "schedule"),
    (dict(is_causal="yes"), "is_causal"),
    (dict(deterministic=1), "deterministic"),
]


@pytest.mark.parametrize("spec,needle", BAD_INPUTS, ids=lambda x: str(x)[:40])
def test_bad_input_raises_value_error_naming_argument(spec, needle):
  spec = dict(spec)
  dtype = spec.pop("dtype", jnp.float32)
  q = jnp.zeros(spec.pop("q_shape", (2, 8, 4, 16)), dtype)
  k = jnp.zeros(spec.pop("k_shape", (2, 8, 2, 16)), spec.pop("dtype_k", dtype))
  v = jnp.zeros(spec.pop("v_shape", k.shape), k.dtype)
  with pytest.raises(ValueError, match=needle):
    jax_flash.flash_attention(q, k, v, **spec)


def test_unavailable_schedule_names_its_reason():
  unavailable = [s for s in jax_flash.schedules() if not s.available]
  if not unavailable:
    pytest.skip("every schedule is available here")
  q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=f"schedule={unavailable[0].name!r}"):
    jax_flash.flash_attention(q, q, q, schedule=unavailable[0].name)


def test_traced_scale_is_refused():
  q = jnp.zeros((1, 4, 1, 8))
  with pytest.raises(ValueError, match="scale"):
    jax.jit(lambda q, s: jax_flash.flash_attention(q, q, q, scale=s))(q, 0.5)


@pytest.mark.parametrize("capability,available", [((9, 0), True), ((8, 0), False),
                                                   ((10, 0), False), (None, False)])
def test_gpu_schedules_run_only_on_the_architectures_they_are_built_for(
    monkeypatch, capability, available):
  from jax_flash.schedules import base
  v3 = registered()["v3"]
  monkeypatch.setattr(base.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(base._extension, "available_targets",
                      lambda platform: frozenset({v3.forward_target, v3.backward_target}))
  monkeypatch.setattr(base, "_device_compute_capability", lambda: capability)
  reason = v3.unavailable_reason()
  assert (reason is None) == available, reason
  if not available:
    assert "compute capability 9.0" in reason


@pytest.mark.parametrize("schedule,head_dim,repeatable", [
    ("cpu", 64, True), ("v1", 64, True), ("v2", 64, False), ("v3", 128, True),
    ("v3", 256, True), ("decode", 64, True), ("decode", 256, True)])
def test_deterministic_calls_go_only_to_repeatable_backwards(schedule, head_dim, repeatable):
  from jax_flash._config import AttentionConfig, AttentionShape
  shape = AttentionShape(1, 1, 64, 2, 1, head_dim)
  dtype = jnp.float32 if schedule == "cpu" else jnp.bfloat16
  chosen = registered()[schedule]
  assert chosen.unsupported_reason(shape, dtype, AttentionConfig(scale=1.0)) is None
  reason = chosen.unsupported_reason(shape, dtype, AttentionConfig(scale=1.0, deterministic=True))
  assert (reason is None) == repeatable, reason
  if reason:
    assert "deterministic=True" in reason and "atomics" in reason
