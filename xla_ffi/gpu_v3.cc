// FFI targets of the v3 schedule (Hopper), the standard convention of docs/architecture.md:
//   jax_flash_v3_fwd: no workspaces; kernel cuda/v3_fwd_sm90.cu.
//   jax_flash_v3_bwd: five workspaces after dbias (extra outputs, because XLA frees scratch
//     memory before the queued kernels run), sized by V3BackwardWorkspaceSizes with
//     deterministic = true whatever the attribute says (the semaphores are 1/64 of a row's
//     floats, and one size keeps the Python side free of the attribute):
//       dq_accum f32 [B, N, T_pad, H], dsum f32 [B, N, T_pad], lse_log2 f32 [B, N, T_pad],
//       dq_semaphore s32 [B * N * T_pad / 64]            (T_pad = T rounded up to 128),
//       dkv_partial f32 [2 * s * B * S * K * H] with s = max(V3BackwardMaxKvSplit(shape),
//         V3BackwardMaxBlockParts(shape)) > 1, else f32 [1] (few key blocks x kv heads x batch:
//         a GQA group's query heads split over CTAs, or key blocks cut into CTAs; their fp32
//         dK / dV partials summed by a reduce kernel)
//     kernels cuda/v3_bwd_sm90.cu. Calls outside its envelope (bias, mask) never reach it: the
//     dispatch sends them to v2 (jax_flash/schedules/v3.py); here they are refused.
#include <cuda_runtime.h>

#include <string>

#include "cuda/v3.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/args.h"
#include "xla_ffi/gpu_status.h"
#include "xla_ffi/registry.h"

namespace jax_flash {
namespace {

ffi::Error V3ForwardHandler(cudaStream_t stream, InBuffer q, InBuffer k, InBuffer v,
                            InBuffer bias, InBuffer mask, InBuffer q_seqlens,
                            InBuffer kv_seqlens, AttentionAttrs attrs, OutBuffer out,
                            OutBuffer lse) {
  ForwardArgs args;
  ffi::Error err =
      DecodeForward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, attrs, *out, *lse, &args);
  if (err.failure()) return err;
  if (const char* reason = V3ForwardUnsupportedReason(args)) {
    return TargetError("jax_flash_v3_fwd", reason);
  }
  return LaunchStatus("jax_flash_v3_fwd", V3Forward(args, stream));
}

ffi::Error V3BackwardHandler(cudaStream_t stream, InBuffer q, InBuffer k, InBuffer v,
                             InBuffer bias, InBuffer mask, InBuffer q_seqlens,
                             InBuffer kv_seqlens, InBuffer out, InBuffer lse, InBuffer dout,
                             AttentionAttrs attrs, OutBuffer dq, OutBuffer dk, OutBuffer dv,
                             OutBuffer dbias, OutBuffer dq_accum, OutBuffer dsum,
                             OutBuffer lse_log2, OutBuffer dq_semaphore,
                             OutBuffer dkv_partial) {
  constexpr const char* kTarget = "jax_flash_v3_bwd";
  BackwardArgs args;
  ffi::Error err = DecodeBackward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, out, lse, dout,
                                  attrs, *dq, *dk, *dv, *dbias, &args);
  if (err.failure()) return err;
  if (const char* reason = V3BackwardUnsupportedReason(args)) {
    return TargetError(kTarget, reason);
  }
  const V3BackwardWorkspaceBytes bytes = V3BackwardWorkspaceSizes(args.fwd.shape, true);
  using ffi::DataType;
  if ((err = CheckWorkspace(kTarget, "dq_accum", *dq_accum, DataType::F32, bytes.dq_accum / 4))
          .failure() ||
      (err = CheckWorkspace(kTarget, "dsum", *dsum, DataType::F32, bytes.dsum / 4)).failure() ||
      (err = CheckWorkspace(kTarget, "lse_log2", *lse_log2, DataType::F32, bytes.lse_log2 / 4))
          .failure() ||
      (err = CheckWorkspace(kTarget, "dq_semaphore", *dq_semaphore, DataType::S32,
                            bytes.dq_semaphore / 4)).failure() ||
      (err = CheckWorkspace(kTarget, "dkv_partial", *dkv_partial, DataType::F32,
                            bytes.dkv_partial / 4)).failure())
    return err;
  const V3BackwardWorkspace workspace{static_cast<float*>(dq_accum->untyped_data()),
                                      static_cast<float*>(dsum->untyped_data()),
                                      static_cast<float*>(lse_log2->untyped_data()),
                                      static_cast<int32_t*>(dq_semaphore->untyped_data()),
                                      static_cast<float*>(dkv_partial->untyped_data())};
  return LaunchStatus(kTarget, V3Backward(args, workspace, attrs.deterministic, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kV3Forward, V3ForwardHandler,
                              BindForward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kV3Backward, V3BackwardHandler,
                              BindBackward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>()    // dq_accum
                                  .Ret<ffi::AnyBuffer>()    // dsum
                                  .Ret<ffi::AnyBuffer>()    // lse_log2
                                  .Ret<ffi::AnyBuffer>()    // dq_semaphore
                                  .Ret<ffi::AnyBuffer>());  // dkv_partial

JAX_FLASH_REGISTER_TARGET("jax_flash_v3_fwd", "CUDA", kV3Forward);
JAX_FLASH_REGISTER_TARGET("jax_flash_v3_bwd", "CUDA", kV3Backward);

}  // namespace jax_flash
