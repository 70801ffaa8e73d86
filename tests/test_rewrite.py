"""jax_flash.fuse / explain: every recognized spelling of attention is fused and computes the same
function (forward and gradient); every near miss is left exactly as it was, with the reason.

Each spelling is a plain function of BTNH arrays; "the same function" is checked against the
unfused original on fresh random data (the `rng` fixture), in float32 unless the spelling is
about dtypes. Shapes are small and odd (T=13, S=17) to keep the CPU run short.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_flash
from jax_flash.rewrite import explain, fuse

B, T, S, N, K, H = 2, 13, 17, 4, 2, 8
ATOL = 2e-5


def _bnth(x):
  return x.transpose(0, 2, 1, 3)


def _scores(q, k):
  return jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])


def _pv(p, v):
  return jnp.einsum("bnts,bsnh->btnh", p, v)


def _causal_tril(t, s):
  return jnp.tril(jnp.ones((t, s), bool))


# ---- the spellings: each computes softmax(scale * q k^T + bias, masked) v ----

def einsum_tril_where_inf(q, k, v):
  s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  s = jnp.where(_causal_tril(q.shape[1], k.shape[1]), s, -jnp.inf)
  return _pv(jax.nn.softmax(s, axis=-1), v)


def matmul_swapaxes_prescaled_q_written_softmax(q, k, v):
  q, k, v = _bnth(q), _bnth(k), _bnth(v)
  s = (q * q.shape[-1] ** -0.5) @ jnp.swapaxes(k, -1, -2)
  e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  return _bnth((e / jnp.sum(e, axis=-1, keepdims=True)) @ v)


def scale_split_across_q_and_k(q, k, v):
  d = q.shape[-1]
  s = jnp.einsum("btnh,bsnh->bnts", q / d ** 0.25, k * d ** -0.25)
  return _pv(jax.nn.softmax(s), v)


def scale_rsqrt_of_constant_in_graph(q, k, v):
  s = jnp.einsum("btnh,bsnh->bnts", q, k) * lax.rsqrt(jnp.float32(q.shape[-1]))
  return _pv(jax.nn.softmax(s), v)


def einsum_bnth_layout(q, k, v):
  q, k, v = _bnth(q), _bnth(k), _bnth(v)
  s = jnp.einsum("bnth,bnsh->bnts", q, k) / math.sqrt(q.shape[-1])
  return _bnth(jnp.einsum("bnts,bnsh->bnth", jax.nn.softmax(s), v))


def vmap_over_heads_and_batch(q, k, v):
  def one_head(q, k, v):            # [T, H], [S, H], [S, H]
    return jax.nn.softmax(q @ k.T / np.sqrt(q.shape[-1])) @ v
  return jax.vmap(jax.vmap(one_head, in_axes=(1, 1, 1), out_axes=1))(q, k, v)


def iota_causal_finfo_min_stop_gradient(q, k, v):
  s = _scores(q, k)
  t_index = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
  s_index = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
  s = jnp.where(s_index <= t_index, s, jnp.finfo(s.dtype).min)
  e = jnp.exp(s - lax.stop_gradient(s.max(-1, keepdims=True)))
  return _pv(e / e.sum(-1, keepdims=True), v)


def arange_causal_07_max_fill(q, k, v):
  s = _scores(q, k)
  causal = jnp.arange(q.shape[1])[:, None] >= jnp.arange(k.shape[1])[None, :]
  return _pv(jax.nn.softmax(jnp.where(causal, s, -0.7 * float(jnp.finfo(s.dtype).max))), v)


def sliding_window_from_iota(q, k, v):
  s = _scores(q, k)
  t, u = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
  return _pv(jax.nn.softmax(jnp.where((u <= t) & (t - u < 4), s, -jnp.inf)), v)


def padding_from_lengths(q, k, v, lengths):
  s = _scores(q, k)
  keep = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
  return _pv(jax.nn.softmax(jnp.where(keep[:, None, None, :], s, -1e9)), v)


def bias_plus_scores(q, k, v, bias):
  return _pv(jax.nn.softmax(bias + _scores(q, k)), v)


def scores_minus_bias(q, k, v, bias):
  return _pv(jax.nn.softmax(_scores(q, k) - bias), v)


def additive_mask_zero_or_inf(q, k, v, mask):
  return _pv(jax.nn.softmax(_scores(q, k) + jnp.where(mask, 0.0, -jnp.inf)), v)


def where_mask_tensor(q, k, v, mask):
  s = _scores(q, k)
  return _pv(jax.nn.softmax(jnp.where(mask, s, jnp.finfo(s.dtype).min)), v)


def where_inverted_mask_tensor(q, k, v, mask):
  s = _scores(q, k)
  return _pv(jax.nn.softmax(jnp.where(~mask, -jnp.inf, s)), v)


def gqa_repeat(q, k, v):
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  return _pv(jax.nn.softmax(_scores(q, k)), v)


def gqa_group_axis_einsum(q, k, v):
  b, t, n, h = q.shape
  groups = q.reshape(b, t, k.shape[2], n // k.shape[2], h)
  s = jnp.einsum("btkgh,bskh->bkgts", groups, k) / np.sqrt(h)
  return jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s), v).reshape(b, t, n, h)


def mqa_matmul_broadcast(q, k, v):
  q, k, v = _bnth(q), _bnth(k[:, :, :1]), _bnth(v[:, :, :1])
  return _bnth(jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])) @ v)


def v_left_einsum(q, k, v):
  return _bnth(jnp.einsum("bsnh,bnts->bnth", v, jax.nn.softmax(_scores(q, k))))


def v_left_matmul(q, k, v):
  q, k, v = _bnth(q), _bnth(k), _bnth(v)
  p = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]))
  return (jnp.swapaxes(v, -1, -2) @ jnp.swapaxes(p, -1, -2)).transpose(0, 3, 1, 2)


def softcap_tanh(q, k, v):
  return _pv(jax.nn.softmax(20.0 * jnp.tanh(_scores(q, k) / 20.0)), v)


def f32_softmax_between_bf16(q, k, v):
  s = _scores(q, k)
  return _pv(jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype), v)


def k_permuted_not_swapped(q, k, v):
  # q @ k.transpose(0, 3, 1, 2) with N == H: attention on a K with its head and feature axes
  # exchanged. Still exactly attention (on that K), so it is fused with that permutation.
  q, k, v = _bnth(q), _bnth(k), _bnth(v)
  return jax.nn.softmax(q @ k.transpose(0, 3, 1, 2) / np.sqrt(q.shape[-1])) @ v


def dpa_xla_causal(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def dpa_xla_everything(q, k, v, bias, mask, q_lengths, kv_lengths):
  return jax.nn.dot_product_attention(
      q, k, v, bias, mask, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
      local_window_size=(3, 2), implementation="xla")


@dataclasses.dataclass(frozen=True)
class Spelling:
  fn: Callable
  extras: tuple = ()             # extra arguments after q, k, v (see `_inputs`)
  kv_heads: int = N
  dtype: str = "float32"
  heads: int = N
  head_dim: int = H
  recognized: tuple = ()         # substrings the explain report must show

  @property
  def id(self):
    return self.fn.__name__ + ("" if self.dtype == "float32" else f"-{self.dtype}")


SPELLINGS = [
    Spelling(einsum_tril_where_inf, recognized=("causal", "fill -inf")),
    Spelling(matmul_swapaxes_prescaled_q_written_softmax, recognized=("mask     none",)),
    Spelling(scale_split_across_q_and_k, recognized=("scale    0.353553",)),
    Spelling(scale_rsqrt_of_constant_in_graph, recognized=("scale    0.353553",)),
    Spelling(einsum_bnth_layout),
    Spelling(vmap_over_heads_and_batch),
    Spelling(iota_causal_finfo_min_stop_gradient, recognized=("causal",)),
    Spelling(arange_causal_07_max_fill, recognized=("causal",)),
    Spelling(sliding_window_from_iota, recognized=("causal", "sliding window (left 3, right 0)")),
    Spelling(padding_from_lengths, ("kv_lengths",), recognized=("key padding",)),
    Spelling(bias_plus_scores, ("bias",), recognized=("bias     [1,4,13,17]",)),
    Spelling(scores_minus_bias, ("bias",), recognized=("bias     -[1,4,13,17]",)),
    Spelling(additive_mask_zero_or_inf, ("mask",), recognized=("boolean tensor",)),
    Spelling(where_mask_tensor, ("mask",), recognized=("boolean tensor",)),
    Spelling(where_inverted_mask_tensor, ("mask",), recognized=("boolean tensor",)),
    Spelling(gqa_repeat, kv_heads=K, recognized=("GQA via repeat", "k BSKH")),
    Spelling(gqa_group_axis_einsum, kv_heads=K, recognized=("GQA via broadcast",)),
    Spelling(mqa_matmul_broadcast, recognized=("K=1 kv heads",)),
    Spelling(v_left_einsum),
    Spelling(v_left_matmul),
    Spelling(softcap_tanh, recognized=("softcap  20",)),
    Spelling(f32_softmax_between_bf16, dtype="bfloat16", recognized=("bfloat16",)),
    # 16-bit models: jax.nn.softmax sums in float32 between casts, constants are bfloat16, and
    # XLA's einsum may put P on the right of the PV dot_general.
    Spelling(einsum_tril_where_inf, dtype="bfloat16", recognized=("causal", "bfloat16")),
    Spelling(gqa_repeat, kv_heads=K, dtype="bfloat16", recognized=("GQA via repeat",)),
    Spelling(padding_from_lengths, ("kv_lengths",), dtype="float16",
             recognized=("key padding", "float16")),
    Spelling(iota_causal_finfo_min_stop_gradient, dtype="bfloat16", recognized=("causal",)),
    Spelling(k_permuted_not_swapped, heads=H, kv_heads=H, head_dim=H),
    Spelling(dpa_xla_causal, kv_heads=K, recognized=("causal", "GQA")),
    Spelling(dpa_xla_everything, ("bias", "mask", "q_lengths", "kv_lengths"), kv_heads=K,
             recognized=("sliding window (left 3, right 2)", "key padding", "query padding")),
]


def _inputs(rng, spelling: Spelling, t=T, s=S):
  n, h, kv = spelling.heads, spelling.head_dim, spelling.kv_heads
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), spelling.dtype)
  mask = rng.random((B, 1, t, s)) < 0.7
  # No fully masked row (where the fused call's 0 and the original's mean of V differ by design,
  # docs/rewrite.md): key 0, and the diagonal, which every band of the spellings keeps.
  rows = np.arange(t)
  mask[..., 0] = True
  mask[..., rows, np.minimum(rows, s - 1)] = True
  extras = {
      "bias": normal(1, n, t, s),
      "mask": jnp.asarray(mask),
      "q_lengths": jnp.asarray([t, max(1, t - 4)], jnp.int32),
      "kv_lengths": jnp.asarray([s, max(1, s - 6)], jnp.int32),
  }
  return (normal(B, t, n, h), normal(B, s, kv, h), normal(B, s, kv, h),
          *(extras[name] for name in spelling.extras))


def _tolerance(dtype):
  return ATOL if dtype == "float32" else 3e-2


def _assert_close(actual, expected, atol):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    scale = max(1.0, float(np.abs(e).max()))
    np.testing.assert_allclose(a, e, atol=atol * scale, rtol=0)


def _loss(fn):
  return lambda *args: jnp.sum(jnp.sin(fn(*args).astype(jnp.float32)))


def _float_argnums(args):
  return tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: s.id)
def test_spelling_is_fused_and_equal(spelling, rng):
  args = _inputs(rng, spelling)
  report = explain(spelling.fn, *args)
  assert len(report.sites) == 1 and report.sites[0].fused, str(report)
  text = str(report)
  for expected in spelling.recognized:
    assert expected in text, text
  fused = fuse(spelling.fn)
  atol = _tolerance(spelling.dtype)
  _assert_close(jax.jit(fused)(*args), spelling.fn(*args), atol)
  argnums = _float_argnums(args)
  _assert_close(jax.grad(_loss(fused), argnums)(*args),
                jax.grad(_loss(spelling.fn), argnums)(*args), 4 * atol)


def test_fused_jaxpr_calls_the_kernel_instead_of_the_softmax(rng):
  args = _inputs(rng, SPELLINGS[0])
  text = str(jax.make_jaxpr(fuse(einsum_tril_where_inf))(*args))
  assert "jax_flash_" in text and "reduce_max" not in text and "exp" not in text.split()


def test_single_query_row_and_long_keys(rng):
  spelling = Spelling(einsum_tril_where_inf)
  q, k, v = _inputs(rng, spelling, t=1, s=97)
  fn = lambda q, k, v: _pv(jax.nn.softmax(_scores(q, k)), v)
  assert explain(fn, q, k, v).sites[0].fused
  _assert_close(fuse(fn)(q, k, v), fn(q, k, v), ATOL)


def test_softmax_custom_jvp_form(rng):
  """jax.nn.softmax under jax_softmax_custom_jvp=True is a custom_jvp_call; fused too."""
  args = _inputs(rng, SPELLINGS[0])
  previous = jax.config.jax_softmax_custom_jvp
  jax.config.update("jax_softmax_custom_jvp", True)
  try:
    jaxpr = str(jax.make_jaxpr(einsum_tril_where_inf)(*args))
    assert "custom_jvp_call" in jaxpr
    report = explain(einsum_tril_where_inf, *args)
    assert report.sites[0].fused, str(report)
    fused = fuse(einsum_tril_where_inf)
    _assert_close(jax.jit(fused)(*args), einsum_tril_where_inf(*args), ATOL)
    _assert_close(jax.grad(_loss(fused), (0, 1, 2))(*args),
                  jax.grad(_loss(einsum_tril_where_inf), (0, 1, 2))(*args), 4 * ATOL)
  finally:
    jax.config.update("jax_softmax_custom_jvp", previous)


# ---- inside higher-order primitives ----

def _in_jit(q, k, v):
  return jax.jit(einsum_tril_where_inf)(q, k, v)


def _in_scan(q, k, v):
  return lax.scan(lambda c, x: (c, einsum_tril_where_inf(q * x, k, v)), 0.0,
                  jnp.arange(1.0, 3.0))[1]


def _in_scan_with_outer_constants(q, k, v):
  # The scale and the fill are computed outside the body and enter it as scan constants.
  scale, fill = 1 / jnp.sqrt(jnp.float32(q.shape[-1])), jnp.float32(-jnp.inf)

  def body(carry, x):
    s = jnp.einsum("btnh,bsnh->bnts", q * x, k) * scale
    s = jnp.where(_causal_tril(q.shape[1], k.shape[1]), s, fill)
    return carry, _pv(jax.nn.softmax(s), v)

  return lax.scan(body, 0.0, jnp.arange(1.0, 3.0))[1]


def _in_cond(q, k, v):
  return lax.cond(q[0, 0, 0, 0] > -10, einsum_tril_where_inf, lambda q, k, v: q, q, k, v)


def _in_remat(q, k, v):
  return jax.checkpoint(einsum_tril_where_inf)(q, k, v)


@jax.custom_jvp
def _custom_jvp_attention(q, k, v):
  return einsum_tril_where_inf(q, k, v)


_custom_jvp_attention.defjvp(lambda primals, tangents: jax.jvp(einsum_tril_where_inf, primals,
                                                               tangents))


@jax.custom_vjp
def _custom_vjp_attention(q, k, v):
  return einsum_tril_where_inf(q, k, v)


_custom_vjp_attention.defvjp(lambda q, k, v: jax.vjp(einsum_tril_where_inf, q, k, v),
                             lambda vjp, g: vjp(g))


@pytest.mark.parametrize("fn,where", [
    (_in_jit, "top level"), (_in_scan, "scan.jaxpr"),
    (_in_scan_with_outer_constants, "scan.jaxpr"), (_in_cond, "cond.branches[1]"),
    (_in_remat, "remat"), (_custom_jvp_attention, "custom_jvp_call.call_jaxpr"),
    (_custom_vjp_attention, "custom_vjp_call"),
], ids=["jit", "scan", "scan_outer_constants", "cond", "remat", "custom_jvp", "custom_vjp"])
def test_nested_sites_are_fused(fn, where, rng):
  args = _inputs(rng, SPELLINGS[0])
  report = explain(fn, *args)
  assert [s.fused for s in report.sites] == [True] and where in report.sites[0].location, \
      str(report)
  fused = fuse(fn)
  assert str(jax.make_jaxpr(fused)(*args)).count("target_name=jax_flash_cpu_fwd") == 1
  _assert_close(jax.jit(fused)(*args), fn(*args), ATOL)
  _assert_close(jax.grad(_loss(fused), (0, 1, 2))(*args),
                jax.grad(_loss(fn), (0, 1, 2))(*args), 4 * ATOL)


def test_site_in_while_body_is_fused(rng):
  q, k, v = _inputs(rng, SPELLINGS[0])

  def fn(q, k, v):
    body = lambda c: (c[0] + 1, einsum_tril_where_inf(c[1], k, v))
    return lax.while_loop(lambda c: c[0] < 2, body, (0, q))[1]

  report = explain(fn, q, k, v)
  assert report.sites[0].fused and "while.body_jaxpr" in report.sites[0].location
  _assert_close(jax.jit(fuse(fn))(q, k, v), fn(q, k, v), ATOL)


# ---- composition with transformations ----

def test_vmap_of_fused(rng):
  q, k, v = (jnp.stack([x, x * 0.5]) for x in _inputs(rng, SPELLINGS[0]))
  fn = einsum_tril_where_inf
  _assert_close(jax.vmap(fuse(fn))(q, k, v), jax.vmap(fn)(q, k, v), ATOL)


def test_jit_of_grad_of_fused_and_cache(rng):
  args = _inputs(rng, SPELLINGS[0])
  fused = fuse(einsum_tril_where_inf)
  step = jax.jit(jax.value_and_grad(_loss(fused), (0, 1, 2)))
  _assert_close(step(*args), jax.value_and_grad(_loss(einsum_tril_where_inf), (0, 1, 2))(*args),
                4 * ATOL)
  # Eager calls reuse the trace of an identical signature.
  _assert_close(fused(*args), fused(*args), 0.0)


def test_static_python_arguments_and_pytrees(rng):
  q, k, v = _inputs(rng, SPELLINGS[0])

  def fn(inputs, causal=True, temperature=1.0):
    s = _scores(inputs["q"], inputs["k"]) / temperature
    if causal:
      s = jnp.where(_causal_tril(T, S), s, -jnp.inf)
    return {"out": _pv(jax.nn.softmax(s), inputs["v"])}

  inputs = {"q": q, "k": k, "v": v}
  for causal in (True, False):
    out = fuse(fn)(inputs, causal=causal, temperature=2.0)["out"]
    _assert_close(out, fn(inputs, causal=causal, temperature=2.0)["out"], ATOL)
  assert "causal" not in str(explain(fn, inputs, causal=False))


def test_two_layers_fused_and_chained(rng):
  q, k, v = _inputs(rng, SPELLINGS[0])

  def fn(q, k, v):
    return einsum_tril_where_inf(einsum_tril_where_inf(q, k, v), k, v)

  report = explain(fn, q, k, v)
  assert [s.fused for s in report.sites] == [True, True]
  _assert_close(jax.jit(fuse(fn))(q, k, v), fn(q, k, v), ATOL)


# ---- Flax ----

def test_flax_linen_multi_head_attention(rng):
  nn = pytest.importorskip("flax.linen")
  x = jnp.asarray(rng.standard_normal((B, T, 32)), jnp.float32)
  module = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)
  params = module.init(jax.random.key(0), x)
  causal = nn.make_causal_mask(jnp.ones((B, T)))
  for kwargs in ({}, {"mask": causal}):
    apply = lambda p, x: module.apply(p, x, **kwargs)
    report = explain(apply, params, x)
    assert report.sites[0].fused, str(report)
    assert ("causal" in str(report)) == bool(kwargs)
    fused = fuse(apply)
    _assert_close(jax.jit(fused)(params, x), apply(params, x), ATOL)
    _assert_close(jax.grad(_loss(fused))(params, x), jax.grad(_loss(apply))(params, x),
                  4 * ATOL)


def test_flax_linen_dropout_is_not_fused(rng):
  nn = pytest.importorskip("flax.linen")
  x = jnp.asarray(rng.standard_normal((B, T, 32)), jnp.float32)
  module = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, dropout_rate=0.1,
                                           deterministic=False)
  params = module.init(jax.random.key(0), x)
  apply = lambda p, x, key: module.apply(p, x, rngs={"dropout": key})
  report = explain(apply, params, x, jax.random.key(1))
  assert not report.sites[0].fused and "dropout" in report.sites[0].reason
  key = jax.random.key(2)
  _assert_close(fuse(apply)(params, x, key), apply(params, x, key), 0.0)


def test_flax_nnx_multi_head_attention(rng):
  nnx = pytest.importorskip("flax.nnx")
  x = jnp.asarray(rng.standard_normal((B, T, 32)), jnp.float32)
  module = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=False,
                                  rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(module)
  apply = lambda state, x: nnx.merge(graphdef, state)(x)
  report = explain(apply, state, x)
  assert report.sites[0].fused, str(report)
  _assert_close(jax.jit(fuse(apply))(state, x), apply(state, x), ATOL)


# ---- near misses: left exactly as they were, with the reason ----

def softmax_over_queries(q, k, v):
  return _pv(jax.nn.softmax(_scores(q, k), axis=-2), v)


def softmax_over_heads(q, k, v):
  return _pv(jax.nn.softmax(_scores(q, k), axis=1), v)


def probabilities_transposed_not_swapped(q, k, v):   # T == N: P[b, t, n, s] @ V[b, n, s, h]
  q, k, v = _bnth(q), _bnth(k), _bnth(v)
  p = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]))
  return p.transpose(0, 2, 1, 3) @ v


def mask_depends_on_scores(q, k, v):
  s = _scores(q, k)
  return _pv(jax.nn.softmax(jnp.where(s > 0, s, -jnp.inf)), v)


def probabilities_returned(q, k, v):
  p = jax.nn.softmax(_scores(q, k))
  return _pv(p, v), p


def probabilities_reused(q, k, v):
  p = jax.nn.softmax(_scores(q, k))
  return _pv(p, v) + jnp.sum(p)


def scores_reused(q, k, v):
  s = _scores(q, k)
  return _pv(jax.nn.softmax(s), v) + jnp.mean(s)


def fill_not_negligible(q, k, v):
  s = _scores(q, k)
  return _pv(jax.nn.softmax(jnp.where(_causal_tril(T, S), s, -30.0)), v)


def dropout_on_probabilities(q, k, v, key):
  p = jax.nn.softmax(_scores(q, k))
  return _pv(jnp.where(jax.random.bernoulli(key, 0.9, p.shape), p / 0.9, 0.0), v)


def scale_not_constant(q, k, v, temperature):
  return _pv(jax.nn.softmax(_scores(q, k) * temperature), v)


def scores_times_tensor(q, k, v, weights):
  return _pv(jax.nn.softmax(_scores(q, k) * weights), v)


NEAR_MISSES = [
    (softmax_over_queries, (), "does not contract the axis the softmax normalizes"),
    (softmax_over_heads, (), "batches over, not the key axis"),
    (probabilities_transposed_not_swapped, ("square",), "batches over the query axis"),
    (mask_depends_on_scores, (), "computed from the attention scores"),
    (probabilities_returned, (), "probabilities are an output"),
    (probabilities_reused, (), "probabilities have 2 users"),
    (scores_reused, (), "scores are also used"),
    (fill_not_negligible, (), "fill -30 is not negligible"),
    (dropout_on_probabilities, ("key",), "dropout"),
    (scale_not_constant, ("temperature",), "not a compile-time constant"),
    (scores_times_tensor, ("weights",), "multiplied by a tensor"),
]


@pytest.mark.parametrize("fn,extras,reason", NEAR_MISSES, ids=[f.__name__ for f, _, _ in
                                                               NEAR_MISSES])
def test_near_miss_is_left_alone(fn, extras, reason, rng):
  q, k, v = _inputs(rng, Spelling(fn))
  if "square" in extras:           # T == N so the wrong batching type-checks
    q = jnp.asarray(rng.standard_normal((B, N, N, H)), jnp.float32)
  more = {"key": jax.random.key(3), "temperature": jnp.float32(0.7),
          "weights": jnp.asarray(rng.random((B, N, T, S)), jnp.float32)}
  args = (q, k, v, *(more[e] for e in extras if e in more))
  report = explain(fn, *args)
  assert len(report.sites) == 1 and not report.sites[0].fused, str(report)
  assert reason in report.sites[0].reason, report.sites[0].reason
  assert str(jax.make_jaxpr(fuse(fn))(*args)) == str(jax.make_jaxpr(fn)(*args))
  _assert_close(jax.jit(fuse(fn))(*args), jax.jit(fn)(*args), 0.0)


def test_no_softmax_no_candidates(rng):
  q, k, v = _inputs(rng, Spelling(_pv))
  fn = lambda q, k, v: _pv(jax.nn.sigmoid(_scores(q, k)), v)
  assert explain(fn, q, k, v).sites == []
  assert str(jax.make_jaxpr(fuse(fn))(q, k, v)) == str(jax.make_jaxpr(fn)(q, k, v))


# ---- semantics stated in explain ----

def test_fully_masked_rows_are_reported(rng):
  spelling = Spelling(padding_from_lengths, ("kv_lengths",))
  q, k, v, _ = _inputs(rng, spelling)

  def inf_fill(q, k, v, lengths):
    keep = jnp.arange(S)[None, :] < lengths[:, None]
    return _pv(jax.nn.softmax(jnp.where(keep[:, None, None, :], _scores(q, k), -jnp.inf)), v)

  empty = jnp.asarray([S, 0], jnp.int32)          # batch 1: every key masked
  for fn, original in ((padding_from_lengths, "mean of V"), (inf_fill, "NaN")):
    site = explain(fn, q, k, v, empty).sites[0]
    assert site.fused and any(original in note for note in site.notes), site
    fused, plain = fuse(fn)(q, k, v, empty), fn(q, k, v, empty)
    _assert_close(fused[0], plain[0], ATOL)         # rows with keys: equal
    np.testing.assert_array_equal(np.asarray(fused[1]), 0.0)
  assert explain(einsum_tril_where_inf, q, k, v).sites[0].notes == []   # causal: never empty


def test_report_is_readable(rng):
  args = _inputs(rng, SPELLINGS[0])
  fn = lambda q, k, v: (einsum_tril_where_inf(q, k, v), probabilities_reused(q, k, v))
  report = explain(fn, *args)
  text = str(report)
  assert "2 attention candidate(s), 1 fused, 1 not fused" in text
  assert "FUSED (schedule cpu)" in text and "not fused: the attention probabilities" in text
  assert "layout   q BTNH, k BSKH, v BSKH" in text
  assert [s.schedule for s in report.fused] == ["cpu"]


def test_explain_of_a_fused_function_reports_its_schedule(rng):
  args = _inputs(rng, SPELLINGS[0])
  report = explain(fuse(einsum_tril_where_inf, schedule="cpu"), *args)
  assert report.sites[0].fused and report.sites[0].schedule == "cpu"


def test_unservable_schedule_is_a_reason_not_an_error(rng):
  args = _inputs(rng, SPELLINGS[0])
  report = explain(fuse(einsum_tril_where_inf, schedule="no-such-kernel"), *args)
  assert not report.sites[0].fused and "schedule" in report.sites[0].reason
  _assert_close(fuse(einsum_tril_where_inf, schedule="no-such-kernel")(*args),
                einsum_tril_where_inf(*args), 0.0)


@pytest.mark.parametrize("bad,name", [(lambda: fuse(3), "fn"),
                                      (lambda: fuse(jnp.sum, schedule=2), "schedule")])
def test_bad_arguments_name_themselves(bad, name):
  with pytest.raises(ValueError, match=name):
    bad()


def test_exported_from_the_package():
  assert jax_flash.rewrite.fuse is fuse and jax_flash.rewrite.explain is explain
