// Host-side queries of the device the caller's stream runs on (the current device).
#pragma once

#include <cuda_runtime.h>

namespace jax_flash {

// *value = attribute `attr` of the current device.
inline cudaError_t current_device_attribute(cudaDeviceAttr attr, int* value) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err != cudaSuccess ? err : cudaDeviceGetAttribute(value, attr, device);
}

}  // namespace jax_flash
