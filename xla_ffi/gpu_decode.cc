// FFI targets of the split-KV decoding kernels (cuda/decode.h):
//
// jax_flash_decode_fwd — the standard convention of docs/architecture.md (top-left causal,
//   q_seqlens / kv_seqlens, windows, softcap; no bias or mask), for short queries. Workspaces
//   after out / lse:
//     partial_out f32 [max_splits, B, T, N, H], partial_lse f32 [max_splits, B, N, T],
//     counters s32 [>= DecodeCounterCount]
//   The split count is chosen here (DecodeAutoSplits), at most max_splits.
//
// jax_flash_decode_cache_fwd — flash_decode over a KV cache:
//   inputs  q [B, T, N, H], k_cache, v_cache (contiguous [B, S, K, H] or pages
//           [P, page_size, K, H]), cache_seqlens s32 [B], block_table s32 [B, max_pages]
//           (a dummy [1, 1] when not paged)
//   attrs   scale f32, softcap f32 (0 = off), window_left s32 (-1 = unbounded), paged bool,
//           num_splits s32 (0 = automatic, else exactly that many, <= max_splits)
//   outputs out [B, T, N, H], lse f32 [B, N, T], then the three workspaces above
//   Query t sits at position cache_seqlens[b] - T + t and sees keys <= that position.
//
// jax_flash_decode_append_fwd — the same after appending k_new / v_new [B, T, K, H] at cache
//   positions cache_seqlens[b] + t, in place: outputs k_cache, v_cache (aliased to inputs 1
//   and 2 by the caller), then out, lse and the workspaces; query t sits at
//   cache_seqlens[b] + t.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/decode.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/args.h"
#include "xla_ffi/gpu_status.h"
#include "xla_ffi/registry.h"

