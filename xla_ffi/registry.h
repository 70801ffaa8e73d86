// A static registry of FFI targets: each handler translation unit registers its own targets,
// so adding a schedule never edits module.cc.
#pragma once
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jax_flash {

struct FfiTarget {
  std::string name;      // e.g. "jax_flash_cpu_fwd"
  std::string platform;  // "cpu" or "CUDA"
  XLA_FFI_Handler* handler;
};

inline std::vector<FfiTarget>& ffi_targets() {
  static std::vector<FfiTarget> targets;
  return targets;
}

struct FfiTargetRegistrar {
  FfiTargetRegistrar(const char* name, const char* platform, XLA_FFI_Handler* handler) {
    ffi_targets().push_back({name, platform, handler});
  }
};

}  // namespace jax_flash

#define JAX_FLASH_CONCAT_INNER(a, b) a##b
#define JAX_FLASH_CONCAT(a, b) JAX_FLASH_CONCAT_INNER(a, b)
// Usage, at namespace scope after XLA_FFI_DEFINE_HANDLER_SYMBOL(Handler, ...):
//   JAX_FLASH_REGISTER_TARGET("jax_flash_cpu_fwd", "cpu", Handler);
#define JAX_FLASH_REGISTER_TARGET(name, platform, handler)                         \
  static ::jax_flash::FfiTargetRegistrar JAX_FLASH_CONCAT(jax_flash_registrar_, \
                                                           __LINE__)(name, platform, handler)
