// Probe: exp2 throughput of the MUFU unit on an sm_90 GPU for f32 operands and for the packed
// f16x2 / bf16x2 forms of ex2.approx, i.e. whether a packed exp2 would lift the softmax's exp
// ceiling (docs/perf-notes-v3.md, "packed exp2"). Each thread runs 8 independent dependency chains
// of exp2 plus an add (so that the values stay in range and the chain cannot be folded).
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tests/gpu/mufu_probe.cu -o /tmp/mufu_probe
// Prints the best of 5 timed launches per form: instructions per second and exponentials per
// second (2 per packed instruction). Then (session 21, docs/perf-notes.md) the f32 form and a
// softmax's mix (FFMA, ex2, a row sum, a bf16x2 pack per two) by warps per sub-core, one CTA per
// SM: how close one warp per sub-core, as a v3 consumer warpgroup's softmax runs, comes to the
// MUFU's 16 exponentials per SM clock.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

namespace {

constexpr int kIters = 4096;
constexpr int kChains = 8;

// One exp2 form: its operand register type, the PTX of exp2 and of "add -1.5", and how many
// exponentials one instruction makes.
struct F32 {
  using Reg = float;
  static constexpr int kPerInstruction = 1;
  __device__ static Reg init(float x) { return x; }
  __device__ static Reg step(Reg a) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
    return y - 1.5f;
  }
  __device__ static float sum(Reg a) { return a; }
};

// The packed forms (T2: __half2 or __nv_bfloat162), in PTX: cuda_fp16 / cuda_bf16's h2exp2
// goes through f32 exponentials instead (nvcc 13.0).
__device__ __half2 pair(float lo, float hi, __half2) { return __floats2half2_rn(lo, hi); }
__device__ __nv_bfloat162 pair(float lo, float hi, __nv_bfloat162) {
  return __floats2bfloat162_rn(lo, hi);
}

template <class T2>
struct Packed {
  using Reg = uint32_t;
  static constexpr int kPerInstruction = 2;
  __device__ static Reg init(float x) {
    const T2 h = pair(x, x * 0.5f, T2{});
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ static Reg step(Reg a) {
    uint32_t y, z;
    if constexpr (std::is_same_v<T2, __half2>) {
      asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(a));
      asm volatile("add.rn.f16x2 %0, %1, %2;" : "=r"(z) : "r"(y), "r"(0xBE00BE00u));  // -1.5
    } else {
      asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(a));
      asm volatile("add.rn.bf16x2 %0, %1, %2;" : "=r"(z) : "r"(y), "r"(0xBFC0BFC0u));  // -1.5
    }
    return z;
  }
  __device__ static float sum(Reg a) {
    const T2 h = *reinterpret_cast<const T2*>(&a);
    return __low2float(h) + __high2float(h);
  }
};

// With `clocks` (one per CTA), the clocks a CTA spends in its loop, between two barriers so that
// its slowest warp counts; null: not clocked.
__device__ long long start_cta_clock(const long long* clocks) {
  if (clocks != nullptr) __syncthreads();
  return clock64();
}
__device__ void stop_cta_clock(long long* clocks, long long start) {
  if (clocks == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) clocks[blockIdx.x] = clock64() - start;
}

template <class Form>
__global__ void exp2_chains(float* out, float seed, long long* clocks) {
  typename Form::Reg a[kChains];
#pragma unroll
  for (int j = 0; j < kChains; ++j) a[j] = Form::init(-(seed + threadIdx.x * 1e-6f + j * 1e-3f));
  const long long start = start_cta_clock(clocks);
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) a[j] = Form::step(a[j]);
  }
  stop_cta_clock(clocks, start);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kChains; ++j) s += Form::sum(a[j]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <class Form>
bool measure(const char* name) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int blocks = sms * 4, threads = 512;
  float* out = nullptr;
  if (cudaMalloc(&out, sizeof(float) * blocks * threads) != cudaSuccess) return false;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  exp2_chains<Form><<<blocks, threads>>>(out, 0.5f, nullptr);  // warm-up
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(start);
    exp2_chains<Form><<<blocks, threads>>>(out, 0.5f, nullptr);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    if (ms < best) best = ms;
  }
  const cudaError_t err = cudaGetLastError();
  const double instructions = double(blocks) * threads * kIters * kChains;
  std::printf("%-7s %.3f ms  %.2f T instructions/s  %.2f T exp2/s  (%s)\n", name, best,
              instructions / best / 1e9, instructions * Form::kPerInstruction / best / 1e9,
              cudaGetErrorString(err));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(out);
  return err == cudaSuccess;
}

