// Shared by the standalone CUDA harnesses (tests/gpu/harness_*.cu): error checks and the host
// side of 16-bit floats.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

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

// Every element of a 16-bit device copy, widened.
inline std::vector<double> to_double(const std::vector<uint16_t>& x, jax_flash::DType dtype) {
  std::vector<double> d(x.size());
  for (size_t i = 0; i < x.size(); ++i) d[i] = to_float(x[i], dtype);
  return d;
}

// Runs fn(i) for i in [0, n) on all host cores (the float64 references are the slow part).
inline void parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  const size_t workers = std::max<size_t>(1, std::thread::hardware_concurrency());
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (size_t w = 0; w < std::min(workers, n); ++w)
    pool.emplace_back([&] {
      for (size_t i; (i = next++) < n;) fn(i);
    });
  for (auto& th : pool) th.join();
}

__device__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Standard normal values (Box-Muller on a counter-based hash), rounded to T.
template <typename T>
__global__ void fill_normal(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed ^ (uint64_t(i) * 0x2545F4914F6CDD1Dull));
    const float u1 = (float(r >> 40) + 1.f) * (1.f / 16777217.f);  // (0, 1]
    const float u2 = float((r >> 16) & 0xFFFFFF) * (1.f / 16777216.f);
    x[i] = T(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// Fills n bf16 / f16 device elements with random normal values.
inline void fill_random(jax_flash::DType dtype, void* x, int64_t n, uint64_t seed) {
  if (n == 0) return;
  if (dtype == jax_flash::DType::kBF16)
    fill_normal<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), n, seed);
  else
    fill_normal<<<1024, 256>>>(static_cast<__half*>(x), n, seed);
  CUDA_CHECK(cudaGetLastError());
}

// The properties of device 0, printed as the first line of a harness's output.
inline cudaDeviceProp announce_device() {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  return prop;
}

}  // namespace harness
