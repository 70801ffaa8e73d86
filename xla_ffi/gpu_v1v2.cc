// FFI targets of the sm_80 schedules v1 (FlashAttention-1) and v2 (FlashAttention-2):
// jax_flash_v{1,2}_{fwd,bwd}, the standard convention of docs/architecture.md plus workspaces
// (extra outputs, because XLA frees scratch memory before the queued kernels run):
//   jax_flash_v1_fwd:  o_accum  f32 [B, N, T, H]
//   jax_flash_v{1,2}_bwd: dq_accum f32 [B, N, T, H], dsum f32 [B, N, T]
// The kernels are cuda/v1.cu, cuda/v2.cu, cuda/backward.cu (launchers in cuda/v1v2.h).
#include <cuda_runtime.h>

#include <string>

#include "cuda/v1v2.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/args.h"
#include "xla_ffi/gpu_status.h"
#include "xla_ffi/registry.h"

namespace jax_flash {
namespace {

// What the kernels take beyond the convention: 16-bit elements, head dims a multiple of 8 up
// to 256 (the Python schedule pads the head dim to that multiple).
ffi::Error CheckSupported(const char* target, const ForwardArgs& args) {
  if (args.dtype == DType::kF32) return TargetError(target, "`q` must be bfloat16 or float16");
  const int64_t h = args.shape.head_dim;
  if (h <= 0 || h > kV1V2MaxHeadDim || h % kV1V2HeadDimMultiple != 0)
    return TargetError(target, "head dim " + std::to_string(h) + " must be a multiple of " +
                               std::to_string(kV1V2HeadDimMultiple) + " in [8, " +
                               std::to_string(kV1V2MaxHeadDim) + "]");
  return ffi::Error::Success();
}

ffi::Error V1ForwardImpl(cudaStream_t stream, InBuffer q, InBuffer k, InBuffer v, InBuffer bias,
                         InBuffer mask, InBuffer q_seqlens, InBuffer kv_seqlens,
                         AttentionAttrs attrs, OutBuffer out, OutBuffer lse,
                         OutBuffer o_accum) {
  constexpr const char* kTarget = "jax_flash_v1_fwd";
  ForwardArgs args;
  ffi::Error err =
      DecodeForward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, attrs, *out, *lse, &args);
  if (err.failure()) return err;
  if ((err = CheckSupported(kTarget, args)).failure()) return err;
  if ((err = CheckWorkspace(kTarget, "o_accum", *o_accum, ffi::DataType::F32,
                            v1_forward_accum_elements(args.shape))).failure())
    return err;
  return LaunchStatus(kTarget,
                      launch_v1_forward(args, static_cast<float*>(o_accum->untyped_data()), stream));
}

ffi::Error V2ForwardImpl(cudaStream_t stream, InBuffer q, InBuffer k, InBuffer v, InBuffer bias,
                         InBuffer mask, InBuffer q_seqlens, InBuffer kv_seqlens,
                         AttentionAttrs attrs, OutBuffer out, OutBuffer lse) {
  constexpr const char* kTarget = "jax_flash_v2_fwd";
  ForwardArgs args;
  ffi::Error err =
      DecodeForward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, attrs, *out, *lse, &args);
  if (err.failure()) return err;
  if ((err = CheckSupported(kTarget, args)).failure()) return err;
  return LaunchStatus(kTarget, launch_v2_forward(args, stream));
}

using BackwardLauncher = cudaError_t (*)(const BackwardArgs&, const BackwardWorkspace&,
                                         cudaStream_t);

constexpr char kV1BackwardTarget[] = "jax_flash_v1_bwd";
constexpr char kV2BackwardTarget[] = "jax_flash_v2_bwd";

// kRepeatable: the launcher's dQ is bitwise repeatable (v1 adds a key block's dQ rows with
// plain read-modify-writes in key order; v2 with fp32 atomics in completion order).
template <BackwardLauncher kLaunch, const char* kTarget, bool kRepeatable>
ffi::Error BackwardImpl(cudaStream_t stream, InBuffer q, InBuffer k, InBuffer v, InBuffer bias,
                        InBuffer mask, InBuffer q_seqlens, InBuffer kv_seqlens, InBuffer out,
                        InBuffer lse, InBuffer dout, AttentionAttrs attrs, OutBuffer dq,
                        OutBuffer dk, OutBuffer dv, OutBuffer dbias, OutBuffer dq_accum,
                        OutBuffer dsum) {
  BackwardArgs args;
  ffi::Error err = DecodeBackward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, out, lse, dout,
                                  attrs, *dq, *dk, *dv, *dbias, &args);
  if (err.failure()) return err;
  if ((err = CheckSupported(kTarget, args.fwd)).failure()) return err;
  if (attrs.deterministic && !kRepeatable)
    return TargetError(kTarget, "deterministic=true: this backward adds dQ with fp32 atomics");
  const AttentionShape& shape = args.fwd.shape;
  if ((err = CheckWorkspace(kTarget, "dq_accum", *dq_accum, ffi::DataType::F32,
                            backward_dq_accum_elements(shape))).failure() ||
      (err = CheckWorkspace(kTarget, "dsum", *dsum, ffi::DataType::F32,
                            backward_dsum_elements(shape))).failure())
    return err;
  const BackwardWorkspace workspace{static_cast<float*>(dq_accum->untyped_data()),
                                    static_cast<float*>(dsum->untyped_data())};
  return LaunchStatus(kTarget, kLaunch(args, workspace, stream));
}

constexpr auto* V1BackwardImpl = &BackwardImpl<launch_v1_backward, kV1BackwardTarget, true>;
constexpr auto* V2BackwardImpl = &BackwardImpl<launch_v2_backward, kV2BackwardTarget, false>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashV1Forward, V1ForwardImpl,
                              BindForward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>());  // o_accum
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashV2Forward, V2ForwardImpl,
                              BindForward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashV1Backward, V1BackwardImpl,
                              BindBackward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>()    // dq_accum
                                  .Ret<ffi::AnyBuffer>());  // dsum
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashV2Backward, V2BackwardImpl,
                              BindBackward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::AnyBuffer>()    // dq_accum
                                  .Ret<ffi::AnyBuffer>());  // dsum

JAX_FLASH_REGISTER_TARGET("jax_flash_v1_fwd", "CUDA", JaxFlashV1Forward);
JAX_FLASH_REGISTER_TARGET("jax_flash_v2_fwd", "CUDA", JaxFlashV2Forward);
JAX_FLASH_REGISTER_TARGET("jax_flash_v1_bwd", "CUDA", JaxFlashV1Backward);
JAX_FLASH_REGISTER_TARGET("jax_flash_v2_bwd", "CUDA", JaxFlashV2Backward);

}  // namespace jax_flash
