// FFI targets of the CPU schedule: jax_flash_cpu_fwd / jax_flash_cpu_bwd, exactly the
// convention of docs/architecture.md (no workspaces: the kernel allocates O(tile) itself).
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/args.h"
#include "xla_ffi/cpu/attention.h"
#include "xla_ffi/registry.h"

namespace jax_flash {
namespace {

ffi::Error KernelResult(const std::string& error) {
  return error.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(error);
}

ffi::Error CpuForward(InBuffer q, InBuffer k, InBuffer v, InBuffer bias, InBuffer mask,
                      InBuffer q_seqlens, InBuffer kv_seqlens, AttentionAttrs attrs,
                      OutBuffer out, OutBuffer lse) {
  ForwardArgs args;
  ffi::Error err =
      DecodeForward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, attrs, *out, *lse, &args);
  if (err.failure()) return err;
  return KernelResult(cpu::Forward(args));
}

ffi::Error CpuBackward(InBuffer q, InBuffer k, InBuffer v, InBuffer bias, InBuffer mask,
                       InBuffer q_seqlens, InBuffer kv_seqlens, InBuffer out, InBuffer lse,
                       InBuffer dout, AttentionAttrs attrs, OutBuffer dq, OutBuffer dk,
                       OutBuffer dv, OutBuffer dbias) {
  BackwardArgs args;
  ffi::Error err = DecodeBackward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, out, lse, dout,
                                  attrs, *dq, *dk, *dv, *dbias, &args);
  if (err.failure()) return err;
  return KernelResult(cpu::Backward(args));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuForward, CpuForward, BindForward(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuBackward, CpuBackward, BindBackward(ffi::Ffi::Bind()));

JAX_FLASH_REGISTER_TARGET("jax_flash_cpu_fwd", "cpu", kCpuForward);
JAX_FLASH_REGISTER_TARGET("jax_flash_cpu_bwd", "cpu", kCpuBackward);

}  // namespace jax_flash
