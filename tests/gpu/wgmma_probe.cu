// Tensor-core rate of the v3 forward's GEMM shapes without the softmax: does reading A from shared
// memory (SS) instead of registers (RS), B transposed (MN-major, as V in the PV GEMM), or bulk
// copies landing in shared memory beside the GEMMs (as the K / V loads do) slow a wgmma chain
// down, and does a softmax-like stream of FFMA / MUFU / FADD / pack in the third warpgroup, as the
// other consumer warpgroup's softmax runs beside a warpgroup's GEMMs in the kernel's pingpong?
// (docs/perf-notes.md, session 21.)
// One CTA per SM, two warpgroups each issuing one GEMM of the kernel's shape (a chain of
// m64nNk16 k-steps, bf16 in, fp32 accumulators) back to back, waiting for each chain before the
// next, so that their chains interleave on the SM's tensor cores as in the kernel's pingpong.
// The accumulators add up over the chains (with a fresh accumulator per chain the compiler drops
// the earlier chains). With copies, one more thread keeps four 16 KB cp.async.bulk copies from
// global memory in flight into a landing buffer until the GEMMs end; with a softmax beside, the
// third warpgroup runs softmax_like_load until then.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I<cutlass include> -I. \
//     tests/gpu/wgmma_probe.cu -o wgmma_probe
//   ./wgmma_probe   (per shape: TFLOP/s, FLOP per SM clock against the 4096 of dense bf16, the
//                    SM clock, the copies' bytes or the softmax's exponentials per SM clock)
#include <cstdio>
#include <utility>
#include <vector>

#include "cuda/hopper.cuh"

using namespace jax_flash::hopper;
using Element = __nv_bfloat16;

constexpr int kChains = 2000;
constexpr uint32_t kATileBytes = 32768;  // per warpgroup: 64 rows x up to 256 columns
constexpr uint32_t kLandingBytes = 65536;

// The S GEMM: acc(64 x N) = A(64 x kDepth) B(N x kDepth)^T, both K-major in 64-column slabs; A's
// first kRegSteps k-steps from registers, the rest from shared memory.
template <int N_, int kDepth, int kRegSteps>
struct ScoresChain {
  static constexpr int N = N_, kSteps = kDepth / 16, kFragments = kRegSteps > 0 ? kRegSteps : 1;
  static constexpr uint32_t kBBytes = N * kDepth * 2;
  static constexpr double kFlops = 2.0 * 64 * N * kDepth;
  __device__ static void issue(uint32_t a_tile, uint32_t b_tile,
                               const uint32_t (&frags)[kFragments][4], float (&acc)[N / 2]) {
    using G = Gmma<Element, N>;
    constexpr auto idx = std::make_index_sequence<N / 2>{};
    GmmaDescriptor a =
        GmmaDescriptor::kmajor(a_tile).advanced(kmajor_step_bytes(kRegSteps, 64 * 128));
    GmmaDescriptor b = GmmaDescriptor::kmajor(b_tile);
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      if (kk < kRegSteps) {
        gmma_rs<typename G::RSK>(frags[kk < kRegSteps ? kk : 0], b.bits, acc, idx);
      } else {
        gmma_ss<typename G::template SS<>>(a.bits, b.bits, acc, gmma::ScaleOut::One, idx);
        a = a.next_kmajor_step(kk, 64 * 128);
      }
      b = b.next_kmajor_step(kk, N * 128);
    }
  }
};

// The PV GEMM: acc(64 x N) += P(64 x kKeys) V(kKeys x N), P from registers, V MN-major in
// 64-column slabs of kKeys rows (the kernel's layout: slab c at c * kKeys * 128 bytes).
template <int N_, int kKeys>
struct OutputChain {
  static constexpr int N = N_, kSteps = kKeys / 16, kFragments = kSteps;
  static constexpr uint32_t kBBytes = N * kKeys * 2;
  static constexpr double kFlops = 2.0 * 64 * N * kKeys;
  __device__ static void issue(uint32_t, uint32_t b_tile, const uint32_t (&frags)[kFragments][4],
                               float (&acc)[N / 2]) {
    gemm_rs_mnmajor<typename Gmma<Element, N>::RS>(frags, b_tile, kKeys * 128, acc);
  }
};

// What runs beside the GEMMs in the third warpgroup.
enum class Beside { kNothing, kCopies, kSoftmax };

