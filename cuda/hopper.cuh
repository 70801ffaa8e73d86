// Hopper (sm_90a) building blocks shared by the v3 kernels (cuda/v3_fwd_sm90.cu,
// cuda/v3_bwd_sm90.cu): mbarrier / TMA / wgmma / named-barrier / setmaxnreg PTX wrappers, the
// 128-byte-swizzle wgmma descriptors, the CUTLASS GMMA atoms by element type and width, and the
// host-side tensor-map encoding. Include only from files compiled for sm_90a.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>  // the n = 80 shape of head dim 256

#include "attention_args.h"
#include "softmax_constants.h"

namespace jax_flash {
namespace hopper {

namespace gmma = cute::SM90::GMMA;

// ------------------------------------------------------------------------------------------
// PTX wrappers: mbarrier, TMA, wgmma bookkeeping, named barriers, setmaxnreg
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Returns once the phase with the given parity has completed. A fresh barrier is in phase 0,
// so waiting for parity 1 returns at once: that is how "empty" buffers start out free.
// Built with -DJAX_FLASH_V3_HANG_TRAP (debugging only), a wait that spins for seconds reports
// the barrier and traps instead of hanging the device.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
#ifdef JAX_FLASH_V3_HANG_TRAP
  uint64_t spins = 0;
#endif
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#ifdef JAX_FLASH_V3_HANG_TRAP
    if (++spins == (1ull << 27)) {
      printf("v3 hang: block %d thread %d barrier smem+0x%x parity %u\n", blockIdx.x,
             threadIdx.x, bar & 0xFFFFF, parity);
      __trap();
    }
#endif
  } while (!done);
}

// Loads a box of 64 columns x `rows` rows (one slab) for each 64-column slab of the head dim.
template <int kSlabs, int kRows>
__device__ __forceinline__ void tma_load_tile(const CUtensorMap* map, uint32_t dst, uint32_t bar,
                                              int row, int head, int batch) {
  const uint64_t desc = reinterpret_cast<uint64_t>(map);
#pragma unroll
  for (int c = 0; c < kSlabs; ++c) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst + c * kRows * 128),
        "l"(desc), "r"(c * 64), "r"(row), "r"(head), "r"(batch), "r"(bar)
        : "memory");
  }
}

// Thread block clusters (the forward's K / V multicast between two CTAs).
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}
// Arrives on the mbarrier at this CTA's shared address `bar` in the cluster's CTA `cta` (which
// may be this one). The default .release.cta semantics, as CUTLASS's cluster pipelines use to
// release a multicast stage: with .release.cluster ptxas puts a MEMBAR.ALL.GPU before the
// arrival (measured in the forward's consumers: 14-40% slower).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n .reg .b32 remote;\n"
      " mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(bar),
      "r"(cta)
      : "memory");
}
// Every thread of every CTA of the cluster: a CTA-wide barrier too.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;" ::: "memory");
}

// tma_load_tile's multicast form: a box of 64 columns x kBoxRows rows per slab lands at the same
// shared offset `dst` (slab c at dst + c * kSlabRows * 128) in every CTA of `cta_mask`, and
// completes transaction bytes on the mbarrier at offset `bar` in each of them.
template <int kSlabs, int kSlabRows, int kBoxRows>
__device__ __forceinline__ void tma_load_tile_multicast(const CUtensorMap* map, uint32_t dst,
                                                        uint32_t bar, int row, int head,
                                                        int batch, uint16_t cta_mask) {
  static_assert(kBoxRows % 8 == 0, "a box must keep the 8-row groups of the 128-byte swizzle");
  const uint64_t desc = reinterpret_cast<uint64_t>(map);
#pragma unroll
  for (int c = 0; c < kSlabs; ++c) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(
            dst + c * kSlabRows * 128),
        "l"(desc), "r"(c * 64), "r"(row), "r"(head), "r"(batch), "r"(bar), "h"(cta_mask)
        : "memory");
  }
}

