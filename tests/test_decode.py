"""flash_decode and the decode schedule against the float64 reference.

Every numerical test runs the "gather" implementation (it is what runs on the CPU, in CI) and,
where a GPU with the CUDA decode kernels is present, the "cuda" implementation in bfloat16 and
float16. The reference builds the logical cache in NumPy and applies the end-aligned causal rule
of jax_flash/decode.py's docstring as a mask to reference.attention_forward_f64.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dispatch, reference
from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.decode import _Call, _cuda_unavailable_reason, flash_decode
from jax_flash.schedules import decode as decode_schedule


def _cuda_reason():
  probe = _Call(1, 1, 8, 2, 128, 1024, False, False, 1.0, 0.0, -1, 0)
  return _cuda_unavailable_reason(probe, jnp.bfloat16)


CUDA_REASON = _cuda_reason()
needs_cuda = pytest.mark.skipif(CUDA_REASON is not None,
                                reason=f"CUDA decode kernels unavailable: {CUDA_REASON}")

# The gather fallback runs flash_attention, whose GPU schedules take 16-bit inputs only.
ON_CPU = jax.default_backend() == "cpu"
GATHER_DTYPE, GATHER_TOL = (np.float32, 1e-5) if ON_CPU else (jnp.float16, 2e-3)

# (implementation, dtype, relative L2 tolerance)
VARIANTS = [
    pytest.param("gather", GATHER_DTYPE, GATHER_TOL, id="gather"),
    pytest.param("cuda", jnp.bfloat16, 1.2e-2, id="cuda-bf16", marks=needs_cuda),
    pytest.param("cuda", jnp.float16, 2e-3, id="cuda-f16", marks=needs_cuda),
]


# ---- problems and the reference ---------------------------------------------------------------

def _normal(rng, shape, dtype):
  """Random normal values, rounded to `dtype` (the reference sees the rounded values)."""
  return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))


class Cache:
  """A KV cache in NumPy float32 (values already rounded to the test dtype)."""

  def __init__(self, rng, dtype, batch, kv_heads, head_dim, capacity, page_size=None):
    self.page_size = page_size
    self.capacity = capacity
    if page_size is None:
      shape = (batch, capacity, kv_heads, head_dim)
      self.table = None
    else:
      assert capacity % page_size == 0, "capacity must be whole pages"
      max_pages = capacity // page_size
      num_pages = batch * max_pages + 3  # spare pages nobody owns
      shape = (num_pages, page_size, kv_heads, head_dim)
      self.table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
      self.table = self.table.astype(np.int32)
    self.k = _normal(rng, shape, dtype)
    self.v = _normal(rng, shape, dtype)

  def logical(self, x):
    """[B, capacity, K, H]."""
    if self.table is None:
      return x
    pages = x[self.table]
    return pages.reshape((pages.shape[0], -1) + x.shape[2:])

  def store(self, x, rows, positions):
    """x with rows [B, T, K, H] at positions [B, T] (past the capacity: dropped)."""
    x = x.copy()
    for b in range(rows.shape[0]):
      for t in range(rows.shape[1]):
        p = positions[b, t]
        if p >= self.capacity:
          continue
        if self.table is None:
          x[b, p] = rows[b, t]
        else:
          x[self.table[b, p // self.page_size], p % self.page_size] = rows[b, t]
    return x


def decode_reference(q, k_logical, v_logical, kv_len, *, scale=None, softcap=0.0, window=-1):
  """(out [B, T, N, H], lse [B, T, N]) float64 of the flash_decode contract."""
  b, t, _, h = q.shape
  s = k_logical.shape[1]
  qpos = np.asarray(kv_len)[:, None] - t + np.arange(t)[None, :]
  key = np.arange(s)[None, None, :]
  keep = (key <= qpos[:, :, None]) & (key < np.asarray(kv_len)[:, None, None])
  if window >= 0:
    keep &= key >= qpos[:, :, None] - window
  out, lse = reference.attention_forward_f64(
      q, k_logical, v_logical, mask=keep[:, None], scale=scale or 1 / np.sqrt(h),
      softcap=softcap)
  return out, np.transpose(lse, (0, 2, 1))


def assert_close(name, got, want, tol):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  assert not np.isnan(got).any(), f"{name}: NaN in the output"
  err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
  assert err < tol, f"{name}: relative L2 error {err:.2e} >= {tol:.1e}"


def assert_lse(got, want):
  got = np.asarray(got, np.float64)
  dead = np.isinf(want)
  assert np.all(np.isneginf(got[dead])), "rows that see no key must have lse -inf"
  np.testing.assert_allclose(got[~dead], want[~dead], atol=2e-2, rtol=2e-3)


def run(impl, dtype, q, cache, lengths, **kwargs):
  table = None if cache.table is None else jnp.asarray(cache.table)
  k_new = kwargs.pop("k_new", None)
  v_new = kwargs.pop("v_new", None)
  return flash_decode(
      jnp.asarray(q, dtype), jnp.asarray(cache.k, dtype), jnp.asarray(cache.v, dtype),
      jnp.asarray(lengths, jnp.int32), block_table=table, implementation=impl,
      k_new=None if k_new is None else jnp.asarray(k_new, dtype),
      v_new=None if v_new is None else jnp.asarray(v_new, dtype), **kwargs)


# ---- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl,dtype,tol", VARIANTS)
@pytest.mark.parametrize("head_dim,num_heads,kv_heads", [(64, 8, 2), (128, 4, 4), (256, 2, 1)])
def test_contiguous_ragged_lengths(rng, impl, dtype, tol, head_dim, num_heads, kv_heads):
  cache = Cache(rng, dtype, 3, kv_heads, head_dim, capacity=97)
  lengths = np.array([97, 17, 1])
  q = _normal(rng, (3, 1, num_heads, head_dim), dtype)
  out, lse = run(impl, dtype, q, cache, lengths, return_lse=True)
  want, want_lse = decode_reference(q, cache.k, cache.v, lengths)
  assert_close("out", out, want, tol)
  assert_lse(lse, want_lse)


@pytest.mark.parametrize("impl,dtype,tol", VARIANTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_shuffled_block_table(rng, impl, dtype, tol, page_size):
  capacity = 1088 if page_size == 64 else 256
  cache = Cache(rng, dtype, 3, 2, 128, capacity=capacity, page_size=page_size)
  lengths = np.array([capacity - 1, 1, rng.integers(2, capacity)])
  q = _normal(rng, (3, 1, 8, 128), dtype)
  out = run(impl, dtype, q, cache, lengths)
  want, _ = decode_reference(q, cache.logical(cache.k), cache.logical(cache.v), lengths)
  assert_close("out", out, want, tol)


@pytest.mark.parametrize("impl,dtype,tol", VARIANTS)
def test_several_new_tokens_align_to_the_end(rng, impl, dtype, tol):
  """T > 1: query t sits at kv_len - T + t; with kv_len < T the first rows see nothing."""
  cache = Cache(rng, dtype, 3, 2, 64, capacity=130)
  lengths = np.array([130, 2, 0])
  q = _normal(rng, (3, 5, 8, 64), dtype)
  out, lse = run(impl, dtype, q, cache, lengths, return_lse=True)
  want, want_lse = decode_reference(q, cache.k, cache.v, lengths)
  assert_close("out", out, want, tol)
  assert_lse(lse, want_lse)
  assert np.all(np.asarray(jnp.asarray(out, jnp.float32))[1, :3] == 0)  # rows before position 0


@pytest.mark.parametrize("impl,dtype,tol", VARIANTS)
def test_softcap_scale_and_window(rng, impl, dtype, tol):
  cache = Cache(rng, dtype, 2, 1, 128, capacity=304, page_size=16)
  lengths = np.array([300, 45])
  q = _normal(rng, (2, 3, 4, 128), dtype)
  out = run(impl, dtype, q, cache, lengths, scale=0.3, softcap=4.0, local_window_size=20)
  want, _ = decode_reference(q, cache.logical(cache.k), cache.logical(cache.v), lengths,
                             scale=0.3, softcap=4.0, window=20)
  assert_close("out", out, want, tol)


@pytest.mark.parametrize("impl,dtype,tol", VARIANTS)
@pytest.mark.parametrize("page_size", [None, 32])
def test_append_updates_the_cache(rng, impl, dtype, tol, page_size):
  t = 2
  cache = Cache(rng, dtype, 3, 2, 64, capacity=160, page_size=page_size)
  lengths = np.array([150, 0, 77])
  q = _normal(rng, (3, t, 8, 64), dtype)
  k_new, v_new = _normal(rng, (3, t, 2, 64), dtype), _normal(rng, (3, t, 2, 64), dtype)
  out, k_after, v_after = run(impl, dtype, q, cache, lengths, k_new=k_new, v_new=v_new)
  positions = lengths[:, None] + np.arange(t)[None, :]
  k_want = cache.store(cache.k, k_new, positions)
  v_want = cache.store(cache.v, v_new, positions)
  np.testing.assert_array_equal(np.asarray(jnp.asarray(k_after, jnp.float32)), k_want)
  np.testing.assert_array_equal(np.asarray(jnp.asarray(v_after, jnp.float32)), v_want)
  want, _ = decode_reference(q, cache.logical(k_want), cache.logical(v_want), lengths + t)
  assert_close("out", out, want, tol)


@pytest.mark.parametrize("impl,dtype,tol", VARIANTS)
def test_jitted_decode_loop_with_donated_cache(rng, impl, dtype, tol):
  """Greedy-style loop: each step appends one token under jit with the caches donated."""
  cache = Cache(rng, dtype, 2, 2, 128, capacity=64, page_size=16)
  table = jnp.asarray(cache.table)
  lengths = np.array([10, 41])

  @jax.jit
  def _step(q, k_cache, v_cache, lens, k_new, v_new):
    return flash_decode(q, k_cache, v_cache, lens, block_table=table, k_new=k_new, v_new=v_new,
                        implementation=impl)

  step = jax.jit(_step, donate_argnums=(1, 2))
  k_dev, v_dev = jnp.asarray(cache.k, dtype), jnp.asarray(cache.v, dtype)
  k_host, v_host = cache.k, cache.v
  for _ in range(3):
    q = _normal(rng, (2, 1, 4, 128), dtype)
    k_new, v_new = _normal(rng, (2, 1, 2, 128), dtype), _normal(rng, (2, 1, 2, 128), dtype)
    pointer = k_dev.unsafe_buffer_pointer() if impl == "cuda" else None
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
      out, k_dev, v_dev = step(jnp.asarray(q, dtype), k_dev, v_dev, jnp.asarray(lengths, jnp.int32),
                               jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype))
    if pointer is not None:
      assert k_dev.unsafe_buffer_pointer() == pointer, "the donated cache was copied"
    k_host = cache.store(k_host, k_new, lengths[:, None])
    v_host = cache.store(v_host, v_new, lengths[:, None])
    lengths = lengths + 1
    want, _ = decode_reference(q, cache.logical(k_host), cache.logical(v_host), lengths)
    assert_close("out", out, want, tol)
  np.testing.assert_array_equal(np.asarray(jnp.asarray(k_dev, jnp.float32)), k_host)


def test_vmap_over_an_extra_batch_axis(rng):
  cache = Cache(rng, GATHER_DTYPE, 2, 1, 64, capacity=40)
  q = _normal(rng, (3, 2, 1, 2, 64), GATHER_DTYPE)
  lengths = np.array([40, 7])
  k, v = (jnp.asarray(x, GATHER_DTYPE) for x in (cache.k, cache.v))
  got = jax.vmap(lambda q: flash_decode(q, k, v, jnp.asarray(lengths, jnp.int32)))(
      jnp.asarray(q, GATHER_DTYPE))
  for i in range(3):
    want, _ = decode_reference(q[i], cache.k, cache.v, lengths)
    assert_close(f"vmap[{i}]", got[i], want, GATHER_TOL)


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 3, 7, "auto"])
def test_cuda_split_counts_agree(rng, num_splits):
  cache = Cache(rng, jnp.bfloat16, 2, 2, 128, capacity=2048, page_size=256)
  lengths = np.array([2048, 1000])
  q = _normal(rng, (2, 2, 8, 128), jnp.bfloat16)
  out, lse = run("cuda", jnp.bfloat16, q, cache, lengths, num_splits=num_splits, return_lse=True)
  want, want_lse = decode_reference(q, cache.logical(cache.k), cache.logical(cache.v), lengths)
  assert_close("out", out, want, 1.2e-2)
  assert_lse(lse, want_lse)


@needs_cuda
def test_cuda_matches_gather(rng):
  cache = Cache(rng, jnp.bfloat16, 4, 8, 128, capacity=4096, page_size=16)
  lengths = rng.integers(1, 4096, 4)
  q = _normal(rng, (4, 1, 32, 128), jnp.bfloat16)
  cuda = run("cuda", jnp.bfloat16, q, cache, lengths)
  gather = run("gather", jnp.bfloat16, q, cache, lengths)
  assert_close("cuda vs gather", cuda, np.asarray(jnp.asarray(gather, jnp.float32)), 1.2e-2)


# ---- argument checks ----------------------------------------------------------------------------

def _bad_calls():
  q = jnp.zeros((2, 1, 4, 64))
  k = jnp.zeros((2, 32, 2, 64))
  pages = jnp.zeros((8, 16, 2, 64))
  lens = jnp.array([3, 4], jnp.int32)
  table = jnp.zeros((2, 4), jnp.int32)
  return [
      ("query", dict(query=q[0])),
      ("k_cache", dict(k_cache=k[0])),
      ("v_cache", dict(v_cache=k[:, :8])),
      ("dtype", dict(k_cache=k.astype(jnp.bfloat16))),
      ("heads", dict(k_cache=jnp.zeros((2, 32, 3, 64)), v_cache=jnp.zeros((2, 32, 3, 64)))),
      ("head dim", dict(k_cache=jnp.zeros((2, 32, 2, 32)), v_cache=jnp.zeros((2, 32, 2, 32)))),
      ("batch", dict(k_cache=k[:1], v_cache=k[:1])),
      ("cache_seqlens", dict(cache_seqlens=lens[:1])),
      ("cache_seqlens", dict(cache_seqlens=lens.astype(jnp.float32))),
      ("block_table", dict(k_cache=pages, v_cache=pages, block_table=table[:1])),
      ("block_table", dict(k_cache=pages, v_cache=pages, block_table=table.astype(jnp.int64)
                           if jax.config.jax_enable_x64 else table.astype(jnp.float32))),
      ("power of two", dict(k_cache=pages[:, :12], v_cache=pages[:, :12], block_table=table)),
      ("k_new and v_new", dict(k_new=jnp.zeros((2, 1, 2, 64)))),
      ("k_new", dict(k_new=jnp.zeros((2, 2, 2, 64)), v_new=jnp.zeros((2, 2, 2, 64)))),
      ("local_window_size", dict(local_window_size=-1)),
      ("num_splits", dict(num_splits=0)),
      ("num_splits", dict(num_splits="many")),
      ("softcap", dict(softcap=-1.0)),
      ("implementation", dict(implementation="triton")),
  ]


@pytest.mark.parametrize("needle,overrides", _bad_calls(),
                         ids=[f"{i}-{n}" for i, (n, _) in enumerate(_bad_calls())])
def test_bad_arguments_raise_value_error_naming_them(needle, overrides):
  args = dict(query=jnp.zeros((2, 1, 4, 64)), k_cache=jnp.zeros((2, 32, 2, 64)),
              v_cache=jnp.zeros((2, 32, 2, 64)), cache_seqlens=jnp.array([3, 4], jnp.int32))
  args.update(overrides)
  with pytest.raises(ValueError, match=needle):
    flash_decode(args.pop("query"), args.pop("k_cache"), args.pop("v_cache"),
                 args.pop("cache_seqlens"), **args)


@pytest.mark.skipif(CUDA_REASON is None, reason="the CUDA kernels are available here")
def test_cuda_implementation_refuses_without_kernels():
  with pytest.raises(ValueError, match="implementation='cuda'"):
    flash_decode(jnp.zeros((1, 1, 2, 64), jnp.bfloat16), jnp.zeros((1, 8, 1, 64), jnp.bfloat16),
                 jnp.zeros((1, 8, 1, 64), jnp.bfloat16), jnp.array([3], jnp.int32),
                 implementation="cuda")


# ---- the decode schedule (standard convention, flash_attention) ---------------------------------

def test_schedule_envelope_and_workspaces():
  config = AttentionConfig(scale=1.0)
  assert decode_schedule.envelope(AttentionShape(4, 1, 8192, 32, 8, 128), config) is None
  assert "rows per kv head" in decode_schedule.envelope(AttentionShape(1, 17, 64, 8, 2, 64),
                                                        config)
  assert "head dim" in decode_schedule.envelope(AttentionShape(1, 1, 64, 8, 2, 96), config)
  out, lse, counters = decode_schedule.workspaces(2, 5, 8, 2, 64, max_keys=10_000)
  splits = out.shape[0]
  assert out.shape == (splits, 2, 5, 8, 64) and lse.shape == (splits, 2, 8, 5)
  # 5 * 8 / 2 = 20 query rows per kv head: two 16-row tiles of counters per (sequence, kv head)
  assert splits >= 1 and counters.shape == (2 * 2 * 2,) and counters.dtype == jnp.int32
  forced = decode_schedule.workspaces(2, 5, 8, 2, 64, max_keys=10_000, num_splits=3)
  assert forced[0].shape[0] == 3


@needs_cuda
@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (True, (5, 0))])
def test_decode_schedule_standard_convention(rng, is_causal, window):
  """flash_attention(schedule="decode"): top-left causal, sequence lengths, windows."""
  b, t, n, k, s, h = 3, 4, 8, 2, 700, 128
  q = _normal(rng, (b, t, n, h), jnp.bfloat16)
  kk, vv = _normal(rng, (b, s, k, h), jnp.bfloat16), _normal(rng, (b, s, k, h), jnp.bfloat16)
  q_lens, kv_lens = np.array([4, 2, 4]), np.array([700, 333, 1])
  out = jax_flash.flash_attention(
      jnp.asarray(q, jnp.bfloat16), jnp.asarray(kk, jnp.bfloat16), jnp.asarray(vv, jnp.bfloat16),
      is_causal=is_causal, local_window_size=window, query_seq_lengths=jnp.asarray(q_lens),
      key_value_seq_lengths=jnp.asarray(kv_lens), schedule="decode")
  left, right = window if window else (-1, -1)
  want, _ = reference.attention_forward_f64(q, kk, vv, q_seqlens=q_lens, kv_seqlens=kv_lens,
                                            scale=1 / np.sqrt(h), is_causal=is_causal,
                                            window_left=left, window_right=right)
  assert_close("out", out, want, 1.2e-2)


@needs_cuda
def test_auto_dispatch_sends_short_queries_to_decode_and_gradients_flow(rng):
  shape = AttentionShape(2, 1, 512, 8, 2, 128)
  chosen = _dispatch.select("auto", shape, jnp.bfloat16, AttentionConfig(scale=1.0))
  assert chosen.name == "decode"
  q = jnp.asarray(_normal(rng, (2, 1, 8, 128), jnp.bfloat16), jnp.bfloat16)
  kv = [jnp.asarray(_normal(rng, (2, 512, 2, 128), jnp.bfloat16), jnp.bfloat16) for _ in "kv"]
  dout = _normal(rng, (2, 1, 8, 128), np.float32)

  def loss(q, k, v):
    out = jax_flash.flash_attention(q, k, v, schedule="decode")
    return jnp.sum(out.astype(jnp.float32) * dout)

  grads = jax.grad(loss, argnums=(0, 1, 2))(q, *kv)
  want = reference.attention_backward_f64(q.astype(jnp.float32), kv[0].astype(jnp.float32),
                                          kv[1].astype(jnp.float32), dout, scale=1 / np.sqrt(128))
  for name, got, w in zip(("dq", "dk", "dv"), grads, want[:3]):
    assert_close(name, got, w, 2e-2)