// Per element: x = fma(v, a, b), p = exp2(x), a row sum (two rows, alternately), half a bf16x2
// pack; the next value depends on p, so that the chains cannot be folded.
__global__ void softmax_mix(float* out, long long* clocks) {
  float v[16], sum0 = 0.f, sum1 = 0.f;
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = -0.01f * float(i + threadIdx.x % 7);
  const long long start = start_cta_clock(clocks);
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      const float lo = F32::step(fmaf(v[i], 0.999f, -0.001f)) + 1.5f;
      const float hi = F32::step(fmaf(v[i + 1], 0.999f, -0.001f)) + 1.5f;
      sum0 += lo;
      sum1 += hi;
      const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
      packed ^= *reinterpret_cast<const uint32_t*>(&p);
      v[i] = lo - 1.f;
      v[i + 1] = hi - 1.f;
    }
  }
  stop_cta_clock(clocks, start);
  float s = sum0 + sum1 + float(packed & 1);
#pragma unroll
  for (int i = 0; i < 16; ++i) s += v[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Exponentials per SM clock with one CTA of `warps_per_sub_core` x 4 warps per SM, for 1, 2 and 4
// warps per sub-core; launch(ctas, threads, out, clocks) runs the kernel, per_thread its exp2
// instructions per thread and iteration.
template <class Launch>
bool by_warps(const char* name, Launch launch, int per_thread) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* clocks = nullptr;
  float* out = nullptr;
  bool ok = cudaMalloc(&clocks, sizeof(long long) * sms) == cudaSuccess &&
            cudaMalloc(&out, sizeof(float) * sms * 512) == cudaSuccess;
  std::vector<long long> host(sms);
  for (const int warps_per_sub_core : {1, 2, 4}) {
    if (!ok) break;
    const int threads = 128 * warps_per_sub_core;
    launch(sms, threads, out, clocks);  // warm-up
    launch(sms, threads, out, clocks);
    cudaMemcpy(host.data(), clocks, sizeof(long long) * sms, cudaMemcpyDeviceToHost);
    const long long most = *std::max_element(host.begin(), host.end());
    const cudaError_t err = cudaGetLastError();
    const double per_warp = double(kIters) * per_thread;  // exp2 instructions per warp
    std::printf("%-12s %d warp(s) per sub-core: %5.2f exp2 per SM clock (of 16); a warp's exp2 "
                "every %.1f clocks  (%s)\n",
                name, warps_per_sub_core, per_warp * threads / double(most),
                double(most) / per_warp, cudaGetErrorString(err));
    ok &= err == cudaSuccess;
  }
  cudaFree(clocks);
  cudaFree(out);
  return ok;
}

}  // namespace

int main() {
  bool ok = measure<F32>("f32");
  ok &= measure<Packed<__half2>>("f16x2");
  ok &= measure<Packed<__nv_bfloat162>>("bf16x2");
  ok &= by_warps(
      "f32 chains",
      [](int ctas, int threads, float* out, long long* clocks) {
        exp2_chains<F32><<<ctas, threads>>>(out, 0.5f, clocks);
      },
      kChains);
  ok &= by_warps(
      "softmax mix",
      [](int ctas, int threads, float* out, long long* clocks) {
        softmax_mix<<<ctas, threads>>>(out, clocks);
      },
      16);
  return ok ? 0 : 1;
}
