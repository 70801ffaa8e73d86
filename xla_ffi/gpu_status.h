// CUDA status -> FFI error, shared by the GPU handlers (gpu_*.cc).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_flash {

// An Internal error naming the FFI target when a launch (or a stream operation) failed.
inline ::xla::ffi::Error LaunchStatus(const char* target, cudaError_t status) {
  if (status == cudaSuccess) return ::xla::ffi::Error::Success();
  return ::xla::ffi::Error::Internal(std::string(target) + ": " + cudaGetErrorString(status));
}

}  // namespace jax_flash
