// Probe: what the v1 / v2 schedules' instruction, mma.sync m16n8k16 (bf16 in, fp32 accumulate),
// delivers on an sm_90 GPU, and how much of it the GEMMs of v2's kernels reach at the occupancy
// their registers allow (docs/perf-notes.md, session 32: is #3's 1.1x over FlashAttention-2, the
// same schedule on the same instruction, within reach?). Built as the library builds v1 / v2
// (compute_80 code run as sm_90 machine code):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_80,code=sm_90 -I. tests/gpu/mma_sync_probe.cu \
//     -o mma_sync_probe
//   ./mma_sync_probe   (per row: TFLOP/s, FLOP per SM clock, % of the peak row's, the SM clock)
// Rows:
//   peak, W warps per sub-core: every warp issues 16 independent accumulators' MMAs from
//     operands in registers, so nothing but the tensor pipe limits it.
//   v2 forward GEMMs: a warp's share of v2_forward_kernel's 128 x 64 tile at head dim 128 (32
//     rows): S = Q K^T with Q's and K's fragments read from shared memory every k-step, then
//     O += P V with P the rounded S and V read transposed, with the kernel's own tile.cuh
//     functions and its occupancy (two CTAs of 4 warps per SM, O and S in registers), minus the
//     softmax, the loads from global memory and the barriers: an upper bound of the forward.
//   v2 backward GEMMs: a warp's share of dkdv_kernel's step at head dim 128 (64 queries x 128
//     keys, one CTA of 8 warps per SM, dK / dV in registers): S and dP, P and dS stored to shared
//     memory, dV / dK, dQ; minus the exponentials, the loads, the barriers and the dQ atomics.
// Shared memory holds small bf16 values; the probe times issue, not results (the P / dS stores
// race with other warps' reads: no barrier, on purpose).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/tile.cuh"

