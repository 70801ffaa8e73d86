// Shared by the standalone CUDA harnesses (tests/gpu/harness_*.cu): error checks and the host
// side of 16-bit floats.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../cuda/attention_args.h"

// Every CUDA call of a harness goes through this: a failure ends the run with exit code 2.
#define CUDA_CHECK(expr)                                                                  \
  do {                                                                                    \
    cudaError_t err_ = (expr);                                                            \
    if (err_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr,           \
                   cudaGetErrorString(err_));                                             \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)

namespace harness {

// The bits of x rounded to bf16 or f16 (round to nearest even).
inline uint16_t to_bits(float x, jax_flash::DType dtype) {
  uint16_t bits;
  if (dtype == jax_flash::DType::kBF16) {
    const __nv_bfloat16 v = __float2bfloat16(x);
    std::memcpy(&bits, &v, 2);
  } else {
    const __half v = __float2half(x);
    std::memcpy(&bits, &v, 2);
  }
  return bits;
}

// The value of bf16 or f16 bits (exact in float).
inline float to_float(uint16_t bits, jax_flash::DType dtype) {
  if (dtype == jax_flash::DType::kBF16) {
    __nv_bfloat16 v;
    std::memcpy(&v, &bits, 2);
    return __bfloat162float(v);
  }
  __half v;
  std::memcpy(&v, &bits, 2);
  return __half2float(v);
}

}  // namespace harness