// Stores one box of 64 columns x the map's box rows from shared memory at src (128-byte
// swizzled, as tma_load_tile writes it) to (col, row, head, batch); rows past the tensor's end
// are not written. Completion is tracked by bulk groups (bulk_commit / bulk_wait_*).
__device__ __forceinline__ void tma_store_box(const CUtensorMap* map, uint32_t src, int col,
                                              int row, int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(col), "r"(row), "r"(head), "r"(batch), "r"(src)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until every bulk group this thread committed has completed (its writes are done).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// Waits until every bulk group this thread committed has read its shared-memory source (the
// buffer may be written again); at once in a thread that committed none.
__device__ __forceinline__ void bulk_wait_reads() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// When `pred`: waits until this thread's committed bulk groups have read their shared-memory
// sources, then arrives on `bar` kCount times. Predicated inside one asm, not branched around,
// so that it can sit between wgmma issue and wait without a divergent path in the wgmma region.
template <uint32_t kCount = 1>
__device__ __forceinline__ void bulk_read_wait_then_arrive_if(bool pred, uint32_t bar) {
  asm volatile(
      "{\n .reg .pred p;\n"
      " setp.ne.b32 p, %0, 0;\n"
      " @p cp.async.bulk.wait_group.read 0;\n"
      " @p mbarrier.arrive.shared::cta.b64 _, [%1], %2;\n}" ::"r"(uint32_t(pred)),
      "r"(bar), "n"(kCount)
      : "memory");
}
// Makes this thread's generic-proxy shared-memory writes visible to later async-proxy (TMA)
// reads; a barrier must still order them with the thread that issues the TMA.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Ties register arrays to the surrounding asm order, so that no read of an accumulator moves
// above the wgmma_wait that completes it.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// grow_registers / shrink_registers only move registers within the CTA's launch allocation
// (__launch_bounds__(threads, 1): the registers per thread of a 64K file, in steps of 8); an
// increase past what the other warpgroups released waits forever. A warp-specialized kernel's
// split per thread slot of its warpgroups must stay within threads * this.
__host__ __device__ constexpr int launch_registers_per_thread(int threads) {
  return 65536 / threads / 8 * 8;
}

template <int kRegisters>
__device__ __forceinline__ void grow_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void shrink_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

__device__ __forceinline__ float exp2_mufu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2 x for normal x (subnormals flush to zero; __log2f scales them first, a compare and two
// predicated instructions more).
__device__ __forceinline__ float log2_mufu(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float tanh_mufu(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------------------------------
// wgmma descriptors and instruction wrappers
// ------------------------------------------------------------------------------------------


// 128-byte-swizzled K-major operand: 8-row groups 1024 bytes apart (SBO), LBO unused (1).
__device__ __forceinline__ uint64_t kmajor_descriptor(uint32_t address) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// 128-byte-swizzled MN-major operand: 64-column slabs `slab_bytes` apart (LBO), 8-row groups
// along K 1024 bytes apart (SBO).
__device__ __forceinline__ uint64_t mnmajor_descriptor(uint32_t address, uint32_t slab_bytes) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t(slab_bytes >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// The byte offset of k-step kk (16 columns) of a K-major operand in 64-column slabs slab_bytes
// apart.
__host__ __device__ constexpr uint32_t kmajor_step_bytes(int kk, uint32_t slab_bytes) {
  return (kk / 4) * slab_bytes + (kk % 4) * 32;
}

// The byte offset of k-step kk (16 rows of 128 bytes) of an MN-major operand.
__host__ __device__ constexpr uint32_t mnmajor_step_bytes(int kk) { return kk * 16 * 128; }

// A wgmma descriptor made once per operand tile (kmajor_descriptor / mnmajor_descriptor's
// fields) and moved along the operand by `advanced`: one 32-bit add per k-step of a byte count
// that is a compile-time constant once the k-loop is unrolled. Rebuilt from the address for
// every wgmma, a descriptor cost ~5 uniform instructions (add, mask, shift, or in the leading
// byte offset, move the high word), ~10 per wgmma with both operands in shared memory.
// The low word holds the start address / 16 (bits 0-13) and the leading byte offset / 16
// (bits 16-29); `advanced` adds to the low word only and passes the high word (stride byte
// offset, swizzle mode) through. The add cannot carry out of the 14-bit start field into the
// reserved bits or the leading byte offset: an operand lies in the CTA's shared memory, whose
// addresses are below 256 KB = 2^18 bytes (232,448 on sm_90), so the start field of every
// operand address, advanced ones included, is below 2^14.
// ptxas (nvcc 13.0) still writes the high word, a constant, into the register pair of every
// descriptor (one UMOV each). Computed from the address instead, so that it stayed in one
// uniform register, ptxas hoisted the loop-invariant K / V descriptors of all k-steps out of the
// backward's loop and spilled them (H = 128: 20 -> 192 bytes).
struct GmmaDescriptor {
  uint64_t bits;
  __device__ static GmmaDescriptor kmajor(uint32_t address) { return {kmajor_descriptor(address)}; }
  __device__ static GmmaDescriptor mnmajor(uint32_t address, uint32_t slab_bytes) {
    return {mnmajor_descriptor(address, slab_bytes)};
  }
  __device__ __forceinline__ GmmaDescriptor advanced(uint32_t bytes) const {
    uint32_t lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(bits));
    uint64_t moved;
    asm("mov.b64 %0, {%1, %2};" : "=l"(moved) : "r"(lo + (bytes >> 4)), "r"(hi));
    return {moved};
  }
  // This descriptor of k-step kk of a K-major operand (slabs slab_bytes apart), moved to kk + 1.
  __device__ __forceinline__ GmmaDescriptor next_kmajor_step(int kk, uint32_t slab_bytes) const {
    return advanced(kmajor_step_bytes(kk + 1, slab_bytes) - kmajor_step_bytes(kk, slab_bytes));
  }
  // This descriptor of a k-step of an MN-major operand, moved to the next one.
  __device__ __forceinline__ GmmaDescriptor next_mnmajor_step() const {
    return advanced(mnmajor_step_bytes(1));
  }
};

// The CUTLASS wgmma instruction wrappers for an m64nNk16 product with fp32 accumulators, by
// element type and width N: SS<major of A, major of B> reads both operands from shared memory
// (K-major both unless said), RS reads A from registers and B MN-major from shared memory, RSK
// A from registers and B K-major.
template <typename Element, int N>
struct Gmma;
#define JAX_FLASH_V3_GMMA(ELEMENT, TAG, N)                                                 \
  template <>                                                                              \
  struct Gmma<ELEMENT, N> {                                                                \
    template <gmma::Major kMajorA = gmma::Major::K, gmma::Major kMajorB = gmma::Major::K>  \
    using SS = gmma::MMA_64x##N##x16_F32##TAG##TAG##_SS<kMajorA, kMajorB>;                \
    using RS = gmma::MMA_64x##N##x16_F32##TAG##TAG##_RS<gmma::Major::K, gmma::Major::MN>; \
    using RSK = gmma::MMA_64x##N##x16_F32##TAG##TAG##_RS<gmma::Major::K, gmma::Major::K>; \
  };
#define JAX_FLASH_V3_GMMA_WIDTHS(ELEMENT, TAG) \
  JAX_FLASH_V3_GMMA(ELEMENT, TAG, 32)          \
  JAX_FLASH_V3_GMMA(ELEMENT, TAG, 64)          \
  JAX_FLASH_V3_GMMA(ELEMENT, TAG, 80)          \
  JAX_FLASH_V3_GMMA(ELEMENT, TAG, 128)         \
  JAX_FLASH_V3_GMMA(ELEMENT, TAG, 192)         \
  JAX_FLASH_V3_GMMA(ELEMENT, TAG, 256)
JAX_FLASH_V3_GMMA_WIDTHS(__nv_bfloat16, BF16)
JAX_FLASH_V3_GMMA_WIDTHS(__half, F16)
#undef JAX_FLASH_V3_GMMA_WIDTHS
#undef JAX_FLASH_V3_GMMA

template <class Op, int N, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t a, uint64_t b, float (&d)[N],
                                        gmma::ScaleOut scale_d, std::index_sequence<I...>) {
  Op::fma(a, b, d[I]..., scale_d);
}

template <class Op, int N, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t b, float (&d)[N],
                                        std::index_sequence<I...>,
                                        gmma::ScaleOut scale_d = gmma::ScaleOut::One) {
  Op::fma(a[0], a[1], a[2], a[3], b, d[I]..., scale_d);
}

// acc = A Bᵀ over kHeadDim, both operands K-major in 64-column slabs of 128-byte rows: a and b
// describe each operand's first k-step (row 0 of its slab 0), kASlabBytes / kBSlabBytes step one
// slab. Each k-step advances the descriptors by a constant instead of building them again.
template <class Op, int kHeadDim, uint32_t kASlabBytes, uint32_t kBSlabBytes, int kAcc>
__device__ __forceinline__ void gemm_ss_kmajor(GmmaDescriptor a, GmmaDescriptor b,
                                               float (&acc)[kAcc]) {
  constexpr auto idx = std::make_index_sequence<kAcc>{};
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    gmma_ss<Op>(a.bits, b.bits, acc, kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One, idx);
    a = a.next_kmajor_step(kk, kASlabBytes);
    b = b.next_kmajor_step(kk, kBSlabBytes);
  }
}

// acc += A B with A in registers (kSteps fragments of 16 columns each) and B MN-major in
// shared memory at b_tile, b_slab_bytes apart per 64-column slab.
template <class Op, int kSteps, int kAcc>
__device__ __forceinline__ void gemm_rs_mnmajor(const uint32_t (&a)[kSteps][4], uint32_t b_tile,
                                                uint32_t b_slab_bytes, float (&acc)[kAcc]) {
  constexpr auto idx = std::make_index_sequence<kAcc>{};
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const uint64_t b = mnmajor_descriptor(b_tile + mnmajor_step_bytes(kk), b_slab_bytes);
    gmma_rs<Op>(a[kk], b, acc, idx);
  }
}