namespace {

using namespace jax_flash::tile;
using T = __nv_bfloat16;

constexpr double kMmaFlops = 2.0 * 16 * 8 * 16;

__device__ void fill_shared(unsigned char* smem, int bytes) {
  // bf16 pairs near 2^-7 with varied mantissas: products stay small over any number of steps
  for (int i = threadIdx.x; i < bytes / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x3c003c00u | ((i * 2654435761u) & 0x007f007fu);
  __syncthreads();
}

template <int MT, int NT>
__device__ float total(const float (&acc)[MT][NT][4]) {
  float sum = 0.f;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) sum += acc[m][n][e];
  return sum;
}

// Each CTA's clock count, and a sum that keeps every accumulator live.
__device__ void report(long long t0, float sum, float* sink, long long* clocks) {
  const long long t1 = clock64();
  if (threadIdx.x == 0) clocks[blockIdx.x] = t1 - t0;
  if (sum == 1.2345f) sink[threadIdx.x] = sum;
}

template <int kWarpsPerSubCore>
__global__ void __launch_bounds__(128 * kWarpsPerSubCore, 1)
    peak_kernel(int iterations, float* sink, long long* clocks) {
  const uint32_t a[4] = {0x3c003c00u ^ threadIdx.x, 0x3c003c01u, 0x3c003c02u, 0x3c003c03u};
  const uint32_t b0 = 0x3c013c00u ^ threadIdx.x, b1 = 0x3c023c00u;
  float acc[1][16][4];
  zero(acc);
  const long long t0 = clock64();
  for (int i = 0; i < iterations; ++i)
#pragma unroll
    for (int n = 0; n < 16; ++n) Element<T>::mma(acc[0][n], a, b0, b1);
  report(t0, total(acc), sink, clocks);
}

// v2_forward_kernel's GEMMs at head dim 128 (V2Shape<128, 64, 4>: 4 warps x 32 rows).
struct ForwardGemms {
  static constexpr int kThreads = 128, kCtasPerSm = 2, kHeadDim = 128, kBlockN = 64;
  using QTile = Tile<128, kHeadDim>;
  using KVTile = Tile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = QTile::kBytes + 2 * KVTile::kBytes;
  static constexpr double kFlopsPerCta = 2.0 * 2 * 128 * kBlockN * kHeadDim;  // per iteration
};

__global__ void __launch_bounds__(ForwardGemms::kThreads, ForwardGemms::kCtasPerSm)
    forward_gemms_kernel(int iterations, float* sink, long long* clocks) {
  using G = ForwardGemms;
  constexpr int MT = 2, NT_S = G::kBlockN / 8, NT_O = G::kHeadDim / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  fill_shared(smem, G::kSmemBytes);
  const G::QTile sQ{smem_address(smem)};
  const G::KVTile sK{sQ.base + G::QTile::kBytes};
  const G::KVTile sV{sK.base + G::KVTile::kBytes};
  const int lane = threadIdx.x % 32, warp_row0 = threadIdx.x / 32 * 32;
  float o[MT][NT_O][4];
  zero(o);
  const long long t0 = clock64();
  for (int i = 0; i < iterations; ++i) {
    float s[MT][NT_S][4];
    zero(s);
    warp_gemm<T, MT, NT_S, G::kHeadDim / 16>(
        s, [&](uint32_t(&a)[MT][4], int k0) { load_a(a, sQ, warp_row0, k0, lane); },
        [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_nmajor(bf, sK, k0, n0, lane); });
#pragma unroll
    for (int kk = 0; kk < G::kBlockN / 16; ++kk) {
      uint32_t a[MT][4];
      c_to_a<T>(a, s, kk);
      mma_k_step<T>(o, a, [&](uint32_t(&bv)[4], int n0) { load_b_pair_kmajor(bv, sV, 16 * kk, n0, lane); });
    }
  }
  report(t0, total(o), sink, clocks);
}

// dkdv_kernel's GEMMs at head dim 128 (BwdShape<64, 128, 2, 1, 2>): S / dP on 2 x 4 warps of 32
// rows x 32 keys, dV (warps 0-3) and dK (4-7) on 2 x 2 warps of 64 keys x 64 columns, dQ on 2 x 4
// warps of 32 rows x 32 columns.
struct BackwardGemms {
  static constexpr int kThreads = 256, kCtasPerSm = 1, kHeadDim = 128, kBlockM = 64, kBlockN = 128;
  using KVTile = Tile<kBlockN, kHeadDim>;
  using QTile = Tile<kBlockM, kHeadDim>;
  using PTile = Tile<kBlockM, kBlockN>;
  static constexpr int kSmemBytes = 2 * KVTile::kBytes + 2 * QTile::kBytes + 2 * PTile::kBytes;
  static constexpr double kFlopsPerCta = 5 * 2.0 * kBlockM * kBlockN * kHeadDim;
};

__global__ void __launch_bounds__(BackwardGemms::kThreads, BackwardGemms::kCtasPerSm)
    backward_gemms_kernel(int iterations, float* sink, long long* clocks) {
  using G = BackwardGemms;
  constexpr int MT_S = 2, NT_S = 4, MT_KV = 4, NT_KV = 8, MT_Q = 2, NT_Q = 4;
  extern __shared__ __align__(16) unsigned char smem[];
  fill_shared(smem, G::kSmemBytes);
  const G::KVTile sK{smem_address(smem)};
  const G::KVTile sV{sK.base + G::KVTile::kBytes};
  const G::QTile sQ{sV.base + G::KVTile::kBytes};
  const G::QTile sdO{sQ.base + G::QTile::kBytes};
  const G::PTile sP{sdO.base + G::QTile::kBytes};
  const G::PTile sdS{sP.base + G::PTile::kBytes};
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int s_r0 = warp / 4 * 32, s_c0 = warp % 4 * 32;
  const int kv_r0 = warp % 2 * 64, kv_c0 = warp % 4 / 2 * 64;
  const bool dk_warp = warp >= 4;
  const int q_r0 = warp / 4 * 32, q_c0 = warp % 4 * 32;
  float kv_acc[MT_KV][NT_KV][4];
  zero(kv_acc);
  float dq_total = 0.f;
  const long long t0 = clock64();
  for (int i = 0; i < iterations; ++i) {
    float s[MT_S][NT_S][4], dp[MT_S][NT_S][4];
    zero(s);
    warp_gemm<T, MT_S, NT_S, G::kHeadDim / 16>(
        s, [&](uint32_t(&a)[MT_S][4], int k0) { load_a(a, sQ, s_r0, k0, lane); },
        [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_nmajor(bf, sK, k0, s_c0 + n0, lane); });
    zero(dp);
    warp_gemm<T, MT_S, NT_S, G::kHeadDim / 16>(
        dp, [&](uint32_t(&a)[MT_S][4], int k0) { load_a(a, sdO, s_r0, k0, lane); },
        [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_nmajor(bf, sV, k0, s_c0 + n0, lane); });
    store_c<T>(sP, s, s_r0, s_c0, lane);
    store_c<T>(sdS, dp, s_r0, s_c0, lane);
    const G::PTile sA{dk_warp ? sdS.base : sP.base};
    const G::QTile sB{dk_warp ? sQ.base : sdO.base};
    warp_gemm<T, MT_KV, NT_KV, G::kBlockM / 16>(
        kv_acc, [&](uint32_t(&a)[MT_KV][4], int k0) { load_a_transposed(a, sA, kv_r0, k0, lane); },
        [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_kmajor(bf, sB, k0, kv_c0 + n0, lane); });
    float dq[MT_Q][NT_Q][4];
    zero(dq);
    warp_gemm<T, MT_Q, NT_Q, G::kBlockN / 16>(
        dq, [&](uint32_t(&a)[MT_Q][4], int k0) { load_a(a, sdS, q_r0, k0, lane); },
        [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_kmajor(bf, sK, k0, q_c0 + n0, lane); });
    dq_total += total(dq);
  }
  report(t0, total(kv_acc) + dq_total, sink, clocks);
}

struct Result {
  double tflops, flops_per_clock, mhz;
};

template <typename Kernel>
Result time_kernel(Kernel kernel, int sms, int ctas, int threads, int smem, int iterations,
                   double flops_per_cta, float* sink, long long* d_clocks) {
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<ctas, threads, smem>>>(iterations, sink, d_clocks);  // warm
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best_ms = 1e30f;
  long long cycles = 0;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(e0);
    kernel<<<ctas, threads, smem>>>(iterations, sink, d_clocks);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    if (ms < best_ms) {
      best_ms = ms;
      std::vector<long long> clk(ctas);
      cudaMemcpy(clk.data(), d_clocks, ctas * sizeof(long long), cudaMemcpyDeviceToHost);
      cycles = *std::max_element(clk.begin(), clk.end());
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    std::exit(1);
  }
  const double flops = flops_per_cta * iterations * ctas;
  return {flops / best_ms / 1e9, flops / sms / double(cycles), double(cycles) / best_ms / 1e3};
}

void print(const char* label, const Result& r, double peak_per_clock) {
  std::printf("%-58s %7.1f TFLOP/s  %7.1f FLOP/clk/SM  %5.1f%% of peak  %5.0f MHz\n", label,
              r.tflops, r.flops_per_clock, 100.0 * r.flops_per_clock / peak_per_clock, r.mhz);
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink;
  long long* d_clocks;
  cudaMalloc(&sink, 1024 * sizeof(float));
  cudaMalloc(&d_clocks, 4 * sms * sizeof(long long));
  for (int round = 0; round < 2; ++round) {
    std::printf("-- round %d\n", round + 1);
    const double per_warp = 16 * kMmaFlops;
    const Result p1 =
        time_kernel(peak_kernel<1>, sms, sms, 128, 0, 200000, 4 * per_warp, sink, d_clocks);
    const Result p2 =
        time_kernel(peak_kernel<2>, sms, sms, 256, 0, 100000, 8 * per_warp, sink, d_clocks);
    const Result p4 =
        time_kernel(peak_kernel<4>, sms, sms, 512, 0, 50000, 16 * per_warp, sink, d_clocks);
    const double peak = std::max({p1.flops_per_clock, p2.flops_per_clock, p4.flops_per_clock});
    print("peak, 1 warp per sub-core (16 independent accumulators)", p1, peak);
    print("peak, 2 warps per sub-core", p2, peak);
    print("peak, 4 warps per sub-core", p4, peak);
    using F = ForwardGemms;
    print("v2 forward GEMMs, H 128, 2 CTAs x 4 warps per SM",
          time_kernel(forward_gemms_kernel, sms, F::kCtasPerSm * sms, F::kThreads, F::kSmemBytes,
                      4000, F::kFlopsPerCta, sink, d_clocks), peak);
    print("v2 forward GEMMs, H 128, 1 CTA x 4 warps per SM",
          time_kernel(forward_gemms_kernel, sms, sms, F::kThreads, F::kSmemBytes, 4000,
                      F::kFlopsPerCta, sink, d_clocks), peak);
    using B = BackwardGemms;
    print("v2 backward GEMMs, H 128, 1 CTA x 8 warps per SM",
          time_kernel(backward_gemms_kernel, sms, sms, B::kThreads, B::kSmemBytes, 3000,
                      B::kFlopsPerCta, sink, d_clocks), peak);
  }
  return 0;
}