namespace jax_flash {
namespace {

constexpr int64_t kMaxGridYZ = 65535;

// The split workspaces: checks their shapes against `args` and stores their pointers; returns
// the largest split count they hold.
ffi::Error BindWorkspaces(const char* target, ffi::AnyBuffer partial_out,
                          ffi::AnyBuffer partial_lse, ffi::AnyBuffer counters, DecodeArgs* args,
                          int* max_splits) {
  const int64_t b = args->batch, t = args->q_len, n = args->num_heads, h = args->head_dim;
  const int64_t splits = partial_out.dimensions().size() == 5 ? partial_out.dimensions()[0] : 0;
  if (partial_out.element_type() != ffi::DataType::F32 || splits < 1 ||
      !HasShape(partial_out, {splits, b, t, n, h}))
    return TargetError(target, "workspace `partial_out` must be float32 [splits, B, T, N, H] = "
                               "[splits, " + std::to_string(b) + ", " + std::to_string(t) + ", " +
                               std::to_string(n) + ", " + std::to_string(h) + "], got " +
                               ShapeString(partial_out));
  if (partial_lse.element_type() != ffi::DataType::F32 ||
      !HasShape(partial_lse, {splits, b, n, t}))
    return TargetError(target, "workspace `partial_lse` must be float32 [" +
                               std::to_string(splits) + ", B, N, T], got " +
                               ShapeString(partial_lse));
  if (splits > kMaxGridYZ) return TargetError(target, "at most 65535 splits");
  if (counters.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(counters.element_count()) < DecodeCounterCount(*args))
    return TargetError(target, "workspace `counters` must be int32 with at least " +
                               std::to_string(DecodeCounterCount(*args)) + " elements");
  args->partial_out = static_cast<float*>(partial_out.untyped_data());
  args->partial_lse = static_cast<float*>(partial_lse.untyped_data());
  args->counters = static_cast<int32_t*>(counters.untyped_data());
  *max_splits = static_cast<int>(splits);
  return ffi::Error::Success();
}

// Picks the split count (`requested` > 0 forces it) and launches.
ffi::Error Launch(const char* target, cudaStream_t stream, DecodeArgs& args, int64_t max_keys,
                  int max_splits, int requested) {
  if (requested > max_splits)
    return TargetError(target, "num_splits " + std::to_string(requested) +
                               " exceeds the workspace's " + std::to_string(max_splits));
  int splits = requested;
  if (splits <= 0) {
    const cudaError_t status = DecodeAutoSplits(args, max_keys, max_splits, &splits);
    if (status != cudaSuccess) return LaunchStatus(target, status);
  }
  args.num_splits = splits;
  return LaunchStatus(target, LaunchDecode(args, stream));
}

// ---- the standard convention ---------------------------------------------------------------

ffi::Error StandardForwardImpl(cudaStream_t stream, InBuffer q, InBuffer k, InBuffer v,
                               InBuffer bias, InBuffer mask, InBuffer q_seqlens,
                               InBuffer kv_seqlens, AttentionAttrs attrs, OutBuffer out,
                               OutBuffer lse, OutBuffer partial_out, OutBuffer partial_lse,
                               OutBuffer counters) {
  constexpr const char* kTarget = "jax_flash_decode_fwd";
  ForwardArgs fwd;
  ffi::Error err =
      DecodeForward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, attrs, *out, *lse, &fwd);
  if (err.failure()) return err;
  if (attrs.has_bias || attrs.has_mask)
    return TargetError(kTarget, "bias and mask tensors are not supported by the decode schedule");
  const AttentionShape& s = fwd.shape;
  if (!DecodeSupports(s.head_dim, fwd.dtype))
    return TargetError(kTarget, "needs bfloat16 / float16 and head dim 64, 128 or 256; got "
                                "head dim " + std::to_string(s.head_dim));
  if (s.batch > kMaxGridYZ || s.kv_len >= (int64_t(1) << 31) || s.q_len >= (1 << 20))
    return TargetError(kTarget, "batch must be <= 65535 and lengths < 2^31");
  DecodeArgs args;
  args.batch = static_cast<int32_t>(s.batch);
  args.q_len = static_cast<int32_t>(s.q_len);
  args.num_heads = static_cast<int32_t>(s.num_heads);
  args.num_kv_heads = static_cast<int32_t>(s.num_kv_heads);
  args.head_dim = static_cast<int32_t>(s.head_dim);
  args.dtype = fwd.dtype;
  args.scale = fwd.spec.scale;
  args.softcap = fwd.spec.softcap;
  args.is_causal = fwd.spec.is_causal;
  args.causal_from_end = false;
  args.window_left = fwd.spec.window_left;
  args.window_right = fwd.spec.window_right;
  args.q = fwd.q;
  args.k = const_cast<void*>(fwd.k);  // read only: no append
  args.v = const_cast<void*>(fwd.v);
  args.capacity = s.kv_len;
  args.cache_seqlens = fwd.kv_seqlens;
  args.q_seqlens = fwd.q_seqlens;
  args.out = fwd.out;
  args.lse = fwd.lse;
  int max_splits = 0;
  if ((err = BindWorkspaces(kTarget, *partial_out, *partial_lse, *counters, &args, &max_splits))
          .failure())
    return err;
  return Launch(kTarget, stream, args, s.kv_len, max_splits, 0);
}

// ---- flash_decode over a KV cache ----------------------------------------------------------

struct CacheAttrs {
  float scale;
  float softcap;
  int32_t window_left;
  bool paged;
  int32_t num_splits;
};

// Validates q / caches / lengths / table (and the new rows when given) and fills `args`;
// `k_cache` / `v_cache` are the buffers the kernel reads (and, appending, writes).
ffi::Error DecodeCacheInputs(const char* target, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                             ffi::AnyBuffer v_cache, ffi::AnyBuffer cache_seqlens,
                             ffi::AnyBuffer block_table, const ffi::AnyBuffer* k_new,
                             const ffi::AnyBuffer* v_new, const CacheAttrs& attrs,
                             DecodeArgs* args) {
  if (q.dimensions().size() != 4)
    return TargetError(target, "`q` must be [B, T, N, H], got " + ShapeString(q));
  switch (q.element_type()) {
    case ffi::DataType::BF16: args->dtype = DType::kBF16; break;
    case ffi::DataType::F16: args->dtype = DType::kF16; break;
    default: return TargetError(target, "`q` must be bfloat16 or float16");
  }
  const auto qd = q.dimensions();
  const int64_t b = qd[0], t = qd[1], n = qd[2], h = qd[3];
  if (!DecodeSupports(h, args->dtype))
    return TargetError(target, "head dim must be 64, 128 or 256");
  if (k_cache.dimensions().size() != 4 || k_cache.element_type() != q.element_type())
    return TargetError(target, "`k_cache` must be a rank-4 array of q's dtype, got " +
                               ShapeString(k_cache));
  const auto kd = k_cache.dimensions();
  const int64_t k = kd[2];
  if (kd[3] != h || k <= 0 || n % k != 0)
    return TargetError(target, "`k_cache` " + ShapeString(k_cache) + " must have head dim " +
                               std::to_string(h) + " and kv heads dividing " + std::to_string(n));
  if (v_cache.element_type() != k_cache.element_type() || !HasShape(v_cache, {kd[0], kd[1], k, h}))
    return TargetError(target, "`v_cache` must match `k_cache` " + ShapeString(k_cache));
  if (cache_seqlens.element_type() != ffi::DataType::S32 || !HasShape(cache_seqlens, {b}))
    return TargetError(target,
                       "`cache_seqlens` must be int32 [B], got " + ShapeString(cache_seqlens));
  if (b > kMaxGridYZ || t >= (1 << 20)) return TargetError(target, "batch must be <= 65535");
  if (attrs.window_left < -1) return TargetError(target, "`window_left` must be >= -1");
  if (!(attrs.softcap >= 0.f)) return TargetError(target, "`softcap` must be >= 0");
  if (attrs.paged) {
    const int64_t page_size = kd[1];
    if (page_size <= 0 || (page_size & (page_size - 1)) != 0)
      return TargetError(target, "the page size (k_cache dim 1) must be a power of two");
    if (block_table.element_type() != ffi::DataType::S32 ||
        block_table.dimensions().size() != 2 || block_table.dimensions()[0] != b)
      return TargetError(target, "`block_table` must be int32 [B, max_pages], got " +
                                 ShapeString(block_table));
    args->max_pages = static_cast<int32_t>(block_table.dimensions()[1]);
    args->capacity = int64_t(args->max_pages) * page_size;
    args->num_pages = kd[0];
    args->block_table = static_cast<const int32_t*>(block_table.untyped_data());
    int log2 = 0;
    while ((int64_t(1) << log2) < page_size) ++log2;
    args->page_size_log2 = log2;
    if (kd[0] * page_size >= (int64_t(1) << 31))
      return TargetError(target, "the page pool must hold fewer than 2^31 rows");
  } else {
    if (kd[0] != b)
      return TargetError(target, "`k_cache` batch must equal q's, got " + ShapeString(k_cache));
    args->capacity = kd[1];
  }
  if (args->capacity + t >= (int64_t(1) << 31)) return TargetError(target, "cache too long");
  if (k_new != nullptr) {
    for (auto [name, buf] : {std::pair{"k_new", k_new}, std::pair{"v_new", v_new}})
      if (buf->element_type() != q.element_type() || !HasShape(*buf, {b, t, k, h}))
        return TargetError(target, std::string("`") + name + "` must be [B, T, K, H] = [" +
                                   std::to_string(b) + ", " + std::to_string(t) + ", " +
                                   std::to_string(k) + ", " + std::to_string(h) +
                                   "] of q's dtype, got " + ShapeString(*buf));
    args->k_new = k_new->untyped_data();
    args->v_new = v_new->untyped_data();
  }
  args->batch = static_cast<int32_t>(b);
  args->q_len = static_cast<int32_t>(t);
  args->num_heads = static_cast<int32_t>(n);
  args->num_kv_heads = static_cast<int32_t>(k);
  args->head_dim = static_cast<int32_t>(h);
  args->scale = attrs.scale;
  args->softcap = attrs.softcap;
  args->is_causal = true;
  args->causal_from_end = true;
  args->window_left = attrs.window_left;
  args->window_right = -1;
  args->q = q.untyped_data();
  args->k = k_cache.untyped_data();
  args->v = v_cache.untyped_data();
  args->cache_seqlens = static_cast<const int32_t*>(cache_seqlens.untyped_data());
  return ffi::Error::Success();
}

ffi::Error BindOutputs(const char* target, ffi::AnyBuffer q, ffi::AnyBuffer out,
                       ffi::AnyBuffer lse, DecodeArgs* args) {
  if (out.element_type() != q.element_type() || !HasShape(out, {args->batch, args->q_len,
                                                                args->num_heads, args->head_dim}))
    return TargetError(target, "`out` must have q's shape and dtype");
  if (lse.element_type() != ffi::DataType::F32 ||
      !HasShape(lse, {args->batch, args->num_heads, args->q_len}))
    return TargetError(target, "`lse` must be float32 [B, N, T]");
  args->out = out.untyped_data();
  args->lse = static_cast<float*>(lse.untyped_data());
  return ffi::Error::Success();
}

ffi::Error CacheForwardImpl(cudaStream_t stream, InBuffer q, InBuffer k_cache, InBuffer v_cache,
                            InBuffer cache_seqlens, InBuffer block_table, float scale,
                            float softcap, int32_t window_left, bool paged, int32_t num_splits,
                            OutBuffer out, OutBuffer lse, OutBuffer partial_out,
                            OutBuffer partial_lse, OutBuffer counters) {
  constexpr const char* kTarget = "jax_flash_decode_cache_fwd";
  const CacheAttrs attrs{scale, softcap, window_left, paged, num_splits};
  DecodeArgs args;
  ffi::Error err;
  int max_splits = 0;
  if ((err = DecodeCacheInputs(kTarget, q, k_cache, v_cache, cache_seqlens, block_table, nullptr,
                               nullptr, attrs, &args))
          .failure() ||
      (err = BindOutputs(kTarget, q, *out, *lse, &args)).failure() ||
      (err = BindWorkspaces(kTarget, *partial_out, *partial_lse, *counters, &args, &max_splits))
          .failure())
    return err;
  return Launch(kTarget, stream, args, args.capacity, max_splits, num_splits);
}

ffi::Error AppendForwardImpl(cudaStream_t stream, InBuffer q, InBuffer k_cache_in,
                             InBuffer v_cache_in, InBuffer cache_seqlens, InBuffer block_table,
                             InBuffer k_new, InBuffer v_new, float scale, float softcap,
                             int32_t window_left, bool paged, int32_t num_splits,
                             OutBuffer k_cache, OutBuffer v_cache, OutBuffer out, OutBuffer lse,
                             OutBuffer partial_out, OutBuffer partial_lse, OutBuffer counters) {
  constexpr const char* kTarget = "jax_flash_decode_append_fwd";
  const CacheAttrs attrs{scale, softcap, window_left, paged, num_splits};
  DecodeArgs args;
  ffi::Error err;
  int max_splits = 0;
  if ((err = DecodeCacheInputs(kTarget, q, *k_cache, *v_cache, cache_seqlens, block_table, &k_new,
                               &v_new, attrs, &args))
          .failure() ||
      (err = BindOutputs(kTarget, q, *out, *lse, &args)).failure() ||
      (err = BindWorkspaces(kTarget, *partial_out, *partial_lse, *counters, &args, &max_splits))
          .failure())
    return err;
  // The caller aliases the cache outputs to inputs 1 and 2 (in place); should XLA hand over
  // distinct buffers, the output starts as a copy of the input.
  for (auto [from, to] : {std::pair{k_cache_in, *k_cache}, std::pair{v_cache_in, *v_cache}}) {
    if (from.untyped_data() == to.untyped_data()) continue;
    const cudaError_t status = cudaMemcpyAsync(to.untyped_data(), from.untyped_data(),
                                               from.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (status != cudaSuccess) return LaunchStatus(kTarget, status);
  }
  return Launch(kTarget, stream, args, args.capacity + args.q_len, max_splits, num_splits);
}

// q, k_cache, v_cache, cache_seqlens, block_table.
template <typename Binding>
auto BindCacheInputs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>();
}

template <typename Binding>
auto BindCacheAttrs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Attr<int32_t>("window_left")
      .template Attr<bool>("paged")
      .template Attr<int32_t>("num_splits");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashDecodeForward, StandardForwardImpl,
                              BindForward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>()    // partial_out
                                  .Ret<ffi::AnyBuffer>()    // partial_lse
                                  .Ret<ffi::AnyBuffer>());  // counters
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashDecodeCacheForward, CacheForwardImpl,
                              BindCacheAttrs(BindCacheInputs(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()))
                                  .Ret<ffi::AnyBuffer>()    // out
                                  .Ret<ffi::AnyBuffer>()    // lse
                                  .Ret<ffi::AnyBuffer>()    // partial_out
                                  .Ret<ffi::AnyBuffer>()    // partial_lse
                                  .Ret<ffi::AnyBuffer>());  // counters
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashDecodeAppendForward, AppendForwardImpl,
                              BindCacheAttrs(BindCacheInputs(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                                 .Arg<ffi::AnyBuffer>()   // k_new
                                                 .Arg<ffi::AnyBuffer>())  // v_new
                                  .Ret<ffi::AnyBuffer>()    // k_cache (aliases input 1)
                                  .Ret<ffi::AnyBuffer>()    // v_cache (aliases input 2)
                                  .Ret<ffi::AnyBuffer>()    // out
                                  .Ret<ffi::AnyBuffer>()    // lse
                                  .Ret<ffi::AnyBuffer>()    // partial_out
                                  .Ret<ffi::AnyBuffer>()    // partial_lse
                                  .Ret<ffi::AnyBuffer>());  // counters

JAX_FLASH_REGISTER_TARGET("jax_flash_decode_fwd", "CUDA", JaxFlashDecodeForward);
JAX_FLASH_REGISTER_TARGET("jax_flash_decode_cache_fwd", "CUDA", JaxFlashDecodeCacheForward);
JAX_FLASH_REGISTER_TARGET("jax_flash_decode_append_fwd", "CUDA", JaxFlashDecodeAppendForward);

}  // namespace jax_flash