// A softmax's instruction mix on registers, per element: FFMA, MUFU.EX2, FADD (the row sum) and
// half a pack to bf16x2, as a key block's softmax at the running max runs them; returns the
// exponentials done.
__device__ long long softmax_like_load(volatile int* done) {
  float v[16], sum = 0.f;
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = -0.01f * float(i + threadIdx.x % 7);
  long long count = 0;
  while (!*done) {
#pragma unroll 4
    for (int rep = 0; rep < 8; ++rep) {
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const float lo = exp2_mufu(fmaf(v[i], 0.999f, -0.001f));
        const float hi = exp2_mufu(fmaf(v[i + 1], 0.999f, -0.001f));
        sum += lo;
        sum += hi;
        packed ^= pack2<Element>(lo, hi);
        v[i] = lo - 1.f;
        v[i + 1] = hi - 1.f;
      }
    }
    count += 8 * 16;
  }
  if (sum == 1.2345f && packed == 7u) *done = 2;  // keeps the work live
  return count;
}

template <class Chain, Beside kBeside>
__global__ void __launch_bounds__(384, 1) probe(const uint8_t* src, long long* clocks) {
  constexpr bool kTraffic = kBeside == Beside::kCopies;
  __shared__ volatile int done;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t smem = (smem_address(smem_raw) + 1023) & ~1023u;
  // A: one tile per warpgroup, B, a landing buffer for the copies, 4 mbarriers.
  const uint32_t b_tile = smem + 2 * kATileBytes;
  const uint32_t land = b_tile + Chain::kBBytes;
  const uint32_t bar = land + kLandingBytes;
  // Small nonzero bf16 values: the tensor cores' load depends on the data.
  for (uint32_t i = threadIdx.x; i < (2 * kATileBytes + Chain::kBBytes) / 4; i += blockDim.x) {
    const uint32_t h = (i * 2654435761u) >> 7;
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(smem + 4 * i), "r"(0x3c003c00u ^ (h & 0x007f007fu)));
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < 4; ++i) mbarrier_init(bar + 8 * i, 1);
    done = 0;
  }
  __syncthreads();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 2) {
    shrink_registers<56>();  // so that the GEMM warpgroups get 224
    if constexpr (kBeside == Beside::kSoftmax) {
      const long long t0 = clock64();
      const long long n = softmax_like_load(&done);
      const long long t1 = clock64();
      // exponentials per SM clock, x 1000, by the warpgroup (thread 256 reports)
      if (threadIdx.x == 256) clocks[2 * gridDim.x + blockIdx.x] = n * 128 * 1000 / (t1 - t0);
      return;
    }
    if (kTraffic && threadIdx.x == 256) {
      long long bytes = 0;
      const long long t0 = clock64();
      int n = 0;
      for (; !done; ++n) {
        const int slot = n % 4;
        if (n >= 4) mbarrier_wait(bar + 8 * slot, ((n / 4) - 1) & 1);
        mbarrier_arrive_expect_tx(bar + 8 * slot, 16384);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
            "16384, [%2];" ::"r"(land + 16384 * slot),
            "l"(src + (size_t(blockIdx.x) * 4 + slot) * 16384), "r"(bar + 8 * slot)
            : "memory");
        bytes += 16384;
      }
      for (int k = n > 4 ? n - 4 : 0; k < n; ++k) mbarrier_wait(bar + 8 * (k % 4), (k / 4) & 1);
      clocks[2 * gridDim.x + blockIdx.x] = bytes * 1000 / (clock64() - t0);  // mB / clk
    }
    return;
  }
  grow_registers<224>();
  const uint32_t a_tile = smem + warpgroup * kATileBytes;
  uint32_t frags[Chain::kFragments][4];
  load_fragments_swizzled(a_tile, 64 * 128, (threadIdx.x % 128) / 32 * 16, 0, threadIdx.x % 32,
                          frags);
  float acc[Chain::N / 2];
#pragma unroll
  for (int i = 0; i < Chain::N / 2; ++i) acc[i] = 0.f;
  named_barrier_sync(1, 256);
  const long long t0 = clock64();
  for (int c = 0; c < kChains; ++c) {
    wgmma_fence();
    Chain::issue(a_tile, b_tile, frags, acc);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(acc);
  }
  const long long t1 = clock64();
  if (threadIdx.x == 0) done = 1;
  float sink = 0.f;
#pragma unroll
  for (int i = 0; i < Chain::N / 2; ++i) sink += acc[i];
  if (threadIdx.x % 128 == 0) clocks[blockIdx.x * 2 + warpgroup] = t1 - t0 + (sink == 1.2345f);
}

