"""jax_flash.flax: the attention_fn inside Flax's own modules, and our linen / nnx modules."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash.flax as jf  # noqa: E402
from jax_flash import reference  # noqa: E402
from attention_cases import as_f64, relative_l2  # noqa: E402

BATCH = (2, 3)          # Flax allows several leading batch dims
T, FEATURES, HEADS = 17, 32, 4
# The computation dtype: the CPU kernel takes float32, the GPU kernels bfloat16 / float16 only.
DTYPE = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
# Relative L2 error allowed against Flax's own attention / the float64 reference.
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}[DTYPE]


def _inputs(rng, t=T, batch=BATCH):
  return jnp.asarray(rng.standard_normal(batch + (t, FEATURES)), jnp.float32)


def _padding_mask(rng, batch=BATCH, t=T):
  """Flax-style float mask [batch..., 1, T, T]: keys past a random length are masked (the
  first key always stays, so no row is fully masked: Flax and jax_flash differ there)."""
  lengths = rng.integers(1, t + 1, batch)
  keys = (np.arange(t) < lengths[..., None]).astype(np.float32)
  return nn.make_attention_mask(jnp.ones(batch + (t,)), jnp.asarray(keys))


def _close(got, want):
  """Relative L2 over all leaves together: some gradient leaves are 0 in exact arithmetic (the
  key projection's bias shifts every score of a row alike), so per-leaf ratios would compare
  noise."""
  flat = lambda tree: np.concatenate([as_f64(x).ravel() for x in jax.tree.leaves(tree)])
  assert relative_l2(flat(got), flat(want)) < TOLERANCE


# -- attention_fn inside flax.linen.MultiHeadDotProductAttention --------------------------------

@pytest.mark.parametrize("mask_kind", ["causal", "padding", "none"])
def test_linen_mha_attention_fn_matches_flax(rng, mask_kind):
  x = _inputs(rng)
  mask = {"causal": nn.make_causal_mask(jnp.ones(BATCH + (T,))),
          "padding": _padding_mask(rng), "none": None}[mask_kind]
  kwargs = dict(num_heads=HEADS, dropout_rate=0.1, dtype=DTYPE)  # deterministic=True: no dropout
  ours = nn.MultiHeadDotProductAttention(attention_fn=jf.attention_fn, **kwargs)
  flax_own = nn.MultiHeadDotProductAttention(**kwargs)
  params = flax_own.init(jax.random.key(0), x, mask=mask, deterministic=True)

  def loss(module, params):
    return jnp.sum(module.apply(params, x, mask=mask, deterministic=True) ** 2)

  _close(ours.apply(params, x, mask=mask, deterministic=True),
         flax_own.apply(params, x, mask=mask, deterministic=True))
  _close(*(jax.grad(loss, argnums=1)(m, params) for m in (ours, flax_own)))


def test_linen_mha_bfloat16(rng):
  x = _inputs(rng)
  kwargs = dict(num_heads=HEADS, dtype=jnp.bfloat16)
  ours = nn.MultiHeadDotProductAttention(attention_fn=jf.attention_fn, **kwargs)
  flax_own = nn.MultiHeadDotProductAttention(**kwargs)
  params = flax_own.init(jax.random.key(0), x)
  got = jax.jit(ours.apply)(params, x)
  assert got.dtype == jnp.bfloat16
  assert relative_l2(got, as_f64(flax_own.apply(params, x))) < 2e-2


def test_linen_mha_refuses_active_dropout(rng):
  x = _inputs(rng)
  module = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1, dtype=DTYPE,
                                           attention_fn=jf.attention_fn)
  params = module.init(jax.random.key(0), x, deterministic=True)
  with pytest.raises(ValueError, match="dropout"):
    module.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})


def test_linen_mha_refuses_sow_weights(rng):
  x = _inputs(rng)
  module = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=DTYPE,
                                           attention_fn=jf.attention_fn)
  params = module.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="sow"):
    module.apply(params, x, sow_weights=True, mutable=["intermediates"])


# -- attention_fn inside flax.nnx.MultiHeadAttention ---------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True])
def test_nnx_mha_attention_fn_matches_flax(rng, is_causal):
  x, mask = _inputs(rng), _padding_mask(rng)
  make = lambda **kw: nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES,
                                             dropout_rate=0.1, decode=False, dtype=DTYPE,
                                             rngs=nnx.Rngs(0), **kw)
  ours, flax_own = make(attention_fn=jf.attention_fn), make()
  call = lambda m: m(x, mask=mask, is_causal=is_causal, deterministic=True)
  _close(call(ours), call(flax_own))
  with pytest.raises(ValueError, match="dropout"):
    ours(x, mask=mask, deterministic=False)


# -- our modules ---------------------------------------------------------------------------------

def _project(x, kernel):
  return jnp.einsum("...f,fnh->...nh", x, kernel)


def _module_reference(x, w, *, is_causal, kv_lens=None):
  """float64 attention of the projected inputs, then the output projection."""
  q, k, v = (_project(x, w[name]) for name in ("query", "key", "value"))
  fold = lambda a: as_f64(a.reshape((-1,) + a.shape[-3:]))
  kv_lens = None if kv_lens is None else np.asarray(kv_lens).reshape(-1)
  out, _ = reference.attention_forward_f64(fold(q), fold(k), fold(v), kv_seqlens=kv_lens,
                                           scale=1 / np.sqrt(q.shape[-1]), is_causal=is_causal)
  out = out.reshape(q.shape)
  return np.einsum("...nh,nhf->...f", out, as_f64(w["out"]))


def test_linen_module_gqa_causal(rng):
  x = _inputs(rng)
  kv_lens = jnp.asarray(rng.integers(1, T + 1, BATCH), jnp.int32)
  module = jf.LinenFlashAttention(num_heads=HEADS, num_kv_heads=2, is_causal=True, dtype=DTYPE)
  params = module.init(jax.random.key(0), x)
  assert params["params"]["key"]["kernel"].shape == (FEATURES, 2, FEATURES // HEADS)
  got = module.apply(params, x, key_value_seq_lengths=kv_lens)
  weights = {name: p["kernel"] for name, p in params["params"].items()}
  _close(got, _module_reference(x, weights, is_causal=True, kv_lens=kv_lens))

  def via_jax_nn(params):  # the same module on jax.nn.dot_product_attention, for gradients
    w = {name: p["kernel"] for name, p in params["params"].items()}
    q, k, v = (_project(x, w[name]) for name in ("query", "key", "value"))
    fold = lambda a: a.reshape((-1,) + a.shape[-3:])
    out = jax.nn.dot_product_attention(*(fold(a).astype(DTYPE) for a in (q, k, v)),
                                       is_causal=True,
                                       key_value_seq_lengths=kv_lens.reshape(-1))
    return jnp.sum(jnp.einsum("...nh,nhf->...f", out.reshape(q.shape), w["out"]) ** 2)

  got_grads = jax.grad(lambda p: jnp.sum(module.apply(
      p, x, key_value_seq_lengths=kv_lens) ** 2))(params)
  _close(got_grads, jax.grad(via_jax_nn)(params))


def test_nnx_module_gqa_cross_attention(rng):
  x, context = _inputs(rng), _inputs(rng, t=23)
  module = jf.NnxFlashAttention(FEATURES, HEADS, num_kv_heads=1, out_features=16, dtype=DTYPE,
                                rngs=nnx.Rngs(0))
  got = jax.jit(lambda m, a, b: m(a, b))(module, x, context)
  assert got.shape == BATCH + (T, 16)
  q = _project(x, module.query.kernel[...])
  k, v = (_project(context, m.kernel[...]) for m in (module.key, module.value))
  fold = lambda a: as_f64(a.reshape((-1,) + a.shape[-3:]))
  out, _ = reference.attention_forward_f64(fold(q), fold(k), fold(v),
                                           scale=1 / np.sqrt(q.shape[-1]))
  _close(got, np.einsum("...nh,nhf->...f", out.reshape(q.shape), as_f64(module.out.kernel[...])))


def test_nnx_module_trains(rng):
  """One optimizer-free gradient step through nnx.grad lowers the loss."""
  x = _inputs(rng)
  module = jf.NnxFlashAttention(FEATURES, HEADS, num_kv_heads=2, is_causal=True, dtype=DTYPE,
                                rngs=nnx.Rngs(0))
  loss = lambda m: jnp.mean((m(x) - x) ** 2)
  before, grads = nnx.value_and_grad(loss)(module)
  params = nnx.state(module, nnx.Param)
  nnx.update(module, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
  assert float(loss(module)) < float(before)


@pytest.mark.parametrize("make", [
    lambda: jf.LinenFlashAttention(num_heads=4, num_kv_heads=3).init(
        jax.random.key(0), jnp.ones((1, 4, 32))),
    lambda: jf.NnxFlashAttention(32, 4, num_kv_heads=3, rngs=nnx.Rngs(0)),
])
def test_modules_reject_kv_heads_that_do_not_divide(make):
  with pytest.raises(ValueError, match="num_kv_heads"):
    make()


def test_attention_fn_rejects_quantized_einsums(rng):
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="einsum"):
    jf.attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum)
