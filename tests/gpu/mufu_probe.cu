// Probe: exp2 throughput of the MUFU unit on an sm_90 GPU for f32 operands and for the packed
// f16x2 / bf16x2 forms of ex2.approx, i.e. whether a packed exp2 would lift the softmax's exp
// ceiling (docs/perf-notes-v3.md, "packed exp2"). Each thread runs 8 independent dependency chains
// of exp2 plus an add (so that the values stay in range and the chain cannot be folded).
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tests/gpu/mufu_probe.cu -o /tmp/mufu_probe
// Prints the best of 5 timed launches per form: instructions per second and exponentials per
// second (2 per packed instruction).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

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

template <class Form>
__global__ void exp2_chains(float* out, float seed) {
  typename Form::Reg a[kChains];
#pragma unroll
  for (int j = 0; j < kChains; ++j) a[j] = Form::init(-(seed + threadIdx.x * 1e-6f + j * 1e-3f));
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) a[j] = Form::step(a[j]);
  }
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
  exp2_chains<Form><<<blocks, threads>>>(out, 0.5f);  // warm-up
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(start);
    exp2_chains<Form><<<blocks, threads>>>(out, 0.5f);
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

}  // namespace

int main() {
  bool ok = measure<F32>("f32");
  ok &= measure<Packed<__half2>>("f16x2");
  ok &= measure<Packed<__nv_bfloat162>>("bf16x2");
  return ok ? 0 : 1;
}