template <class Chain, Beside kBeside = Beside::kNothing>
void run(const char* label, const uint8_t* src, int sms, long long* d_clocks) {
  constexpr bool kTraffic = kBeside == Beside::kCopies;
  auto kernel = probe<Chain, kBeside>;
  const int smem = 1024 + 2 * kATileBytes + Chain::kBBytes + kLandingBytes + 64;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  kernel<<<sms, 384, smem>>>(src, d_clocks);  // warm
  cudaEventRecord(e0);
  kernel<<<sms, 384, smem>>>(src, d_clocks);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  std::vector<long long> clk(3 * sms);
  cudaMemcpy(clk.data(), d_clocks, clk.size() * 8, cudaMemcpyDeviceToHost);
  long long most = 0, traffic = 0;
  for (int i = 0; i < 2 * sms; ++i) most = std::max(most, clk[i]);
  for (int i = 2 * sms; i < 3 * sms; ++i) traffic += kBeside != Beside::kNothing ? clk[i] : 0;
  const double flops = 2.0 * sms * kChains * Chain::kFlops;  // two warpgroups per SM
  const double per_clock = flops / sms / double(most);
  printf("%-36s %7.1f TFLOP/s %6.0f FLOP/clk/SM (%5.1f%% of 4096) %5.0f MHz  %s %5.1f /clk  %s\n",
         label, flops / ms / 1e9, per_clock, 100.0 * per_clock / 4096, double(most) / ms / 1e3,
         kTraffic ? "copies B" : "beside exp", traffic / 1000.0 / sms,
         cudaGetErrorString(cudaGetLastError()));
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint8_t* src;
  long long* d_clocks;
  cudaMalloc(&src, 64u << 20);
  cudaMemset(src, 0x3c, 64u << 20);
  cudaMalloc(&d_clocks, 3 * sms * 8);
  cudaMemset(d_clocks, 0, 3 * sms * 8);
  for (int rep = 0; rep < 2; ++rep) {
    // Head dim 256, 128 x 80 tile: S (K = 256) and PV (80 keys, N = 256).
    run<ScoresChain<80, 256, 0>>("H256 S  n80 k256 SS", src, sms, d_clocks);
    run<ScoresChain<80, 256, 4>>("H256 S  n80 k256 A 4 steps regs", src, sms, d_clocks);
    run<ScoresChain<80, 256, 16>>("H256 S  n80 k256 RS", src, sms, d_clocks);
    run<ScoresChain<80, 256, 0>, Beside::kCopies>("H256 S  n80 k256 SS + copies", src, sms, d_clocks);
    run<OutputChain<256, 80>>("H256 PV n256 k80 RS, V MN-major", src, sms, d_clocks);
    run<OutputChain<256, 80>, Beside::kCopies>("H256 PV ... + copies", src, sms, d_clocks);
    // Head dim 128: the wide tile (128 x 192) and the standard one (128 x 128, Q in registers).
    run<ScoresChain<192, 128, 0>>("H128 S  n192 k128 SS", src, sms, d_clocks);
    run<ScoresChain<192, 128, 0>, Beside::kCopies>("H128 S  n192 k128 SS + copies", src, sms, d_clocks);
    run<OutputChain<128, 192>>("H128 PV n128 k192 RS, V MN-major", src, sms, d_clocks);
    run<OutputChain<128, 192>, Beside::kCopies>("H128 PV ... + copies", src, sms, d_clocks);
    run<ScoresChain<128, 128, 8>>("H128 S  n128 k128 RS", src, sms, d_clocks);
    run<OutputChain<128, 128>>("H128 PV n128 k128 RS, V MN-major", src, sms, d_clocks);
    // Beside a softmax-like stream on the third warpgroup (as the other consumer's softmax
    // runs beside a warpgroup's GEMMs in the kernel's pingpong).
    run<ScoresChain<192, 128, 0>, Beside::kSoftmax>("H128 S  n192 SS + softmax beside", src, sms, d_clocks);
    run<OutputChain<128, 192>, Beside::kSoftmax>("H128 PV n128 k192 + softmax beside", src, sms, d_clocks);
    run<ScoresChain<80, 256, 0>, Beside::kSoftmax>("H256 S  n80 SS + softmax beside", src, sms, d_clocks);
    run<OutputChain<256, 80>, Beside::kSoftmax>("H256 PV n256 k80 + softmax beside", src, sms, d_clocks);
  }
  return 0;
}