// acc = A Bᵀ with A in registers (kSteps fragments of 16 columns each) and B K-major in 64-column
// slabs of 128-byte rows: b describes its first k-step, kBSlabBytes step one slab.
template <class Op, int kSteps, uint32_t kBSlabBytes, int kAcc>
__device__ __forceinline__ void gemm_rs_kmajor(const uint32_t (&a)[kSteps][4], GmmaDescriptor b,
                                               float (&acc)[kAcc]) {
  constexpr auto idx = std::make_index_sequence<kAcc>{};
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    gmma_rs<Op>(a[kk], b.bits, acc, idx, kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One);
    b = b.next_kmajor_step(kk, kBSlabBytes);
  }
}

template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Where this thread's accumulator elements sit: element i of an m64nN wgmma accumulator holds
// row row0 + 8 * ((i / 2) % 2) and column 8 * (i / 4) + col0 + i % 2 (the wgmma D layout).
struct Lane {
  int row0;  // row within the warpgroup's 64
  int col0;  // column within an 8-column chunk
  __device__ static Lane of(int thread_in_warpgroup) {
    const int warp = thread_in_warpgroup / 32, lane = thread_in_warpgroup % 32;
    return {16 * warp + lane / 4, 2 * (lane % 4)};
  }
};

// An m64nN accumulator as the A operand of the next wgmma: 16 columns form one A fragment,
// registers (row, cols 2q..2q+1), (row+8, same), (row, cols 8+2q..), (row+8, ...), i.e.
// consecutive accumulator pairs.
template <typename Element, int kSteps>
__device__ __forceinline__ void accumulator_to_fragments(const float (&x)[kSteps * 8],
                                                         uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) a[kk][j] = pack2<Element>(x[8 * kk + 2 * j], x[8 * kk + 2 * j + 1]);
}

