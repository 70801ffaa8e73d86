"""The compiled extension at the raw FFI level: target registration, and the CPU targets called
directly with jax.ffi.ffi_call exactly as docs/architecture.md specifies, against the float64
reference. (tests/test_attention.py covers the same kernel through the public API.)"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import _extension
from jax_flash import _jax_flash_ext
from attention_cases import (GRAD_REL, OUT_ATOL, Case, as_f64, make_inputs, reference_backward,
                             reference_forward, relative_l2)


@pytest.fixture(autouse=True)
def _on_the_host():
  """These tests call the CPU targets directly: run them on the host device on any machine."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield

DUMMY = (1, 1, 1, 1)


# -- registration ------------------------------------------------------------------------------

def test_targets_are_registered_for_their_platform():
  targets = _jax_flash_ext.targets()
  assert targets["jax_flash_cpu_fwd"][0] == "cpu"
  assert targets["jax_flash_cpu_bwd"][0] == "cpu"
  assert {"jax_flash_cpu_fwd", "jax_flash_cpu_bwd"} <= _extension.available_targets("cpu")
  cuda = {name for name, (platform, _) in targets.items() if platform == "CUDA"}
  assert _extension.available_targets("gpu") == cuda
  assert _extension.available_targets("cuda") == cuda
  assert not cuda or _extension.has_cuda()


def test_register_targets_is_idempotent():
  before = _extension.available_targets("cpu")
  _extension.register_targets()
  _extension.register_targets()
  assert _extension.available_targets("cpu") == before


def test_unknown_platform_is_a_value_error():
  with pytest.raises(ValueError, match="platform"):
    _extension.available_targets("tpu")


# -- direct calls of the CPU targets --------------------------------------------------------------

def _attributes(case: Case, has_bias: bool, has_mask: bool) -> dict:
  left, right = case.window if case.window is not None else (-1, -1)
  return dict(scale=np.float32(case.scale if case.scale is not None else 1 / np.sqrt(case.h)),
              softcap=np.float32(case.softcap or 0.0), is_causal=case.is_causal,
              window_left=np.int32(left), window_right=np.int32(right), has_bias=has_bias,
              has_mask=has_mask, deterministic=False)


def _standard_inputs(case: Case, x):
  """The 7 inputs; absent bias / mask become dummies holding values that would poison the
  result if the kernel read them."""
  bias = x.bias if x.bias is not None else jnp.full(DUMMY, jnp.nan, jnp.float32)
  mask = x.mask if x.mask is not None else jnp.zeros(DUMMY, jnp.bool_)
  q_lens = x.q_lens if x.q_lens is not None else jnp.full((case.b,), case.t, jnp.int32)
  kv_lens = x.kv_lens if x.kv_lens is not None else jnp.full((case.b,), case.s, jnp.int32)
  return (x.q, x.k, x.v, bias, mask, q_lens, kv_lens)


def raw_forward(case: Case, x):
  outputs = (jax.ShapeDtypeStruct(x.q.shape, x.q.dtype),
             jax.ShapeDtypeStruct((case.b, case.n, case.t), jnp.float32))
  call = jax.ffi.ffi_call("jax_flash_cpu_fwd", outputs)
  return call(*_standard_inputs(case, x), **_attributes(case, x.bias is not None,
                                                       x.mask is not None))


def raw_backward(case: Case, x, out, lse, dout):
  dbias_shape = (case.b, case.n, case.t, case.s) if x.bias is not None else DUMMY
  outputs = (jax.ShapeDtypeStruct(x.q.shape, x.q.dtype),
             jax.ShapeDtypeStruct(x.k.shape, x.k.dtype),
             jax.ShapeDtypeStruct(x.v.shape, x.v.dtype),
             jax.ShapeDtypeStruct(dbias_shape, jnp.float32))
  call = jax.ffi.ffi_call("jax_flash_cpu_bwd", outputs)
  return call(*_standard_inputs(case, x), out, lse, dout,
              **_attributes(case, x.bias is not None, x.mask is not None))


def check_forward(case: Case, x):
  out, lse = raw_forward(case, x)
  want_out, want_lse = reference_forward(case, x)
  np.testing.assert_allclose(as_f64(out), want_out, rtol=0, atol=OUT_ATOL[case.dtype])
  lse = np.asarray(lse, np.float64)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
  return out, lse


def check_backward(case: Case, x, rng):
  out, lse = raw_forward(case, x)
  dout = jnp.asarray(rng.standard_normal(x.q.shape), jnp.float32).astype(case.dtype)
  got = raw_backward(case, x, out, lse, dout)
  want = reference_backward(case, x, dout)
  names = ("dq", "dk", "dv", "dbias") if x.bias is not None else ("dq", "dk", "dv")
  for name, g, w in zip(names, got, want):
    error = relative_l2(g, w)
    assert error < GRAD_REL[case.dtype], f"{name}: relative L2 error {error:.2e}"
  return got


