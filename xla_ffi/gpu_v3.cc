// FFI target of the v3 schedule (Hopper): jax_flash_v3_fwd, the standard forward convention of
// docs/architecture.md with no workspaces. The kernel is cuda/v3_fwd_sm90.cu. v3 has no
// backward of its own: the schedule (jax_flash/schedules/v3.py) names jax_flash_v2_bwd.
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
    return ffi::Error::InvalidArgument(std::string("jax_flash_v3_fwd: ") + reason);
  }
  return LaunchStatus("jax_flash_v3_fwd", V3Forward(args, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kV3Forward, V3ForwardHandler,
                              BindForward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

JAX_FLASH_REGISTER_TARGET("jax_flash_v3_fwd", "CUDA", kV3Forward);

}  // namespace jax_flash