// A warp's 16 rows of such fragments in shared memory, in the layout that TMA loads and stores
// with the 128-byte swizzle: 128-byte rows in 64-column slabs `slab_bytes` apart, 16-byte chunk
// c of row r at chunk c ^ (r % 8) (`tile` 1024-byte aligned). Fragment kk holds columns
// column0 + 16 kk .. + 15 of rows warp_row0 .. + 15. One stmatrix / ldmatrix .x4 per fragment:
// register j is the 8 x 8 matrix of rows + 8 (j % 2), columns + 8 (j / 2), and lane l gives the
// address of row l % 8 of matrix l / 8 (SwizzledFragmentLane); each matrix's 8 rows sit in 8
// distinct 16-byte bank groups.
struct SwizzledFragmentLane {
  int row, column0;  // the row this lane addresses, and its column in fragment 0
  __device__ static SwizzledFragmentLane of(int warp_row0, int column0, int lane_in_warp) {
    const int matrix = lane_in_warp / 8;
    return {warp_row0 + 8 * (matrix % 2) + lane_in_warp % 8, column0 + 8 * (matrix / 2)};
  }
  // Its address in fragment kk.
  __device__ uint32_t address(uint32_t tile, uint32_t slab_bytes, int kk) const {
    const int column = column0 + 16 * kk;
    const int slab = column / 64, chunk = (column % 64) / 8;
    return tile + slab * slab_bytes + row * 128 + ((chunk ^ (row % 8)) * 16);
  }
};