FORWARD_CASES = [
    Case(b=1, t=1, s=1, n=1, k=1, h=1),
    Case(b=2, t=97, s=130, n=4, k=2, h=64),
    Case(b=1, t=17, s=1000, n=6, k=2, h=33, is_causal=True),
    Case(b=1, t=150, s=97, n=2, k=2, h=17, window=(20, 5)),
    Case(b=2, t=70, s=90, n=2, k=1, h=80, bias=("b", "1", "t", "s"), mask=("1", "n", "1", "s"),
         seqlens=True),
    Case(b=2, t=70, s=90, n=2, k=1, h=48, bias=("1", "n", "t", "1"), mask=("b", "1", "t", "s"),
         softcap=5.0, is_causal=True),
    Case(b=1, t=65, s=65, n=3, k=1, h=256, softcap=2.0, window=(0, 0)),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_forward_matches_reference(case, dtype, rng):
  case = dataclasses.replace(case, dtype=dtype)
  check_forward(case, make_inputs(case, rng))


GRAD_CASES = [
    Case(b=2, t=17, s=23, n=4, k=2, h=32),
    Case(b=1, t=130, s=97, n=4, k=1, h=64, is_causal=True),
    Case(b=1, t=45, s=200, n=2, k=2, h=19, window=(7, 70)),
    Case(b=2, t=31, s=70, n=2, k=2, h=64, bias=("1", "n", "t", "s"), mask=("b", "1", "t", "s"),
         seqlens=True),
    Case(b=1, t=33, s=40, n=2, k=1, h=128, softcap=4.0, bias=("b", "1", "1", "s")),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_backward_matches_reference(case, dtype, rng):
  case = dataclasses.replace(case, dtype=dtype)
  check_backward(case, make_inputs(case, rng), rng)


@pytest.mark.parametrize("variant", _jax_flash_ext.cpu_kernel_variants())
def test_every_instruction_set_variant(variant, rng):
  case = Case(b=2, t=100, s=77, n=4, k=2, h=40, is_causal=True, bias=("1", "n", "t", "s"),
              mask=("b", "1", "1", "s"), softcap=6.0, seqlens=True)
  x = make_inputs(case, rng)
  best = _jax_flash_ext.cpu_kernel_variant()
  try:
    _jax_flash_ext.set_cpu_kernel_variant(variant)
    assert _jax_flash_ext.cpu_kernel_variant() == variant
    check_forward(case, x)
    check_backward(case, x, rng)
  finally:
    _jax_flash_ext.set_cpu_kernel_variant(best)


def test_unknown_variant_is_refused():
  with pytest.raises(ValueError, match="variant"):
    _jax_flash_ext.set_cpu_kernel_variant("sse9")


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_grads(rng):
  case = Case(b=2, t=40, s=40, n=2, k=1, h=16, mask=("b", "1", "t", "s"))
  x = make_inputs(case, rng)
  mask = np.array(x.mask)
  mask[0, 0, 3, :] = False           # one row with no kept key
  mask[1, 0, :, :] = False           # a whole sequence
  x.mask = jnp.asarray(mask)
  x.q_lens = jnp.asarray([30, 40], jnp.int32)  # rows past the query length
  x.kv_lens = jnp.asarray([40, 40], jnp.int32)
  out, lse = check_forward(case, x)
  dead = [(0, 3), *[(0, t) for t in range(30, 40)], *[(1, t) for t in range(40)]]
  for b, t in dead:
    assert np.all(np.asarray(out)[b, t] == 0)
    assert np.all(np.isneginf(lse[b, :, t]))
  dq, dk, dv = check_backward(case, x, rng)[:3]
  for b, t in dead:
    assert np.all(np.asarray(dq)[b, t] == 0)
  assert np.all(np.asarray(dk)[1] == 0) and np.all(np.asarray(dv)[1] == 0)


def test_backward_is_deterministic(rng):
  case = Case(b=1, t=300, s=300, n=4, k=1, h=64, bias=("1", "1", "t", "s"))
  x = make_inputs(case, rng)
  out, lse = raw_forward(case, x)
  dout = jnp.asarray(rng.standard_normal(x.q.shape), jnp.float32)
  first = raw_backward(case, x, out, lse, dout)
  second = raw_backward(case, x, out, lse, dout)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- bad buffers: an FFI error naming the buffer ---------------------------------------------------

def _call_with(case: Case, x, **attrs):
  outputs = (jax.ShapeDtypeStruct(x.q.shape, x.q.dtype),
             jax.ShapeDtypeStruct((case.b, case.n, case.t), jnp.float32))
  call = jax.ffi.ffi_call("jax_flash_cpu_fwd", outputs)
  return jax.block_until_ready(call(*_standard_inputs(case, x), **attrs))


@pytest.mark.parametrize("broken, message", [
    ("k_head_dim", "`k` has shape"),
    ("kv_heads", "must divide the query heads"),
    ("v_shape", "`v` has shape"),
    ("bias_shape", "`bias` has shape"),
    ("mask_dtype", "`mask` must have dtype bool"),
    ("seqlens_shape", "`q_seqlens` has shape"),
    ("head_dim_300", "head dims 1..256"),
    ("window", "`window_left` must be >= -1"),
])
def test_bad_buffers_raise_an_error_naming_them(broken, message, rng):
  case = Case(b=2, t=8, s=8, n=4, k=2, h=16, bias=("1", "1", "t", "s"), mask=("1", "1", "t", "s"))
  if broken == "head_dim_300":
    case = Case(b=1, t=4, s=4, n=1, k=1, h=300)
  x = make_inputs(case, rng)
  attrs = _attributes(case, case.bias is not None, case.mask is not None)
  if broken == "k_head_dim":
    x.k = x.k[..., :8]
  elif broken == "kv_heads":
    x.k = x.v = jnp.zeros((2, 8, 3, 16), x.q.dtype)
  elif broken == "v_shape":
    x.v = x.v[:, :5]
  elif broken == "bias_shape":
    x.bias = jnp.zeros((1, 1, 3, 8), jnp.float32)
  elif broken == "mask_dtype":
    x.mask = x.mask.astype(jnp.int8)
  elif broken == "seqlens_shape":
    x.q_lens = jnp.full((3,), 8, jnp.int32)
  elif broken == "window":
    attrs["window_left"] = np.int32(-2)
  with pytest.raises(Exception, match=message):
    _call_with(case, x, **attrs)