// Fragments -> shared memory (stmatrix).
template <int kSteps>
__device__ __forceinline__ void store_fragments_swizzled(uint32_t tile, uint32_t slab_bytes,
                                                         int warp_row0, int column0,
                                                         int lane_in_warp,
                                                         const uint32_t (&a)[kSteps][4]) {
  const SwizzledFragmentLane lane = SwizzledFragmentLane::of(warp_row0, column0, lane_in_warp);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                     lane.address(tile, slab_bytes, kk)),
                 "r"(a[kk][0]), "r"(a[kk][1]), "r"(a[kk][2]), "r"(a[kk][3])
                 : "memory");
  }
}

// Shared memory -> fragments (ldmatrix), the inverse of store_fragments_swizzled.
template <int kSteps>
__device__ __forceinline__ void load_fragments_swizzled(uint32_t tile, uint32_t slab_bytes,
                                                        int warp_row0, int column0,
                                                        int lane_in_warp,
                                                        uint32_t (&a)[kSteps][4]) {
  const SwizzledFragmentLane lane = SwizzledFragmentLane::of(warp_row0, column0, lane_in_warp);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[kk][0]), "=r"(a[kk][1]), "=r"(a[kk][2]), "=r"(a[kk][3])
                 : "r"(lane.address(tile, slab_bytes, kk))
                 : "memory");
  }
}

// The score parameters of a MaskSpec as the v3 kernels read them: softcap (0 = off), the
// tanh argument scale, the exp2 exponent scale (with softcap the capped score is already
// scaled; the exponent only converts to log2) and the window with causal folded in (-1 =
// unbounded). Params: any struct with these five fields.
template <class Params>
void set_score_params(Params& p, const MaskSpec& spec) {
  p.softcap = spec.softcap > 0.f ? spec.softcap : 0.f;
  p.softcap_inv = spec.softcap > 0.f ? spec.scale / spec.softcap : 0.f;
  p.scale_log2 = (spec.softcap > 0.f ? 1.f : spec.scale) * kLog2e;
  p.window_left = spec.window_left < 0 ? -1 : spec.window_left;
  int right = spec.window_right < 0 ? -1 : spec.window_right;
  if (spec.is_causal) right = right < 0 ? 0 : std::min(right, 0);
  p.window_right = right;
}

// ------------------------------------------------------------------------------------------
// Host side: tensor maps and the device
// ------------------------------------------------------------------------------------------

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
  });
  return encode;
}

// Rows [0, rows) of a [batch, batch_rows, heads, head_dim] row-major tensor (data: its first
// row), read in boxes of 64 columns x box_rows rows of one head, 128-byte swizzled; rows past
// `rows` read as zeros and are not written.
inline bool encode_tensor_map(CUtensorMap* map, const void* data, DType dtype, int64_t batch,
                              int64_t rows, int64_t batch_rows, int64_t heads, int64_t head_dim,
                              int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads),
                              cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(heads * head_dim * 2), cuuint64_t(head_dim * 2),
                                 cuuint64_t(batch_rows * heads * head_dim * 2)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(
      map,
      dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, const_cast<void*>(data), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The whole [batch, rows, heads, head_dim] tensor.
inline bool encode_tensor_map(CUtensorMap* map, const void* data, DType dtype, int64_t batch,
                              int64_t rows, int64_t heads, int64_t head_dim, int box_rows) {
  return encode_tensor_map(map, data, dtype, batch, rows, rows, heads, head_dim, box_rows);
}

struct DeviceInfo {
  int sm_count = 0;
  int major = 0;
  int minor = 0;
};

inline cudaError_t current_device_info(DeviceInfo* info) {
  int device;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, device)) !=
          cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info->major, cudaDevAttrComputeCapabilityMajor, device)) !=
          cudaSuccess ||
      (err = cudaDeviceGetAttribute(&info->minor, cudaDevAttrComputeCapabilityMinor, device)) !=
          cudaSuccess) {
    return err;
  }
  return cudaSuccess;
}

// The current device's DeviceInfo, stored in *storage; null when none can be queried.
inline const DeviceInfo* current_device(DeviceInfo* storage) {
  return current_device_info(storage) == cudaSuccess ? storage : nullptr;
}

}  // namespace hopper
}  // namespace jax_flash
