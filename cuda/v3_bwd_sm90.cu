// v3 backward: the Hopper (sm_90a) FlashAttention backward (FlashAttention-3 style).
//
// Head dims 64, 128 and 256, tested and measured on the H200 (tests/gpu/harness_v3_bwd.cu:
// float64 check, memcheck, benchmark; numbers in docs/perf-notes-v3.md, section "v3
// backward"). Wired as the FFI
// target "jax_flash_v3_bwd" (xla_ffi/gpu_v3.cc, jax_flash/schedules/v3.py): outputs dq, dk,
// dv, then the five workspaces of V3BackwardWorkspaceSizes (cuda/v3.h), none of which the
// caller needs to clear (preprocess clears dq_accum and the semaphores; the dK / dV partials
// are stored, not added).
//
// Two grids for the main kernel (choose_schedule, "GQA schedule" near the host code):
//   default: one CTA per (key block, kv head, batch), looping over all the kv head's query
//     heads (what the list below describes);
//   GQA schedule (v3_backward_kernel<Cfg, true, *>), for GQA / MQA with fewer than 4 default CTAs
//     per SM: the key block the slowest grid index (longest key blocks first under causal
//     masking) and, when the count says so, the kv head's query heads split over 2 or 4 CTAs,
//     each storing fp32 dK / dV partials that a 4th kernel (v3_backward_dkv_reduce_kernel)
//     sums in a fixed order, scales and converts. The default grid's kernels are unchanged
//     (their SASS is identical to the build before the GQA schedule).
//
// Kernels, in stream order:
//   1. preprocess (one CTA per 64 x 64 / H query rows of a (batch, head), 16-byte loads):
//      D = rowsum(dO * O), lse_log2 = lse * log2(e) (+inf for rows with no kept key and for
//      the padding rows, so that P = exp2(.. - lse_log2) = 0 there), dq_accum and the
//      semaphores cleared.
//   2. main (one CTA per (key block of 128 keys, 64 at head dim 256, kv head, batch)),
//      warp-specialized (head dims 64 / 128 here; 256 after this list):
//        warpgroup 0: producer. One thread loads K and V of the key block once (TMA), then for
//          every (query head of the group, query block) a Q tile, a dO tile (TMA) and the
//          block's lse_log2 and D rows (1-D bulk copies) into a 3-stage ring (2 at head
//          dims 64 and 256) with full / empty mbarriers.
//        warpgroups 1, 2: consumers; warpgroup w owns keys [64 w, 64 w + 64) of the block and
//          keeps dK and dV of those keys in registers over the whole loop. Per query block:
//            S^T  = K_w Q^T            wgmma SS (K-major both), 64 keys x kBlockM queries
//            dP^T = V_w dO^T           wgmma SS, issued right behind S^T
//            P^T  = exp2(S^T * scale * log2e - lse_log2)   (softcap: of the capped score),
//                   computed while the dP^T GEMM still runs
//            dS^T = P^T * (dP^T - D)   (softcap: times 1 - tanh^2)
//            dV  += P^T dO             wgmma RS: P^T from registers (the accumulator layout of
//                                      S^T is the A-fragment layout), dO MN-major in smem
//            dS^T -> shared memory (stmatrix, 128-byte swizzle, keys as rows; two buffers
//            alternating by step), then in warpgroup 1 only (the dQ owner; warpgroup 2 is the
//            helper, see DqRole), once the helper's dS^T rows are stored too (one-way
//            named barrier: the helper never waits for the owner's dS, see run_consumer):
//            dQ = dS K                 wgmma SS, dS MN-major, K MN-major, over all 128 keys;
//                                      the whole step's dQ (H = 128: one m64n128 tile, the
//                                      K operand read once; H = 64: two m64n64 row tiles)
//            dK  += dS^T Q             wgmma SS, dS^T K-major (its own 64 rows), Q MN-major
//                                      (deterministic mode, default grid: RS from the dS^T
//                                      fragments, issued with dV and waited for with it at the
//                                      step's end, see run_consumer)
//            wait for dV (and dQ) only; the owner stages dQ in shared memory (fragment order,
//            the layout of dq_accum) and adds it into the fp32 dq_accum by one bulk (TMA)
//            reduce-add, while dK and then the next step's S^T / dP^T run, so the
//            tensor-core queue does not drain between steps (see run_consumer, add_dq).
//            Head dim 128 (default grid and mode): the owner stages a step's dQ only after
//            issuing the next step's S^T GEMM, which its 16 stores then run under
//            (stage_and_reduce_dq; the stores had held the next GEMM issue, ~18% of the
//            backward's time).
//        Deterministic mode: the dQ adds of a (batch, head, query block) are serialized in
//        descending key block order by a semaphore per block (each element gets its partials
//        added in the same order every run; see dq_turn); dK / dV are always deterministic
//        (one CTA owns them). At head dims 64 / 128 the producer warpgroup's warp 1 (the dQ
//        reducer, kernels with kDqReducer) waits for the turn and issues the bulk reduce, so
//        that the owner only stages its dQ (run_dq_reducer).
//        Epilogue (write_key_gradients): dK = scale * dK and dV converted and written over the
//        warpgroup's own rows of the K and V tiles in shared memory (free by then, see
//        run_consumer), then stored by one thread per warpgroup with TMA; head dim 256 stores
//        from registers, as does the GQA schedule with a split (fp32 partials).
//   3. postprocess (one CTA per 64 query rows of a (batch, head)): dq = scale * dq_accum,
//      transposed through shared memory into 16-byte stores of whole rows.
//   4. GQA schedule with a split, or the default grid with its key blocks in parts, only: dk =
//      scale * sum of the dK partials, dv = sum of the dV partials, in slot order.
// Default grid with fewer CTAs than SMs (choose_block_parts: normal mode, when the count says
// so): the main kernel (kPart) runs each key block as 2-4 CTAs over shares of its query blocks,
// storing fp32 dK / dV partials that 4. sums, scales and converts.
//
// Head dim 256 (BwdConfig::kSplitHeadDim; same kernel, producer, pre/postprocess and
// workspaces): dK + dV of a warpgroup's 64 keys over the whole head dim would be 256 fp32
// registers per thread, so the CTA takes 64 keys and kBlockM = 64 queries per step, and
// warpgroup w owns columns [128 w, 128 w + 128) of dK, dV and dQ for all 64 keys / queries:
//   S^T, dP^T = K Q_w^T, V dO_w^T  wgmma SS m64n32 (its 32 queries [32 w, 32 w + 32)), K = 256
//   P^T, dS^T as above on those 32 queries; both stored to shared memory (P^T is needed by
//     the other warpgroup too), two buffers each
//   dV_w += P^T dO_w, dK_w += dS^T Q_w over its own 32 queries: wgmma RS m64n128 (fragments),
//     issued before the stores and the barrier
//   two-way barrier; dV_w, dK_w over the other warpgroup's 32 queries: wgmma SS m64n128 (P^T,
//     dS^T from shared memory); dQ tile = dS K_w: 64 queries x its 128 columns, SS m64n128 over
//     the 64 keys, added as two 64 x 64 tiles (the dq_accum layout is the same) by
//     red.global.add.v4.f32 from every thread, not staged for a bulk reduce as at H = 64 /
//     128: the staging (32 KB per warpgroup) does not fit (BwdConfig::kDqByBulkReduce)
// Registers per consumer thread: dK 64 + dV 64 (live over the loop) + dQ 64 (issue to adds)
// + S^T 16 + dP^T 16 + P / dS fragments 8 + 8, under setmaxnreg 240 (H = 64 / 128: 256 for
// the dQ owner, 224 for the helper).
// Shared memory: K, V 2 x 32 KB; Q, dO 2 stages x 2 x 32 KB; dS^T, P^T 2 x 2 x 8 KB; lse, D
// 1 KB; barriers; 1 KB alignment: 231,480 bytes of 232,448. Per step (10.5 MFLOP, as at H =
// 128) the CTA loads 64 KB of Q / dO and adds 64 KB of dQ (twice H = 128's: 64-key blocks).
// Rejected: both warpgroups computing the whole 64 x 64 S^T / dP^T (40% more tensor work);
// 128-key blocks (dK + dV alone are 65,536 fp32 values: 171 registers per thread over three
// consumer warpgroups, 128 over four, whose budget is 122 each); a 128-query step (one 64 KB Q / dO
// stage would leave a single stage); dK / dV in shared memory or fp32 atomics (an extra
// 128 KB per CTA or 2x the reduction traffic).
//
// GQA: the CTA of a kv head loops over the query heads of its group, so dK / dV are summed in
// registers with no extra pass. Head dims 64 (kBlockM = 128), 128 and 256 (kBlockM = 64).
// Semantics: docs/architecture.md (scale, softcap, causal, windows, q / kv sequence lengths);
// bias and mask tensors are refused (served by the v2 backward).
#include "v3.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <queue>
#include <type_traits>
#include <utility>
#include <vector>

#include "hopper.cuh"
#ifdef JAX_FLASH_V3_BWD_TIMELINE
#include "timeline.cuh"
#endif

namespace jax_flash {
namespace {

using namespace hopper;

// Query rows are padded to this multiple in dsum / lse_log2 / dq_accum, so that any query
// block of the main kernel (64 or 128 rows) reads whole rows without bounds checks.
constexpr int kRowPad = 128;
// dq_accum stores 64 x 64 tiles; 4096 floats each.
constexpr int kDqTileRows = 64;
constexpr int kDqTileFloats = 64 * 64;

// The key rows of one consumer warpgroup's dK / dV at head dims 64 / 128 (its half of a 128-key
// block), stored by TMA in one box of this many rows per 64-column slab.
constexpr int kKeyGradBoxRows = 64;

int64_t padded_rows(int64_t q_len) { return (q_len + kRowPad - 1) / kRowPad * kRowPad; }

// ------------------------------------------------------------------------------------------
// Tile configuration
// ------------------------------------------------------------------------------------------

template <typename Element_, int kHeadDim_, int kBlockM_>
struct BwdConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  // Head dims 64 and 128: the consumer warpgroups split the block's keys (64 each, the whole
  // head dim). Head dim 256 (dK + dV of 64 keys x 256 columns would be 256 fp32 registers
  // per thread): both warpgroups see the block's 64 keys and split the head dim of dK, dV and
  // dQ (128 columns each) and the queries of S^T and dP^T (kBlockM / 2 each); P^T goes
  // through shared memory like dS^T (see run_consumer).
  static constexpr bool kSplitHeadDim = kHeadDim > 128;
  static constexpr int kBlockN = kSplitHeadDim ? 64 : 128;  // keys per CTA
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  // A warpgroup's S^T / dP^T tile: 64 keys x kScoreCols queries; its dK / dV: 64 keys x
  // kGradCols columns.
  static constexpr int kScoreCols = kSplitHeadDim ? kBlockM / 2 : kBlockM;
  static constexpr int kGradCols = kSplitHeadDim ? kHeadDim / 2 : kHeadDim;
  // A stage is released only once the next step's S^T GEMM has completed (the previous step's
  // dK GEMM, which reads Q, is still in flight at the end of its step): three stages where
  // shared memory allows; two at H = 64 (its dS^T buffers are twice as large) and at H = 256
  // (one stage is 64 KB).
  static constexpr int kStages = kHeadDim == 64 || kSplitHeadDim ? 2 : 3;
  static constexpr int kProducerRegisters = 24;
  // Per consumer warpgroup (setmaxnreg; the three warpgroups share the launch allocation). Head
  // dims 64 / 128: the dQ owner holds the step's whole dQ (64 fp32 per thread, next to dK, dV
  // and the P^T fragments) and takes 256; the helper holds no dQ and takes 224. Other splits
  // (nvcc 13.0): 232 / 232 serialized the wgmmas (C7512, register resources), 256 / 232 and
  // 240 / 232 spilled at H = 128, 248 / 240 and 240 / 240 spilled more at H = 64 (256 / 224
  // leaves one 8-byte reload per step in the H = 64 owner). Head dim 256: 240 each, all the
  // register file leaves with a 24-register producer (at 232 ptxas serialized its wgmmas:
  // C7512).
  static constexpr int kOwnerRegisters = kSplitHeadDim ? 240 : 256;
  static constexpr int kHelperRegisters = kSplitHeadDim ? 240 : 224;
  // Within the launch allocation (168 per thread: 504 per thread slot over the three
  // warpgroups; session 26's dQ warpgroup layout, over it, hung in setmaxnreg.inc).
  static_assert(128 * (kProducerRegisters + kOwnerRegisters + kHelperRegisters) <=
                kThreads * launch_registers_per_thread(kThreads));

  static constexpr int kSlabs = kHeadDim / 64;
  // The step's dQ is kBlockM / 64 row tiles x kSlabs column slabs of 64 x 64. Head dims 64 /
  // 128: one warpgroup (the dQ owner, see DqRole) computes all of it, over the block's 128
  // keys: H = 128 as one m64n128 tile (the K operand read once instead of once per warpgroup),
  // H = 64 as two m64n64 row tiles. Head dim 256: each warpgroup its 2 column slabs. Either
  // way a dQ warpgroup holds kDqRowTilesPerWg x kDqSlabs tiles, adjacent in dq_accum.
  static constexpr int kDqRowTiles = kBlockM / 64;
  static constexpr int kDqWarpgroups = kSplitHeadDim ? kConsumerWarpgroups : 1;
  static constexpr int kDqRowTilesPerWg = kSplitHeadDim ? 1 : kDqRowTiles;
  static constexpr int kDqSlabs = kSlabs / kDqWarpgroups;
  static constexpr int kDqTiles = kDqRowTilesPerWg * kDqSlabs;
  static_assert(kDqWarpgroups * kDqTiles == kDqRowTiles * kSlabs &&
                (kDqSlabs == 1 || kDqRowTilesPerWg == 1));

  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one Q or dO stage
  static constexpr int kRowStatBytes = kBlockM * 4;         // one lse_log2 or D stage
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + kKVBytes;
  static constexpr int kQOffset = kVOffset + kKVBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kQBytes;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;  // one of the two dS^T buffers
  // P^T (head dim 256 only): two buffers like dS^T.
  static constexpr int kPOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kPBytes = kSplitHeadDim ? kDsBytes : 0;
  // How dQ reaches dq_accum (add_dq). H = 64 / 128: the dQ owner's fp32 tiles are staged here
  // for one bulk reduce. H = 256: red.global.add.v4.f32 from every thread, no
  // staging: the layout takes 231,480 bytes without it, and the staging of both warpgroups'
  // two 64 x 64 tiles would need 2 x 32 KB more (2 x 16 KB staging one slab at a time), over
  // the 232,448-byte limit either way.
  static constexpr bool kDqByBulkReduce = !kSplitHeadDim;
  static constexpr int kDqStageOffset = kPOffset + 2 * kPBytes;
  static constexpr int kDqStageBytes = kDqByBulkReduce ? kDqTileFloats * 4 * kDqTiles : 0;
  static constexpr int kLseOffset = kDqStageOffset + kDqWarpgroups * kDqStageBytes;
  static constexpr int kDsumOffset = kLseOffset + kStages * kRowStatBytes;
  static constexpr int kBarrierOffset = kDsumOffset + kStages * kRowStatBytes;
  static constexpr int kBarrierBytes = 8 * (1 + 3 * kStages);
  static constexpr int kSmemBytes = kBarrierOffset + kBarrierBytes + 1024;  // + base alignment
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0 && kBlockM <= 256);
  // Head dim 256: the P^T / dS^T tiles are one 64-query slab, and each warpgroup's queries
  // are whole 16-query k-steps of it.
  static_assert(!kSplitHeadDim || (kBlockM == 64 && kBlockN == 64));
  // A consumer warpgroup's dK / dV rows are one TMA store box (store_key_gradients).
  static_assert(kSplitHeadDim || kBlockN == kKeyGradBoxRows * kConsumerWarpgroups);
};

// The mbarriers at kBarrierOffset: K+V loaded; per stage Q+lse full, dO+D full, stage empty.
struct BwdBarriers {
  uint32_t kv_full, q_full, do_full, empty;  // q_full / do_full / empty: stage 0, 8 bytes apart
  template <class Cfg>
  __device__ static BwdBarriers at(uint32_t base) {
    constexpr int s = Cfg::kStages;
    return {base, base + 8, base + 8 + 8 * s, base + 8 + 16 * s};
  }
};

struct BwdParams {
  CUtensorMap tma_q, tma_k, tma_v, tma_do;
  // dk, dv as TMA store targets (store_key_gradients): boxes of 64 columns x 64 key rows (one
  // consumer warpgroup's keys), 128-byte swizzle like tma_k / tma_v; head dims 64 / 128 only.
  // The GQA schedule's fp32 partials (kv_split > 1) are stored from registers.
  CUtensorMap tma_dk, tma_dv;
  void* dk;
  void* dv;
  float* dq_accum;
  const float* dsum;      // [B, N, T_pad]
  const float* lse_log2;  // [B, N, T_pad]
  int* dq_semaphore;      // null unless deterministic
  const int32_t* q_seqlens;
  const int32_t* kv_seqlens;
  int q_len, kv_len, num_heads, num_kv_heads, heads_per_kv, q_len_padded;
  float scale;        // dS -> dK, dQ (applied in the epilogue / postprocess)
  float scale_log2;   // exponent scale (log2 units) applied to the possibly capped score
  float softcap;      // 0 = off
  float softcap_inv;  // scale / softcap
  int window_left;    // -1 = unbounded
  int window_right;   // causal folded in; -1 = unbounded
  // The GQA schedule only (v3_backward_kernel<Cfg, true, *>; see "GQA schedule" below): the query
  // heads of a kv head are split over kv_split CTAs of heads_per_cta heads each; with
  // kv_split > 1 each CTA writes its unscaled fp32 dK, dV partials to slot `split` of
  // dkv_partial ([2][kv_split][B * kv_len * K * H]: dK slots, then dV slots), which
  // v3_backward_dkv_reduce_kernel sums in slot order.
  // The default grid with its key blocks in parts (kPart kernels) stores its partials the same
  // way, part p of a key block to slot p of kv_split = block_parts slots.
  float* dkv_partial;
  int64_t dkv_slot_elems;  // B * kv_len * K * H
  int kv_split, kv_split_log2, heads_per_cta;  // kv_split: 1, 2 or 4
  // kPart kernels: the default grid's key blocks per kv head, and the CTAs (parts) per key
  // block.
  int key_blocks, block_parts;
#ifdef JAX_FLASH_V3_BWD_TIMELINE
  uint64_t* timeline;  // v3_bwd_timeline records (cuda/v3.h); null: none
#endif
};

// dq_accum: per (batch, head), T_pad / 64 row tiles x kSlabs column slabs of 64 x 64 floats,
// each stored in the order of a warpgroup's m64n64 accumulator: float i of thread t at
// (i / 4) * 512 + 4 t + i % 4, so that one red.v4 of a warp covers 512 contiguous bytes.
struct DqAccum {
  __device__ static float* tile(float* base, const BwdParams& p, int batch, int head,
                                int row_tile, int slab, int slabs) {
    const int64_t row_tiles = p.q_len_padded / kDqTileRows;
    return base + ((((int64_t(batch) * p.num_heads + head) * row_tiles + row_tile) * slabs +
                    slab) *
                   kDqTileFloats);
  }
};

// ------------------------------------------------------------------------------------------
// Timeline instrumentation (-DJAX_FLASH_V3_BWD_TIMELINE only; layout in cuda/v3.h)
// ------------------------------------------------------------------------------------------
// TIMELINE_START(p, record) points the CTA at its records (one thread, before a __syncthreads);
// TIMELINE_EVENT(event, record) stamps an event of this CTA; TIMELINE_STEP_EVENT(event0, it,
// steps, record) stamps event0 + the slot of step `it` when that step is traced;
// TIMELINE_CTA_INFO(steps, record) stores (%smid, steps). Without the macro they expand to
// nothing, so the default build's code is unchanged.

#ifdef JAX_FLASH_V3_BWD_TIMELINE
namespace tl = v3_bwd_timeline;

// Step `it` of `steps` is traced when it is among the first 3 or the last kTracedSteps - 3;
// the branch is uniform over the CTA.
__device__ __forceinline__ void timeline_record_step(int event0, int it, int steps, bool record) {
  const int left = steps - it;  // 1 at the last step
  const int slot = it < 3 ? it : left <= tl::kTracedSteps - 3 ? tl::kTracedSteps - left : -1;
  if (slot >= 0) timeline::stamp(event0 + slot, record);
}

#define TIMELINE_START(p, record) \
  do {                                                             \
    if (record) timeline::set_cta_records(p.timeline, tl::kEvents); \
  } while (0)
#define TIMELINE_EVENT(event, record) timeline::stamp(event, record)
#define TIMELINE_STEP_EVENT(event0, it, steps, record) \
  timeline_record_step(event0, it, steps, record)
#define TIMELINE_CTA_INFO(steps, record) timeline::store_cta_info(tl::kCtaInfo, steps, record)
// Event `e` of consumer warpgroup w (run_consumer's `warpgroup`: 0 or 1).
#define TIMELINE_CONSUMER(w, e) tl::consumer_event(w, tl::e)
#else
#define TIMELINE_START(p, record)
#define TIMELINE_EVENT(event, record)
#define TIMELINE_STEP_EVENT(event0, it, steps, record)
#define TIMELINE_CTA_INFO(steps, record)
#endif

// ------------------------------------------------------------------------------------------
// Which query blocks a key block visits
// ------------------------------------------------------------------------------------------

// The query blocks [*begin, *end) of block_m rows that hold a row (< q_rows) keeping a key of
// [c0, c1] under the windows (-1: unbounded); empty when there is none. The kernel's key blocks
// (key_block_of) and the host's schedule count (steps_per_head) both use it.
template <typename Int>
__host__ __device__ __forceinline__ void kept_query_blocks(Int c0, Int c1, Int q_rows,
                                                           int window_left, int window_right,
                                                           int block_m, Int* begin, Int* end) {
  const Int row_lo = window_right >= 0 ? max(Int(0), c0 - window_right) : 0;
  const Int row_hi = window_left >= 0 ? min(q_rows - 1, c1 + window_left) : q_rows - 1;
  *begin = row_lo / block_m;
  *end = (c0 > c1 || row_hi < row_lo) ? *begin : row_hi / block_m + 1;
}

struct KeyBlock {
  int batch, kv_head, n_block;
  int q_rows, kv_cols;  // valid rows / keys of this batch
  int m_begin, m_end;   // query blocks [m_begin, m_end) hold every row that keeps a key here
                        // (a part of the block split: its share of them)
  int steps;            // heads_per_kv * (m_end - m_begin); GQA schedule: heads_per_cta * ..
};

// GQA schedule (kGqa; chosen by the host for GQA / MQA shapes with few key blocks x kv heads x
// batch per SM, see choose_schedule): kv_head is a virtual kv head, (kv head) * kv_split +
// split, whose heads_per_cta query heads are (virtual kv head) * heads_per_cta + [0,
// heads_per_cta), so that the loop indexes as in the default grid. Grid (virtual kv heads,
// batch, key blocks): the key block is the slowest index. Normal mode: key block 0 (the most
// query blocks under causal masking) of every group is dispatched first, then key block 1, ...
// (longest first). Deterministic mode: the key blocks in descending order (a key block's dQ
// adds wait only for higher key blocks of its group, dispatched before it); shortest first,
// which the count finds no worse than the default grid's order (docs/perf-notes-v3.md).
// kv head and batch straight from blockIdx in both modes, as in the default grid.
// kPart: one of the block_parts CTAs of a key block of the default grid (choose_block_parts):
// blockIdx.x / block_parts is the key block's CTA in the default grid's order (key block fastest,
// then kv head, then batch), blockIdx.x % block_parts its part, whose query blocks are its
// share of the key block's.
template <class Cfg, bool kGqa, bool kPart>
__device__ KeyBlock key_block_of(const BwdParams& p) {
  KeyBlock kb;
  int part = 0, parts = 1;
  if constexpr (kGqa) {
    kb.n_block = p.dq_semaphore != nullptr ? gridDim.z - 1 - blockIdx.z : blockIdx.z;
    kb.kv_head = blockIdx.x;
    kb.batch = blockIdx.y;
  } else if constexpr (kPart) {
    parts = p.block_parts;
    part = int(blockIdx.x) % parts;
    const int cta = int(blockIdx.x) / parts, kv_rows = cta / p.key_blocks;
    kb.n_block = cta % p.key_blocks;
    kb.kv_head = kv_rows % p.num_kv_heads;
    kb.batch = kv_rows / p.num_kv_heads;
  } else {
    // Deterministic mode dispatches the key blocks in descending order: a key block waits only
    // for higher ones (dq_turn), which then are already resident or done.
    kb.n_block = p.dq_semaphore != nullptr ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    kb.kv_head = blockIdx.y;
    kb.batch = blockIdx.z;
  }
  kb.q_rows = p.q_seqlens ? max(0, min(p.q_seqlens[kb.batch], p.q_len)) : p.q_len;
  kb.kv_cols = p.kv_seqlens ? max(0, min(p.kv_seqlens[kb.batch], p.kv_len)) : p.kv_len;
  const int c0 = kb.n_block * Cfg::kBlockN;
  const int c1 = min(c0 + Cfg::kBlockN, kb.kv_cols) - 1;
  kept_query_blocks(c0, c1, kb.q_rows, p.window_left, p.window_right, Cfg::kBlockM, &kb.m_begin,
                    &kb.m_end);
  if (kPart && parts > 1) {
    const int blocks = kb.m_end - kb.m_begin;
    kb.m_end = kb.m_begin + (part + 1) * blocks / parts;
    kb.m_begin += part * blocks / parts;
  }
  kb.steps = (kGqa ? p.heads_per_cta : p.heads_per_kv) * (kb.m_end - kb.m_begin);
  return kb;
}

struct Step {
  int head, m_block;
};
// The first query head of a key block's steps (GQA schedule: kb.kv_head is the virtual kv
// head, see key_block_of).
template <bool kGqa>
__device__ __forceinline__ int first_head(const BwdParams& p, const KeyBlock& kb) {
  return kb.kv_head * (kGqa ? p.heads_per_cta : p.heads_per_kv);
}
// Step `it`: the query heads from head0 on, each over the query blocks [m_begin, m_end).
__device__ __forceinline__ Step step_of(const KeyBlock& kb, int head0, int it) {
  const int per_head = kb.m_end - kb.m_begin;
  return {head0 + it / per_head, kb.m_begin + it % per_head};
}

// Deterministic mode: the number of key blocks that add into query block m before key block
// n. The key blocks touching m form a contiguous range and add in descending order, from the
// last one (the highest key block whose first query block is at most m and that holds a key).
// Under causal masking block n reaches m exactly (kBlockM / kBlockN or more) steps after block
// n + 1 did, so the turns pipeline without waiting; in ascending order every key block waited
// for the previous one's second step, serializing the key blocks of a head.
template <class Cfg>
__device__ __forceinline__ int dq_turn(const BwdParams& p, const KeyBlock& kb, int m_block) {
  int last = (kb.kv_cols - 1) / Cfg::kBlockN;
  if (p.window_right >= 0) {
    const int row_hi = min(m_block * Cfg::kBlockM + Cfg::kBlockM - 1, kb.q_rows - 1);
    last = min(last, (row_hi + p.window_right) / Cfg::kBlockN);
  }
  return last - kb.n_block;
}

// ------------------------------------------------------------------------------------------
// Producer
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// kb: the real kv head (K / V). GQA schedule: gqa_head0, the first query head of the steps
// (first_head of the virtual kv head, computed by the caller: see the kernel).
template <class Cfg, bool kGqa>
__device__ void run_producer(const BwdParams& p, const KeyBlock& kb, int gqa_head0,
                             uint32_t smem, const BwdBarriers& bars) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_q)));
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_do)));
  if constexpr (!Cfg::kSplitHeadDim) {
    // For the consumers' dK / dV stores at the end (the kernel's only use of these two).
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_dk)));
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_dv)));
  }
  if (kb.steps == 0) return;
  mbarrier_arrive_expect_tx(bars.kv_full, 2 * Cfg::kKVBytes);
  tma_load_tile<Cfg::kSlabs, Cfg::kBlockN>(&p.tma_k, smem + Cfg::kKOffset, bars.kv_full,
                                           kb.n_block * Cfg::kBlockN, kb.kv_head, kb.batch);
  tma_load_tile<Cfg::kSlabs, Cfg::kBlockN>(&p.tma_v, smem + Cfg::kVOffset, bars.kv_full,
                                           kb.n_block * Cfg::kBlockN, kb.kv_head, kb.batch);
  TIMELINE_EVENT(tl::kKvIssued, true);
  for (int it = 0; it < kb.steps; ++it) {
    const Step st = step_of(kb, kGqa ? gqa_head0 : first_head<false>(p, kb), it);
    const int stage = it % Cfg::kStages;
    const uint32_t phase = (it / Cfg::kStages) & 1;
    const int row0 = st.m_block * Cfg::kBlockM;
    const int64_t stats = (int64_t(kb.batch) * p.num_heads + st.head) * p.q_len_padded + row0;
    mbarrier_wait(bars.empty + 8 * stage, phase ^ 1);
    const uint32_t q_full = bars.q_full + 8 * stage, do_full = bars.do_full + 8 * stage;
    mbarrier_arrive_expect_tx(q_full, Cfg::kQBytes + Cfg::kRowStatBytes);
    tma_load_tile<Cfg::kSlabs, Cfg::kBlockM>(&p.tma_q, smem + Cfg::kQOffset + stage * Cfg::kQBytes,
                                             q_full, row0, st.head, kb.batch);
    bulk_load(smem + Cfg::kLseOffset + stage * Cfg::kRowStatBytes, p.lse_log2 + stats,
              Cfg::kRowStatBytes, q_full);
    mbarrier_arrive_expect_tx(do_full, Cfg::kQBytes + Cfg::kRowStatBytes);
    tma_load_tile<Cfg::kSlabs, Cfg::kBlockM>(&p.tma_do,
                                             smem + Cfg::kDoOffset + stage * Cfg::kQBytes, do_full,
                                             row0, st.head, kb.batch);
    bulk_load(smem + Cfg::kDsumOffset + stage * Cfg::kRowStatBytes, p.dsum + stats,
              Cfg::kRowStatBytes, do_full);
    TIMELINE_STEP_EVENT(tl::kQIssued, it, kb.steps, true);
  }
}

// ------------------------------------------------------------------------------------------
// Consumer GEMMs (one warpgroup)
// ------------------------------------------------------------------------------------------

// acc^T = X Y^T: X = this warpgroup's 64 key rows of K or V (x: their descriptor at row 0 of
// slab 0), Y = its kScoreCols query rows of the Q or dO tile (y: likewise); both K-major. Gives
// S^T or dP^T.
template <class Cfg>
__device__ __forceinline__ void issue_keys_by_queries(GmmaDescriptor x, GmmaDescriptor y,
                                                      float (&acc)[Cfg::kScoreCols / 2]) {
  using Op = typename Gmma<typename Cfg::Element, Cfg::kScoreCols>::template SS<>;
  gemm_ss_kmajor<Op, Cfg::kHeadDim, Cfg::kBlockN * 128, Cfg::kBlockM * 128>(x, y, acc);
}

template <class Op, int N, size_t... I>
__device__ __forceinline__ void gmma_rs_scaled(const uint32_t (&a)[4], uint64_t b, float (&d)[N],
                                               gmma::ScaleOut scale_d, std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, d[I]..., scale_d);
}

// dV (+)= P^T dO (head dim 256: also dK (+)= dS^T Q) over kSteps x 16 queries: A (64 keys x
// those queries) from registers, B = the Q or dO rows of those queries and this warpgroup's
// kGradCols columns (b_rows: their row 0 in the warpgroup's first slab, 16 rows = 2048 bytes
// per k-step), MN-major in shared memory. `first` (the CTA's first step) overwrites instead of
// adding. dK and dV start that way rather than from zeroing moves: a register move into an
// accumulator of a loop whose dK GEMM stays in flight across the back edge made ptxas serialize
// every wgmma (C7515).
// B's descriptor is rebuilt from the address for every k-step, not advanced from one made per
// call as in the other GEMMs (nvcc 13.0): advanced, the H = 64 GQA-schedule kernel (normal
// mode) spilled in its helper's loop, 49 stores / 49 loads on the path without softcap around
// score_gradients and this GEMM (the spill-free base: 0 / 1), 3% slower measured; the rebuild
// costs ~2.5 uniform instructions per k-step and leaves every other kernel's spills as they
// were with the advanced form.
template <class Cfg, int kSteps>
__device__ __forceinline__ void issue_rs_gradient(const uint32_t (&a)[kSteps][4], uint32_t b_rows,
                                                  float (&acc)[Cfg::kGradCols / 2], bool first) {
  using Op = typename Gmma<typename Cfg::Element, Cfg::kGradCols>::RS;
  constexpr auto idx = std::make_index_sequence<Cfg::kGradCols / 2>{};
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const GmmaDescriptor b =
        GmmaDescriptor::mnmajor(b_rows + mnmajor_step_bytes(kk), Cfg::kBlockM * 128);
    gmma_rs_scaled<Op>(a[kk], b.bits, acc,
                       first && kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One, idx);
  }
}

// dK (+)= dS^T Q (head dim 256: also dV (+)= P^T dO over the other warpgroup's queries) over
// kSteps x 16 queries, both operands in shared memory: A = dS^T or P^T (a: the descriptor of
// its 64 key rows, queries along K: K-major; it may start inside the 128-byte row when all
// kSteps stay in that slab) and B as in issue_rs_gradient (b_rows; here its descriptor is made
// once and advanced by 2048 bytes per k-step). Reading dS^T back from shared memory
// instead of registers lets the dS^T fragments die before the next step's S^T and dP^T
// accumulators are live; with them held over, ptxas serialized the wgmmas (C7511).
template <class Cfg, int kSteps>
__device__ __forceinline__ void issue_ss_gradient(GmmaDescriptor a, uint32_t b_rows,
                                                  float (&acc)[Cfg::kGradCols / 2], bool first) {
  using Op = typename Gmma<typename Cfg::Element, Cfg::kGradCols>::template SS<gmma::Major::K,
                                                                              gmma::Major::MN>;
  constexpr auto idx = std::make_index_sequence<Cfg::kGradCols / 2>{};
  GmmaDescriptor b = GmmaDescriptor::mnmajor(b_rows, Cfg::kBlockM * 128);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    gmma_ss<Op>(a.bits, b.bits, acc,
                first && kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One, idx);
    a = a.next_kmajor_step(kk, Cfg::kBlockN * 128);
    b = b.next_mnmajor_step();
  }
}

// dq = dS K for kDqSlabs adjacent 64 x 64 tiles: dS rows (queries) of row tile `row_tile`, K
// columns from the slab of k (its descriptor) on, summed over the block's keys (16 keys = 2048
// bytes per k-step). dS is stored keys-as-rows (MN-major for this A; ds: the descriptor of the
// tile), K MN-major too.
template <class Cfg>
__device__ __forceinline__ void issue_dq(GmmaDescriptor ds, GmmaDescriptor k, int row_tile,
                                         float (&dq)[32 * Cfg::kDqSlabs]) {
  using Op = typename Gmma<typename Cfg::Element, 64 * Cfg::kDqSlabs>::template SS<gmma::Major::MN,
                                                                                  gmma::Major::MN>;
  constexpr auto idx = std::make_index_sequence<32 * Cfg::kDqSlabs>{};
  ds = ds.advanced(row_tile * Cfg::kBlockN * 128);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    gmma_ss<Op>(ds.bits, k.bits, dq, kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One, idx);
    ds = ds.next_mnmajor_step();
    k = k.next_mnmajor_step();
  }
}

// ------------------------------------------------------------------------------------------
// Consumer elementwise work
// ------------------------------------------------------------------------------------------

// For this thread's two key rows, the interval of kept query rows [lo, hi] (empty for keys
// past kv_cols); `masked`: the warpgroup's tile (64 keys from key_lo, kScoreCols queries from
// query_lo) has a score outside them (else no element is tested, see zero_unkept).
struct KeptQueries {
  int lo[2], hi[2];
  bool masked;
  template <class Cfg>
  __device__ static KeptQueries of(const BwdParams& p, const KeyBlock& kb, int key_lo,
                                   int key0, int query_lo) {
    KeptQueries k;
    const int key_hi = key_lo + 63, query_hi = query_lo + Cfg::kScoreCols - 1;
    k.masked = key_hi >= kb.kv_cols || query_hi >= kb.q_rows ||
               (p.window_right >= 0 && key_hi > query_lo + p.window_right) ||
               (p.window_left >= 0 && key_lo < query_hi - p.window_left);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key0 + 8 * r;
      k.lo[r] = p.window_right >= 0 ? key - p.window_right : 0;
      k.hi[r] = kb.q_rows - 1;
      if (p.window_left >= 0) k.hi[r] = min(k.hi[r], key + p.window_left);
      if (key >= kb.kv_cols) k.hi[r] = -1;
    }
    return k;
  }
  __device__ __forceinline__ bool keeps(int r, int query) const {
    return (query >= lo[r]) & (query <= hi[r]);
  }
};

// Row statistics of the step's query block in shared memory (32-bit shared addresses: a
// generic pointer held two registers more, and H = 64 spilled), read as pairs of columns.
__device__ __forceinline__ float2 load_pair(uint32_t stats, int column) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(stats + 4 * column));
  return v;
}

// s (S^T) -> P^T in place, without softcap and before the mask (zero_unkept). Runs while the
// dP^T GEMM is in flight.
template <class Cfg>
__device__ __forceinline__ void probabilities(float (&s)[Cfg::kScoreCols / 2], const BwdParams& p,
                                              uint32_t lse, int col0) {
#pragma unroll
  for (int j = 0; j < Cfg::kScoreCols / 8; ++j) {
    const float2 l = load_pair(lse, 8 * j + col0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * j + e;
      s[i] = exp2_mufu(fmaf(s[i], p.scale_log2, -(e % 2 ? l.y : l.x)));
    }
  }
}

// dp (dP^T) -> dS^T = P^T (dP^T - D) in place, P^T already in s.
template <class Cfg>
__device__ __forceinline__ void score_gradients(const float (&s)[Cfg::kScoreCols / 2],
                                                float (&dp)[Cfg::kScoreCols / 2], uint32_t dsum,
                                                int col0) {
#pragma unroll
  for (int j = 0; j < Cfg::kScoreCols / 8; ++j) {
    const float2 d = load_pair(dsum, 8 * j + col0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * j + e;
      dp[i] = s[i] * (dp[i] - (e % 2 ? d.y : d.x));
    }
  }
}

// With softcap: both at once, after both GEMMs (the chain factor needs the raw score); before
// the mask (zero_unkept).
template <class Cfg>
__device__ __forceinline__ void capped_probabilities_and_gradients(
    float (&s)[Cfg::kScoreCols / 2], float (&dp)[Cfg::kScoreCols / 2], const BwdParams& p,
    uint32_t lse, uint32_t dsum, int col0) {
#pragma unroll
  for (int j = 0; j < Cfg::kScoreCols / 8; ++j) {
    const float2 l = load_pair(lse, 8 * j + col0);
    const float2 d = load_pair(dsum, 8 * j + col0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * j + e;
      const float t = tanh_mufu(s[i] * p.softcap_inv);
      s[i] = exp2_mufu(fmaf(p.softcap * t, p.scale_log2, -(e % 2 ? l.y : l.x)));
      dp[i] = s[i] * (dp[i] - (e % 2 ? d.y : d.x)) * (1.f - t * t);
    }
  }
}

// P^T and dS^T of the scores outside the kept interval -> 0 (selected, not multiplied: an
// unkept score may exceed its row's lse and give an infinite P). Called only for a tile with
// such scores (kept.masked, a warp-uniform branch) and after both GEMMs have completed: the
// per-element tests cost ~5 instructions per score, about a sixth of a consumer's step, in
// every step when they were folded into probabilities, and a branch while a wgmma is in
// flight makes ptxas serialize the wgmmas (C7520).
template <class Cfg>
__device__ __forceinline__ void zero_unkept(float (&s)[Cfg::kScoreCols / 2],
                                            float (&dp)[Cfg::kScoreCols / 2],
                                            const KeptQueries& kept, int query0) {
#pragma unroll
  for (int j = 0; j < Cfg::kScoreCols / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * j + e;
      const bool keep = kept.keeps(e / 2, query0 + 8 * j + e % 2);
      s[i] = keep ? s[i] : 0.f;
      dp[i] = keep ? dp[i] : 0.f;
    }
  }
}

__device__ __forceinline__ void red_add_v4(float* address, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}

// Bulk (TMA) reduce-add of `bytes` contiguous bytes of shared memory into global memory, in the
// issuing thread's bulk async-group; only where `issue` holds. Predicated rather than branched
// around: a branch around it while wgmmas were in flight made ptxas serialize them (C7520).
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes,
                                                bool issue) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %3, 0;\n"
      " @p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      " @p cp.async.bulk.commit_group;\n}" ::"l"(dst),
      "r"(src), "r"(bytes), "r"(uint32_t(issue))
      : "memory");
}

// Gives each element of a new accumulator chain its own register with no instruction: the
// chain's first wgmma (scale-d = 0) still names the registers as inputs, and left undefined
// the compiler passed registers of accumulators still in flight (moving them aside with movs
// between wgmmas), so ptxas serialized the wgmmas (C7511); zeroing them serialized too (C7515:
// a non-wgmma instruction defining accumulator registers while wgmmas are in flight).
template <int N>
__device__ __forceinline__ void fresh_accumulator(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "=f"(x[i]));
}

template <int N>
__device__ __forceinline__ void zero(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = 0.f;
}

// What a consumer warpgroup does about dQ (run_consumer).
//   kOwner / kHelper (head dims 64 / 128): the owner computes the step's whole dQ from both
//     warpgroups' dS^T; the helper only contributes its dS^T rows. The helper never waits for
//     the owner's dS, only for a dS buffer the owner has finished reading two steps before, so
//     the two are coupled in one direction per step and can drift apart by up to two steps.
//   kShared (head dim 256): each warpgroup computes its columns of dQ from both warpgroups'
//     dS^T (and P^T), and both wait for each other once per step.
enum class DqRole { kOwner, kHelper, kShared };

// Named barrier ids (0 is __syncthreads). The dS^T exchange uses one id per dS^T buffer
// (buffer = step % 2): a named barrier only counts arrivals, so an id must not see a second
// round of arrivals from one warpgroup before the other side has taken the first.
constexpr int kDsReadyBarrier = 1;  // + buffer: the dS^T of the buffer's step is stored
constexpr int kDsFreeBarrier = 3;   // + buffer: the owner's dQ GEMM has read the buffer
constexpr int kDqOrderBarrier = 5;  // deterministic mode: this block's turn to add dQ
// Head dims 64 / 128: the owner's dQ tiles are staged (its 128 threads; deterministic mode:
// and the dQ reducer warp's 32, see run_dq_reducer); deterministic mode: the reducer has read
// the staging buffer.
constexpr int kDqStagedBarrier = 6;
constexpr int kDqFreeBarrier = 7;
constexpr int kDqHandoffThreads = 128 + 32;
constexpr int kKeyGradStagedBarrier = 8;  // + warpgroup: its dK / dV are staged (128 threads)
constexpr int kConsumerThreads = 256;

__device__ __forceinline__ int load_acquire(const int* address) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(address) : "memory");
  return v;
}

// Deterministic mode: the semaphore of a step's query block (its first 64-row tile's).
template <class Cfg>
__device__ __forceinline__ int* dq_semaphore_of(const BwdParams& p, const KeyBlock& kb,
                                                const Step& st) {
  return p.dq_semaphore +
         (int64_t(kb.batch) * p.num_heads + st.head) * (p.q_len_padded / kDqTileRows) +
         st.m_block * Cfg::kDqRowTiles;
}

// Deterministic mode: spins until the semaphore of query block m_block says it is this key
// block's turn to add (dq_turn); one thread.
template <class Cfg>
__device__ __forceinline__ void wait_for_dq_turn(const BwdParams& p, const KeyBlock& kb,
                                                 int m_block, const int* semaphore) {
  const int turn = dq_turn<Cfg>(p, kb, m_block);
  while (load_acquire(semaphore) != turn) {
  }
}

// Deterministic mode: passes the turn on once this thread's adds are visible; one thread.
__device__ __forceinline__ void pass_dq_turn(int* semaphore) {
  __threadfence();
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(semaphore) : "memory");
}

// Stores this warpgroup's dQ tiles to the staging buffer in the order add_dq describes.
template <class Cfg>
__device__ __forceinline__ void stage_dq(uint32_t staging, int thread,
                                         const float (&dq)[Cfg::kDqRowTilesPerWg]
                                                          [32 * Cfg::kDqSlabs]) {
  constexpr int kV4PerRow = 8 * Cfg::kDqSlabs;
#pragma unroll
  for (int j = 0; j < 8 * Cfg::kDqTiles; ++j) {
    const float* v = &dq[j / kV4PerRow][4 * (j % kV4PerRow)];
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(staging + j * 2048 +
                                                                   16 * thread),
                 "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                 : "memory");
  }
}

// The owner's late dQ staging at head dim 128 (run_consumer, kStagesLate): thread 0 waits until
// the reduce issued one step before has read the staging buffer, the owner's 128 threads store
// `dq` there and fence it, and when `reduce`, thread 0 adds it to `tile` by one bulk reduce.
template <class Cfg>
__device__ __forceinline__ void stage_and_reduce_dq(uint32_t staging, float* tile, int thread,
                                                    int warpgroup, bool reduce,
                                                    const float (&dq)[Cfg::kDqRowTilesPerWg]
                                                                     [32 * Cfg::kDqSlabs]) {
  bulk_wait_reads();
  named_barrier_sync(kDqStagedBarrier + warpgroup, 128);
  stage_dq<Cfg>(staging, thread, dq);
  fence_proxy_async_shared();
  named_barrier_sync(kDqStagedBarrier + warpgroup, 128);
  bulk_reduce_add(tile, staging, Cfg::kDqStageBytes, thread == 0 && reduce);
}

// Adds this warpgroup's kDqTiles dQ tiles (64 x 64, adjacent in dq_accum, each in fragment
// order: float i of thread t at (i / 4) * 512 + 4 t + i % 4) into dq_accum. dq[r] holds row
// tile r's kDqSlabs tiles, so float 4 j of the warpgroup's tiles is dq[j / kV4PerRow][4 (j %
// kV4PerRow)].
// Bulk reduce (H = 64 / 128, BwdConfig::kDqByBulkReduce): the tiles go to the owner's staging
// buffer in that order (one conflict-free 512-byte row per warp store), then thread 0 adds all
// of it with one bulk reduce. The consumer threads only store to shared memory: with
// red.global.add.v4 from every thread, the next step's register writes waited for the queued
// reductions to read their operands (ncu: 13% of all stall samples on the loop's first
// instruction). Thread 0 waits for the reduce to have read the buffer before the next step's
// dS barrier (run_consumer). Deterministic mode (kDqReducer): the owner only stages; the dQ
// reducer warp waits for the turn, reduces and passes the turn on (run_dq_reducer). The
// deterministic bulk branch below stays in the default kernels (whose launches never take it)
// so that their code is that of the build before: without it ptxas allocated their registers
// differently (H = 64: 8 -> 36 spilled bytes).
// Otherwise (H = 256: no shared memory left for the staging) every thread adds its values with
// red.global.add.v4.f32, one 512-byte line per warp instruction.
// Deterministic mode: the block waits for its turn (the semaphore counts the key blocks that
// have added), the adds complete, and the turn is passed on.
template <class Cfg, bool kDqReducer>
__device__ __forceinline__ void add_dq(const BwdParams& p, const KeyBlock& kb, const Step& st,
                                       int warpgroup, int thread, uint32_t staging,
                                       const float (&dq)[Cfg::kDqRowTilesPerWg]
                                                        [32 * Cfg::kDqSlabs]) {
  constexpr int kV4PerRow = 8 * Cfg::kDqSlabs;
  constexpr int kDqThreads = 128 * Cfg::kDqWarpgroups;  // the threads that add dQ
  if constexpr (Cfg::kDqByBulkReduce) {
    stage_dq<Cfg>(staging, thread, dq);
    fence_proxy_async_shared();
    if constexpr (kDqReducer) {
      named_barrier_arrive(kDqStagedBarrier, kDqHandoffThreads);
      return;
    }
    named_barrier_sync(kDqStagedBarrier + warpgroup, 128);
  }
  const int row_tile = st.m_block * Cfg::kDqRowTiles;
  const int slab = warpgroup * Cfg::kDqSlabs;  // the owner is warpgroup 0
  float* tile = DqAccum::tile(p.dq_accum, p, kb.batch, st.head, row_tile, slab, Cfg::kSlabs);
  if constexpr (Cfg::kDqByBulkReduce) {
    if (p.dq_semaphore == nullptr) {  // nothing here waits for the reduce
      bulk_reduce_add(tile, staging, Cfg::kDqStageBytes, thread == 0);
      return;
    }
  }
  int* semaphore = nullptr;
  if (p.dq_semaphore != nullptr) {
    semaphore = dq_semaphore_of<Cfg>(p, kb, st);
    if (warpgroup == 0 && thread == 0) wait_for_dq_turn<Cfg>(p, kb, st.m_block, semaphore);
    named_barrier_sync(kDqOrderBarrier, kDqThreads);
  }
  if constexpr (Cfg::kDqByBulkReduce) {  // deterministic mode here
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the acquire, then async-proxy adds
    bulk_reduce_add(tile, staging, Cfg::kDqStageBytes, thread == 0);
    bulk_wait_all();
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the adds, then the release
  } else {
#pragma unroll
    for (int j = 0; j < 8 * Cfg::kDqTiles; ++j) {  // the tiles are adjacent in dq_accum
      const float* v = &dq[j / kV4PerRow][4 * (j % kV4PerRow)];
      red_add_v4(tile + 4 * thread + 512 * j, v[0], v[1], v[2], v[3]);
    }
  }
  if (Cfg::kDqByBulkReduce || semaphore != nullptr) {  // bulk: deterministic mode only here
    named_barrier_sync(kDqOrderBarrier, kDqThreads);
    if (warpgroup == 0 && thread == 0) pass_dq_turn(semaphore);
  }
}

// Deterministic mode, head dims 64 / 128 (kDqReducer): warp 1 of the producer warpgroup, its
// lane 0 doing the work (the warp as a whole takes the named barriers with the owner). Per step
// (the consumers' order): waits for the owner's staged dQ, then for the block's turn, adds the
// staging buffer into dq_accum with one bulk reduce, frees the buffer once read, waits for the
// adds to land and passes the turn on. Done by the owner's thread 0 itself, the turn and the
// landing were waits on the consumers' path (branch v3-bwd-fused-dq, docs/perf-notes-v3.md).
// The free barrier is arrived on once up front and then after every step but the last: one
// arrival per owner step, each after the owner took the one before (the owner's staged arrival,
// which this warp waits for, comes after its free wait).
template <class Cfg>
__device__ void run_dq_reducer(const BwdParams& p, const KeyBlock& kb, int head0,
                               uint32_t smem) {
  const bool leader = threadIdx.x % 32 == 0;
  const uint32_t staging = smem + Cfg::kDqStageOffset;
  if (kb.steps > 0) named_barrier_arrive(kDqFreeBarrier, kDqHandoffThreads);
  for (int it = 0; it < kb.steps; ++it) {
    const Step st = step_of(kb, head0, it);
    int* semaphore = dq_semaphore_of<Cfg>(p, kb, st);
    named_barrier_sync(kDqStagedBarrier, kDqHandoffThreads);
    if (leader) {
      wait_for_dq_turn<Cfg>(p, kb, st.m_block, semaphore);
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the acquire, then the adds
      bulk_reduce_add(DqAccum::tile(p.dq_accum, p, kb.batch, st.head,
                                    st.m_block * Cfg::kDqRowTiles, 0, Cfg::kSlabs),
                      staging, Cfg::kDqStageBytes, true);
      bulk_wait_reads();
    }
    __syncwarp();
    if (it + 1 < kb.steps) named_barrier_arrive(kDqFreeBarrier, kDqHandoffThreads);
    if (leader) {
      bulk_wait_all();
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the adds, then the release
      pass_dq_turn(semaphore);
    }
    __syncwarp();
  }
}

// The epilogue of the default grid (and of the GQA schedule without a split) at head dims 64 /
// 128: dK = scale * dK and dV, this warpgroup's 64 key rows (key_row0: its first row in the
// block) x the whole head dim, converted and written with stmatrix over the same rows of the K
// and V tiles in shared memory (the layout TMA loaded them in: 64-column slabs of 128-byte
// swizzled rows), then stored by thread 0 of the warpgroup with one TMA store per slab and
// tensor (tma_dk / tma_dv; TMA leaves out the rows past kv_len). That thread waits only until
// the stores have read shared memory (the CTA must not exit before); the global writes complete
// on their own. Before: 4-byte stores straight from the accumulator layout, 3.9 us per CTA at
// H = 128 (docs/perf-notes-v3.md, timeline). The caller guarantees that no GEMM reads those K /
// V rows and columns any more (run_consumer, at the call).
template <class Cfg>
__device__ __forceinline__ void store_key_gradients(const BwdParams& p, const KeyBlock& kb,
                                                    uint32_t smem, int warpgroup, int thread,
                                                    int key_row0,
                                                    float (&dk)[Cfg::kGradCols / 2],
                                                    const float (&dv)[Cfg::kGradCols / 2]) {
  static_assert(!Cfg::kSplitHeadDim, "head dim 256 stores dK / dV from registers");
  using Element = typename Cfg::Element;
  constexpr int kSteps = Cfg::kGradCols / 16;
  constexpr uint32_t kSlabBytes = Cfg::kBlockN * 128;
  const uint32_t k_tile = smem + Cfg::kKOffset, v_tile = smem + Cfg::kVOffset;
  const int warp_row0 = key_row0 + 16 * (thread / 32);
#pragma unroll
  for (int i = 0; i < Cfg::kGradCols / 2; ++i) dk[i] *= p.scale;
  {
    uint32_t a[kSteps][4];
    accumulator_to_fragments<Element>(dk, a);
    store_fragments_swizzled(k_tile, kSlabBytes, warp_row0, 0, thread % 32, a);
  }
  {
    uint32_t a[kSteps][4];
    accumulator_to_fragments<Element>(dv, a);
    store_fragments_swizzled(v_tile, kSlabBytes, warp_row0, 0, thread % 32, a);
  }
  fence_proxy_async_shared();  // the generic-proxy stores, before TMA (async proxy) reads them
  named_barrier_sync(kKeyGradStagedBarrier + warpgroup, 128);
  const int key_lo = kb.n_block * Cfg::kBlockN + key_row0;
  if (thread == 0 && key_lo < p.kv_len) {
#pragma unroll
    for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
      const uint32_t rows = slab * kSlabBytes + key_row0 * 128;
      tma_store_box(&p.tma_dk, k_tile + rows, 64 * slab, key_lo, kb.kv_head, kb.batch);
      tma_store_box(&p.tma_dv, v_tile + rows, 64 * slab, key_lo, kb.kv_head, kb.batch);
    }
    bulk_commit();
    bulk_wait_reads();
  }
}

// dK or dV straight from the accumulator layout: this thread's two key rows (from key0) and
// the warpgroup's columns (from col0: its first column + the lane's) of acc * scale into rows of
// [B, kv_len, K, H] at dst; rows past kv_len skipped. Out = Element: converted, 4-byte stores
// of pairs (head dim 256's epilogue, see write_key_gradients); Out = float: unscaled fp32
// partials (a dkv_partial slot of the GQA schedule or of a key block's part), 8-byte stores.
template <class Cfg, typename Out>
__device__ __forceinline__ void store_key_gradient_rows(const BwdParams& p, Out* dst,
                                                        const KeyBlock& kb, int key0, int col0,
                                                        const float (&acc)[Cfg::kGradCols / 2],
                                                        float scale) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= p.kv_len) continue;
    Out* row = dst + ((int64_t(kb.batch) * p.kv_len + key) * p.num_kv_heads + kb.kv_head) *
                         Cfg::kHeadDim;
#pragma unroll
    for (int c = 0; c < Cfg::kGradCols / 8; ++c) {
      const float x = acc[4 * c + 2 * r] * scale, y = acc[4 * c + 2 * r + 1] * scale;
      if constexpr (std::is_same_v<Out, float>) {
        *reinterpret_cast<float2*>(row + 8 * c + col0) = make_float2(x, y);
      } else {
        *reinterpret_cast<uint32_t*>(row + 8 * c + col0) = pack2<Out>(x, y);
      }
    }
  }
}

// The dK / dV epilogue of the default grid and of the GQA schedule without a split. Head dims
// 64 / 128 stage through shared memory and store by TMA (store_key_gradients). Head dim 256
// keeps the register stores: with the staged epilogue ptxas scheduled its main loop
// differently and the backward ran 4.5-5% slower at T = 4096 (1.3% faster at T = 1024;
// docs/perf-notes-v3.md, "v3 backward, TMA-stored dK/dV epilogue").
template <class Cfg>
__device__ __forceinline__ void write_key_gradients(const BwdParams& p, const KeyBlock& kb,
                                                    uint32_t smem, int warpgroup, int thread,
                                                    int key_row0, int key0, int col0,
                                                    float (&dk)[Cfg::kGradCols / 2],
                                                    const float (&dv)[Cfg::kGradCols / 2]) {
  using Element = typename Cfg::Element;
  if constexpr (Cfg::kSplitHeadDim) {
    store_key_gradient_rows<Cfg>(p, static_cast<Element*>(p.dk), kb, key0, col0, dk, p.scale);
    store_key_gradient_rows<Cfg>(p, static_cast<Element*>(p.dv), kb, key0, col0, dv, 1.f);
  } else {
    store_key_gradients<Cfg>(p, kb, smem, warpgroup, thread, key_row0, dk, dv);
  }
}

// One step per (query head, query block); per step the tensor-core queue holds, in order:
//   owner:  S^T, dP^T | dV (RS, P^T) | dQ (SS, both warpgroups' dS^T) | dK (SS, dS^T)
//   helper: S^T, dP^T | dV (RS, P^T) | dK (SS, dS^T)
// The step ends by waiting for dV (and dQ) only (wait_group 1), and the owner adds dQ (head dim
// 128: stages and adds it after issuing the next step's S^T, kStagesLate), so the next step's
// S^T and dP^T are issued while dK still runs: the queue never drains between steps. The dK of
// step i (dS^T and Q from shared memory) completes before step i + 1's S^T, which is where the
// stage is released.
// dS^T exchange (head dims 64 / 128): dS^T alternates between two shared buffers. The helper
// stores its rows of buffer i % 2 and arrives on ready[i % 2]; the owner stores its rows and
// waits on ready[i % 2] before its dQ GEMM. The helper waits before its stores only on
// free[i % 2], which the owner arrives on once its dQ GEMM of step i - 2 (the buffer's last
// reader) has completed; the owner pre-arrives once per buffer for steps 0 and 1, and the
// helper takes those last two rounds after its loop. The own rows of a buffer are also read by
// the warpgroup's dK of step i - 2, completed in program order. So the helper runs up to two
// steps ahead instead of meeting the owner at a two-way barrier every step (that barrier
// held the faster warpgroup idle: ncu, 14-16% of stall samples), and the two warpgroups' exp
// and dS phases spread over the owner's longer dQ GEMMs instead of running in lockstep.
//
// Head dim 256 (kSplitHeadDim, both kShared): the warpgroup's S^T / dP^T cover the block's 64
// keys and its kScoreCols queries; its dK, dV and dQ columns are its half of the head dim, and
// dK / dV sum over all the step's queries. The queue is
//   S^T, dP^T | dV, dK over its own queries (RS: P^T, dS^T fragments)
//   | dV over the other warpgroup's queries (SS: P^T), dQ (SS) | dK over the other's (SS)
// so the own-query halves run during the stores and the barrier. P^T is stored next to dS^T
// (same layout, two buffers). One two-way barrier per step (ready[i % 2], both sync) suffices:
// buffer i % 2 was last read by step i - 2's dV and dQ GEMMs, which both warpgroups had
// completed before passing step i - 1's barrier. The register fragments of the RS GEMMs die
// at the step's wait_group 1 (they are older than the last group), not across the back edge.
template <class Cfg, DqRole kRole, bool kGqa, bool kDqReducer, bool kPart>
__device__ void run_consumer(const BwdParams& p, const KeyBlock& kb, uint32_t smem,
                             const BwdBarriers& bars, int warpgroup) {
  constexpr bool kSplit = Cfg::kSplitHeadDim;
  constexpr bool kComputesDq = kRole != DqRole::kHelper;
  static_assert(kSplit == (kRole == DqRole::kShared));
  // Head dim 128, default grid and mode: the owner keeps step i's dQ in registers over the back
  // edge and stages it right after issuing step i + 1's S^T GEMM (stage_and_reduce_dq), so that
  // its 16 stores run under that GEMM instead of holding the next step's GEMM issue.
  // Session 24 (docs/perf-notes.md): backward -4.6% at T = 16384, -4.2% at 4096, -2.4% causal;
  // the stores had cost ~18% (timing probe). Not at head dim 64 (+8.8%: ptxas spilled
  // 340-432 bytes) nor in the GQA schedule's kernel (44 / 92 spilled bytes, not measured).
  constexpr bool kStagesLate = kRole == DqRole::kOwner && Cfg::kHeadDim == 128 && !kGqa &&
                               Cfg::kDqByBulkReduce && !kDqReducer;
  // Deterministic mode on the default grid at head dims 64 / 128: dK += dS^T Q as an RS GEMM
  // from the dS^T fragments, issued with dV, instead of reading the warpgroup's dS^T rows back
  // from shared memory after the dS barrier; each warpgroup then waits for all its GEMMs at the
  // step's end. Session 28 (docs/perf-notes.md): that deterministic backward -0.8..-3.6%; the
  // same change was 1.4-2.3% slower in the default mode at head dim 128 (+-0.5% at 64) and
  // 2-4% slower in the GQA schedule's split deterministic kernels, which keep SS.
  constexpr bool kDkFromRegisters = kDqReducer && !kGqa && !kSplit;
  const int thread = threadIdx.x % 128;
  const Lane lane = Lane::of(thread);
  // This warpgroup's part of the block: key rows [key_row0, key_row0 + 64), S^T / dP^T query
  // columns [query_col0, query_col0 + kScoreCols), dK / dV head-dim columns from grad_col0.
  const int key_row0 = kSplit ? 0 : 64 * warpgroup;
  const int query_col0 = kSplit ? Cfg::kScoreCols * warpgroup : 0;
  const int grad_col0 = kSplit ? Cfg::kGradCols * warpgroup : 0;
  // The queries whose dK part is read from shared memory (dS^T written by the other warpgroup
  // at head dim 256, this one's rows of the whole tile otherwise), and how many k-steps.
  const int shared_col0 = kSplit ? Cfg::kScoreCols - query_col0 : 0;
  constexpr int kSharedSteps = (kSplit ? Cfg::kBlockM - Cfg::kScoreCols : Cfg::kBlockM) / 16;
  // Byte offset of the warpgroup's first head-dim slab in a Q / dO stage.
  const uint32_t grad_slab = grad_col0 / 64 * Cfg::kBlockM * 128;
  const int key_lo = kb.n_block * Cfg::kBlockN + key_row0;  // this warpgroup's keys
  const int key0 = key_lo + lane.row0;
  const uint32_t k_tile = smem + Cfg::kKOffset, v_tile = smem + Cfg::kVOffset;
  // The descriptors of the loop's fixed operands: this warpgroup's K and V rows (S^T, dP^T) and
  // the K columns of its dQ (MN-major, 64-column slabs kBlockN rows apart).
  const GmmaDescriptor k_rows = GmmaDescriptor::kmajor(k_tile + key_row0 * 128);
  const GmmaDescriptor v_rows = GmmaDescriptor::kmajor(v_tile + key_row0 * 128);
  const GmmaDescriptor k_dq = GmmaDescriptor::mnmajor(
      k_tile + warpgroup * Cfg::kDqSlabs * Cfg::kBlockN * 128, Cfg::kBlockN * 128);  // owner: 0
  const uint32_t dq_staging = smem + Cfg::kDqStageOffset;  // the owner's (H = 256: none)

  // Both buffers are free before the first step.
  if constexpr (kRole == DqRole::kOwner) {
    named_barrier_arrive(kDsFreeBarrier, kConsumerThreads);
    named_barrier_arrive(kDsFreeBarrier + 1, kConsumerThreads);
  }
  // Set by the first step (issue_rs_gradient, or issue_ss_gradient for dK at head dims <= 128).
  float dk[Cfg::kGradCols / 2], dv[Cfg::kGradCols / 2];
  if (kb.steps > 0) mbarrier_wait(bars.kv_full, 0);
  TIMELINE_EVENT(TIMELINE_CONSUMER(warpgroup, kKvFull), thread == 0);
  // The ring position of the step and of the one before (counters: no division by kStages).
  int stage = 0, last_stage = Cfg::kStages - 1;
  uint32_t phase = 0;
  float dq[Cfg::kDqRowTilesPerWg][32 * Cfg::kDqSlabs];  // the helper has none
#pragma unroll
  for (int r = 0; r < Cfg::kDqRowTilesPerWg; ++r) fresh_accumulator(dq[r]);
  float* staged_tile = p.dq_accum;  // kStagesLate: where the dQ in `dq` goes
  for (int it = 0; it < kb.steps; ++it) {
    const Step st = step_of(kb, first_head<kGqa>(p, kb), it);
    const int buffer = it % 2;
    const uint32_t q_tile = smem + Cfg::kQOffset + stage * Cfg::kQBytes;
    const uint32_t do_tile = smem + Cfg::kDoOffset + stage * Cfg::kQBytes;
    const uint32_t ds_tile = smem + Cfg::kDsOffset + buffer * Cfg::kDsBytes;
    const uint32_t p_tile = smem + Cfg::kPOffset + buffer * Cfg::kPBytes;  // head dim 256
    const uint32_t lse = smem + Cfg::kLseOffset + stage * Cfg::kRowStatBytes + 4 * query_col0;
    const uint32_t dsum = smem + Cfg::kDsumOffset + stage * Cfg::kRowStatBytes + 4 * query_col0;
    const int query_lo = st.m_block * Cfg::kBlockM + query_col0;
    const int query0 = query_lo + lane.col0;

    float s[Cfg::kScoreCols / 2], dp[Cfg::kScoreCols / 2];
    fresh_accumulator(s);
    fresh_accumulator(dp);
    mbarrier_wait(bars.q_full + 8 * stage, phase);
    TIMELINE_STEP_EVENT(TIMELINE_CONSUMER(warpgroup, kQFull), it, kb.steps, thread == 0);
    wgmma_fence();
    issue_keys_by_queries<Cfg>(k_rows, GmmaDescriptor::kmajor(q_tile + query_col0 * 128), s);
    wgmma_commit();
    // kStagesLate: the last step's dQ, staged and reduced while this S^T GEMM runs (step 0:
    // nothing to reduce; the post-loop block below has the same steps).
    if constexpr (kStagesLate)
      stage_and_reduce_dq<Cfg>(dq_staging, staged_tile, thread, warpgroup, it > 0, dq);
    mbarrier_wait(bars.do_full + 8 * stage, phase);
    issue_keys_by_queries<Cfg>(v_rows, GmmaDescriptor::kmajor(do_tile + query_col0 * 128), dp);
    wgmma_commit();
    wgmma_wait<1>();  // S^T, and with it the previous step's dK
    TIMELINE_STEP_EVENT(TIMELINE_CONSUMER(warpgroup, kScoresDone), it, kb.steps, thread == 0);
    fence_registers(s);
    fence_registers(dk);
    // The previous step's stage is free: every consumer thread releases its own lse / D reads
    // of it (probabilities, score_gradients) by arriving itself. With one arrival per warp after
    // a __syncwarp, racecheck reported the next bulk copy into the stage as racing those reads.
    if (it > 0) mbarrier_arrive(bars.empty + 8 * last_stage);
    if (p.softcap == 0.f) probabilities<Cfg>(s, p, lse, lane.col0);
    wgmma_wait<0>();
    fence_registers(dp);
    if (p.softcap == 0.f) {
      score_gradients<Cfg>(s, dp, dsum, lane.col0);
    } else {
      capped_probabilities_and_gradients<Cfg>(s, dp, p, lse, dsum, lane.col0);
    }
    // Computed here, not at the top of the step: held across the GEMMs, the bounds spilled at
    // head dim 64.
    const KeptQueries kept = KeptQueries::of<Cfg>(p, kb, key_lo, key0, query_lo);
    if (kept.masked) zero_unkept<Cfg>(s, dp, kept, query0);

    uint32_t pa[Cfg::kScoreCols / 16][4], dsa[Cfg::kScoreCols / 16][4];
    accumulator_to_fragments<typename Cfg::Element>(s, pa);
    accumulator_to_fragments<typename Cfg::Element>(dp, dsa);
    wgmma_fence();
    // The B operands of the gradient GEMMs (their address): the Q / dO rows of the queries from
    // query_col0 (shared_col0), the warpgroup's head-dim columns, MN-major.
    const auto query_rows = [&](uint32_t tile, int query_col) {
      return tile + query_col * 128 + grad_slab;
    };
    issue_rs_gradient<Cfg, Cfg::kScoreCols / 16>(pa, query_rows(do_tile, query_col0), dv,
                                                 it == 0);
    if constexpr (kSplit || kDkFromRegisters) {
      issue_rs_gradient<Cfg, Cfg::kScoreCols / 16>(dsa, query_rows(q_tile, query_col0), dk,
                                                   it == 0);
    }
    wgmma_commit();

    if constexpr (kRole == DqRole::kHelper)
      named_barrier_sync(kDsFreeBarrier + buffer, kConsumerThreads);
    // The generic-proxy stores must be fenced before the tensor cores (async proxy) read them.
    // dS^T (P^T) -> shared memory, keys as rows, queries in 64-column slabs (the K-major layout
    // of the dK GEMM's A and the MN-major layout of the dQ GEMM's A).
    store_fragments_swizzled(ds_tile, Cfg::kBlockN * 128, key_row0 + 16 * (thread / 32),
                             query_col0, thread % 32, dsa);
    if constexpr (kSplit)
      store_fragments_swizzled(p_tile, Cfg::kBlockN * 128, 16 * (thread / 32), query_col0,
                               thread % 32, pa);
    fence_proxy_async_shared();
    if constexpr (kRole == DqRole::kHelper) {
      named_barrier_arrive(kDsReadyBarrier + buffer, kConsumerThreads);
    } else {
      // The last step's dQ reduce has read the staging buffer (thread 0's own; deterministic
      // mode: the reducer's, which arrived up front for step 0).
      if constexpr (kDqReducer) {
        named_barrier_sync(kDqFreeBarrier, kDqHandoffThreads);
      } else if constexpr (Cfg::kDqByBulkReduce && !kStagesLate) {
        bulk_wait_reads();
      }
      named_barrier_sync(kDsReadyBarrier + buffer, kConsumerThreads);
    }

    wgmma_fence();  // dq was read by the last step's adds (kStagesLate: its staging)
    if constexpr (kComputesDq) {
#pragma unroll
      for (int r = 0; r < Cfg::kDqRowTilesPerWg; ++r) fresh_accumulator(dq[r]);
      if constexpr (kSplit) {
        issue_ss_gradient<Cfg, kSharedSteps>(GmmaDescriptor::kmajor(p_tile + shared_col0 * 2),
                                             query_rows(do_tile, shared_col0), dv, false);
      }
      const GmmaDescriptor ds = GmmaDescriptor::mnmajor(ds_tile, Cfg::kBlockN * 128);
#pragma unroll
      for (int r = 0; r < Cfg::kDqRowTilesPerWg; ++r) issue_dq<Cfg>(ds, k_dq, r, dq[r]);
      wgmma_commit();
    }
    if constexpr (kDkFromRegisters) {
      wgmma_wait<0>();  // dV, dK and dQ: the fragments die here
      fence_registers(dk);
    } else {
      issue_ss_gradient<Cfg, kSharedSteps>(
          GmmaDescriptor::kmajor(ds_tile + key_row0 * 128 + shared_col0 * 2),
          query_rows(q_tile, shared_col0), dk, !kSplit && it == 0);
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ (head dim 256: and the RS part of dK)
    }
    fence_registers(dv);
    fence_registers(pa);
    if constexpr (kSplit || kDkFromRegisters) fence_registers(dsa);
    if constexpr (kComputesDq) {
#pragma unroll
      for (int r = 0; r < Cfg::kDqRowTilesPerWg; ++r) fence_registers(dq[r]);
      if constexpr (kRole == DqRole::kOwner)
        named_barrier_arrive(kDsFreeBarrier + buffer, kConsumerThreads);
      if constexpr (kStagesLate) {
        staged_tile = DqAccum::tile(p.dq_accum, p, kb.batch, st.head,
                                    st.m_block * Cfg::kDqRowTiles, 0, Cfg::kSlabs);
      } else {
        add_dq<Cfg, kDqReducer>(p, kb, st, warpgroup, thread, dq_staging, dq);
      }
    }
    TIMELINE_STEP_EVENT(TIMELINE_CONSUMER(warpgroup, kStepEnd), it, kb.steps, thread == 0);
    last_stage = stage;
    if (++stage == Cfg::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  if constexpr (kRole == DqRole::kHelper) {  // the owner's last two arrivals (see above)
    named_barrier_sync(kDsFreeBarrier, kConsumerThreads);
    named_barrier_sync(kDsFreeBarrier + 1, kConsumerThreads);
  }
  if constexpr (kStagesLate)  // the last step's dQ
    stage_and_reduce_dq<Cfg>(dq_staging, staged_tile, thread, warpgroup, kb.steps > 0, dq);
  wgmma_wait<0>();
  fence_registers(dk);
  TIMELINE_EVENT(TIMELINE_CONSUMER(warpgroup, kDrained), thread == 0);
  if constexpr (Cfg::kDqByBulkReduce && !kDqReducer) {
    bulk_wait_reads();  // the staging buffer outlives the last reduce's read
    TIMELINE_EVENT(TIMELINE_CONSUMER(warpgroup, kStagingRead), thread == 0);
  }
  if (kb.steps == 0) {  // no query row keeps a key of this block: dK = dV = 0
    zero(dk);
    zero(dv);
  }
  // At head dims 64 / 128 store_key_gradients overwrites this warpgroup's rows [key_row0,
  // key_row0 + 64) of the K and V tiles. Nothing reads them any more here (K and V are loaded
  // once, before the first step; the producer touches them no more; with no steps nothing loaded
  // or read them): V rows only by this warpgroup's dP^T GEMMs, K rows by its S^T GEMMs and by the
  // owner's dQ GEMMs (which read all kBlockN keys): this warpgroup's own GEMMs are complete after
  // the wgmma_wait<0> above, and the owner's dQ GEMM of each step completes before its arrival
  // on that step's dS free barrier, the last two of which the helper took after its loop
  // (above): so the helper's K rows are free too, and the owner's K rows are read by no helper
  // GEMM. So no barrier between the two warpgroups is needed: each stores its part when done.
  if constexpr (kGqa) {
    KeyBlock out = kb;  // the real kv head and the split, from the virtual kv head
    out.kv_head = kb.kv_head >> p.kv_split_log2;
    const int split = kb.kv_head & (p.kv_split - 1);
    if (p.kv_split > 1) {  // partials, summed and converted by v3_backward_dkv_reduce_kernel
      store_key_gradient_rows<Cfg>(p, p.dkv_partial + split * p.dkv_slot_elems, out, key0,
                                   lane.col0 + grad_col0, dk, 1.f);
      store_key_gradient_rows<Cfg>(p, p.dkv_partial + (p.kv_split + split) * p.dkv_slot_elems,
                                   out, key0, lane.col0 + grad_col0, dv, 1.f);
    } else {
      write_key_gradients<Cfg>(p, out, smem, warpgroup, thread, key_row0, key0,
                               lane.col0 + grad_col0, dk, dv);
    }
    return;
  }
  if constexpr (kPart) {  // partials, summed and converted by v3_backward_dkv_reduce_kernel
    const int part = int(blockIdx.x) % p.block_parts;
    store_key_gradient_rows<Cfg>(p, p.dkv_partial + part * p.dkv_slot_elems, kb, key0,
                                 lane.col0 + grad_col0, dk, 1.f);
    store_key_gradient_rows<Cfg>(p, p.dkv_partial + (p.block_parts + part) * p.dkv_slot_elems,
                                 kb, key0, lane.col0 + grad_col0, dv, 1.f);
    return;
  }
  write_key_gradients<Cfg>(p, kb, smem, warpgroup, thread, key_row0, key0,
                           lane.col0 + grad_col0, dk, dv);
}

// kDqReducer: deterministic mode at head dims 64 / 128 (run_dq_reducer); the default mode's
// kernels are the code of the build before it. kPart: the default grid's key blocks cut into
// block_parts CTAs each (normal mode).
template <class Cfg, bool kGqa, bool kDqReducer, bool kPart = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    v3_backward_kernel(const __grid_constant__ BwdParams p) {
  static_assert(!kDqReducer || Cfg::kDqByBulkReduce);
  static_assert(!kPart || (!kGqa && !kDqReducer));
  extern __shared__ uint8_t smem_raw[];
  // TMA's 128-byte swizzle and the wgmma descriptors assume 1024-byte-aligned tiles.
  const uint32_t raw = smem_address(smem_raw);
  const uint32_t smem = (raw + 1023) & ~1023u;
  const BwdBarriers bars = BwdBarriers::at<Cfg>(smem + Cfg::kBarrierOffset);
  constexpr uint32_t kEmptyArrivals = 128 * Cfg::kConsumerWarpgroups;  // every consumer thread
  if (threadIdx.x == 0) {
    mbarrier_init(bars.kv_full, 1);
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbarrier_init(bars.q_full + 8 * s, 1);
      mbarrier_init(bars.do_full + 8 * s, 1);
      mbarrier_init(bars.empty + 8 * s, kEmptyArrivals);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  TIMELINE_START(p, threadIdx.x == 0);
  __syncthreads();
  TIMELINE_EVENT(tl::kEntry, threadIdx.x == 0);

  const KeyBlock kb = key_block_of<Cfg, kGqa, kPart>(p);
  TIMELINE_CTA_INFO(kb.steps, threadIdx.x == 0);
  // Broadcast from lane 0 so that the compiler knows it is warp-uniform: the consumer roles
  // below are separate wgmma paths, which ptxas otherwise treats as divergent (C7520).
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (warpgroup == 0) {
    // GQA schedule: the producer gets the real kv head (K / V) in its KeyBlock and the first
    // query head of its steps, both computed here before the register shrink. Computed inside
    // run_producer from the virtual kv head (nvcc 13.0), the H = 64 instantiation spilled
    // 20 / 76 bytes instead of the default kernel's 8 / 24, with one more reload per step in
    // the helper and one in the owner's softcap branch; this way 8 / 32 (the extra 8-byte
    // reload is in the partial-store epilogue).
    KeyBlock producer_kb = kb;
    int gqa_head0 = 0;
    if constexpr (kGqa) {
      producer_kb.kv_head = kb.kv_head >> p.kv_split_log2;
      gqa_head0 = first_head<true>(p, kb);
    }
    shrink_registers<Cfg::kProducerRegisters>();
    if (threadIdx.x == 0) {
      run_producer<Cfg, kGqa>(p, producer_kb, gqa_head0, smem, bars);
    } else if constexpr (kDqReducer) {
      if (threadIdx.x / 32 == 1) run_dq_reducer<Cfg>(p, kb, first_head<kGqa>(p, kb), smem);
    }
  } else if (warpgroup == 1) {
    // A separate instantiation per role: a branch on the role inside the loop, between wgmma
    // issue and wait, would be a divergent path to ptxas (C7520, serialized wgmmas).
    grow_registers<Cfg::kOwnerRegisters>();
    run_consumer<Cfg, Cfg::kSplitHeadDim ? DqRole::kShared : DqRole::kOwner, kGqa, kDqReducer,
                 kPart>(
        p, kb, smem, bars, 0);
    TIMELINE_EVENT(TIMELINE_CONSUMER(0, kExit), threadIdx.x == 128);
  } else {
    grow_registers<Cfg::kHelperRegisters>();
    run_consumer<Cfg, Cfg::kSplitHeadDim ? DqRole::kShared : DqRole::kHelper, kGqa, kDqReducer,
                 kPart>(
        p, kb, smem, bars, 1);
    TIMELINE_EVENT(TIMELINE_CONSUMER(1, kExit), threadIdx.x == 256);
  }
}

// ------------------------------------------------------------------------------------------
// Pre- and postprocessing
// ------------------------------------------------------------------------------------------

struct PrePostParams {
  const void* out;
  const void* dout;
  const float* lse;
  void* dq;
  float* dq_accum;
  float* dsum;
  float* lse_log2;
  int* dq_semaphore;  // null unless deterministic
  int q_len, num_heads, q_len_padded;
  float scale;
};

template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t bits);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

// One CTA (256 threads) per 64 x 64 / kHeadDim padded query rows of a (batch, head): D and
// lse_log2 of the rows, their share of the rows' dq_accum tile zeroed (a contiguous 1 / kParts
// of it: the tile is in fragment order, so a part is not its rows), the tile's semaphore cleared
// by part 0. kHeadDim / 8 threads per row, 16 bytes of O and dO each, two rows per thread, all
// loads issued before the first reduction. Rows per CTA shrink with the head dim so that a
// thread's registers and the CTAs per SM stay those of H = 64: 64 rows per CTA at every head dim
// held 8 / 16 loads per thread at H = 128 / 256 (~80 / ~144 registers, 3 / 1 CTAs per SM) and
// ran at 3.0 / 2.7 TB/s against 3.6 at H = 64 (micro-benchmark, docs/perf-notes-v3.md).
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(256) v3_backward_preprocess_kernel(
    const __grid_constant__ PrePostParams p) {
  constexpr int kParts = kHeadDim / 64;  // CTAs per dq_accum tile
  constexpr int kRows = kDqTileRows / kParts;
  constexpr int kLanesPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = 256 / kLanesPerRow;
  constexpr int kPasses = kRows / kRowsPerPass;
  const int part = blockIdx.x % kParts, row_tile = blockIdx.x / kParts;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int sub = threadIdx.x % kLanesPerRow, row_in_pass = threadIdx.x / kLanesPerRow;
  const int row0 = row_tile * kDqTileRows + part * kRows;
  const int64_t batch_head = int64_t(batch) * p.num_heads + head;
  const int64_t stats = batch_head * p.q_len_padded;
  uint4 o[kPasses], d[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int t = row0 + pass * kRowsPerPass + row_in_pass;
    o[pass] = d[pass] = make_uint4(0, 0, 0, 0);
    if (t < p.q_len) {
      const int64_t offset = ((int64_t(batch) * p.q_len + t) * p.num_heads + head) * kHeadDim;
      const Element* out = static_cast<const Element*>(p.out) + offset + 8 * sub;
      const Element* dout = static_cast<const Element*>(p.dout) + offset + 8 * sub;
      o[pass] = *reinterpret_cast<const uint4*>(out);
      d[pass] = *reinterpret_cast<const uint4*>(dout);
    }
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const uint32_t ow[4] = {o[pass].x, o[pass].y, o[pass].z, o[pass].w};
    const uint32_t dw[4] = {d[pass].x, d[pass].y, d[pass].z, d[pass].w};
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 a = unpack2<Element>(ow[k]), b = unpack2<Element>(dw[k]);
      sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
    }
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const int t = row0 + pass * kRowsPerPass + row_in_pass;
    if (sub == 0) {
      const float lse = t < p.q_len ? p.lse[batch_head * p.q_len + t] : -INFINITY;
      p.dsum[stats + t] = sum;
      p.lse_log2[stats + t] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    }
  }
  float4* tile = reinterpret_cast<float4*>(
      p.dq_accum + ((stats / kDqTileRows + row_tile) * kDqTileRows + part * kRows) * kHeadDim);
#pragma unroll
  for (int i = threadIdx.x; i < kRows * kHeadDim / 4; i += 256)
    tile[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.dq_semaphore != nullptr && part == 0 && threadIdx.x == 0)
    p.dq_semaphore[stats / kDqTileRows + row_tile] = 0;
}

// One CTA (one warpgroup's worth of threads) per 64 padded query rows of a (batch, head):
// dq = scale * dq_accum. Each 64 x 64 tile is read in its fragment order (coalesced float4),
// converted into a shared row-major tile, and written out in 16-byte pieces of whole rows
// (stored straight from the fragment layout, every 4-byte store left half of its sector).
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(128) v3_backward_postprocess_kernel(
    const __grid_constant__ PrePostParams p) {
  constexpr int kSlabs = kHeadDim / 64;
  // Rows padded by 16 bytes: the 8 rows x 4 lanes of a fragment store hit 32 distinct banks.
  constexpr int kRowElements = kHeadDim + 8;
  __shared__ __align__(16) Element rows[kDqTileRows * kRowElements];
  const int row_tile = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int thread = threadIdx.x;
  const Lane lane = Lane::of(thread);
  const int64_t stats = (int64_t(batch) * p.num_heads + head) * p.q_len_padded;
#pragma unroll
  for (int slab = 0; slab < kSlabs; ++slab) {
    const float4* src = reinterpret_cast<const float4*>(
        p.dq_accum + ((stats / kDqTileRows + row_tile) * kSlabs + slab) * kDqTileFloats +
        4 * thread);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 v = src[128 * j];
      const int column = slab * 64 + 8 * j + lane.col0;
      *reinterpret_cast<uint32_t*>(&rows[lane.row0 * kRowElements + column]) =
          pack2<Element>(v.x * p.scale, v.y * p.scale);
      *reinterpret_cast<uint32_t*>(&rows[(lane.row0 + 8) * kRowElements + column]) =
          pack2<Element>(v.z * p.scale, v.w * p.scale);
    }
  }
  __syncthreads();
  constexpr int kChunksPerRow = kHeadDim / 8;
#pragma unroll
  for (int i = thread; i < kDqTileRows * kChunksPerRow; i += 128) {
    const int r = i / kChunksPerRow, chunk = i % kChunksPerRow;
    const int t = row_tile * kDqTileRows + r;
    if (t >= p.q_len) continue;
    Element* row = static_cast<Element*>(p.dq) +
                   ((int64_t(batch) * p.q_len + t) * p.num_heads + head) * kHeadDim;
    *reinterpret_cast<uint4*>(row + 8 * chunk) =
        *reinterpret_cast<const uint4*>(&rows[r * kRowElements + 8 * chunk]);
  }
}

// GQA schedule with kv_split > 1, or the default grid's key blocks in parts: dk = scale * sum
// of the dK slots, dv = sum of the dV slots, added in slot order (deterministic). 4 elements per
// thread and iteration (16-byte loads, one per slot and tensor; 8-byte stores); grid-stride.
template <typename Element>
__global__ void __launch_bounds__(256) v3_backward_dkv_reduce_kernel(
    const float* __restrict__ partial, int64_t slot_elems, int splits, float scale, void* dk,
    void* dv) {
  const int64_t quads = slot_elems / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < quads;
       i += int64_t(gridDim.x) * blockDim.x) {
    float4 k = reinterpret_cast<const float4*>(partial)[i];
    float4 v = reinterpret_cast<const float4*>(partial + splits * slot_elems)[i];
    for (int s = 1; s < splits; ++s) {
      const float4 k1 = reinterpret_cast<const float4*>(partial + s * slot_elems)[i];
      const float4 v1 = reinterpret_cast<const float4*>(partial + (splits + s) * slot_elems)[i];
      k.x += k1.x, k.y += k1.y, k.z += k1.z, k.w += k1.w;
      v.x += v1.x, v.y += v1.y, v.z += v1.z, v.w += v1.w;
    }
    reinterpret_cast<uint2*>(dk)[i] =
        make_uint2(pack2<Element>(k.x * scale, k.y * scale), pack2<Element>(k.z * scale, k.w * scale));
    reinterpret_cast<uint2*>(dv)[i] = make_uint2(pack2<Element>(v.x, v.y), pack2<Element>(v.z, v.w));
  }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

template <typename Element, int kHeadDim>
struct BwdConfigFor;
template <typename Element>
struct BwdConfigFor<Element, 64> {
  using type = BwdConfig<Element, 64, 128>;
};
template <typename Element>
struct BwdConfigFor<Element, 128> {
  using type = BwdConfig<Element, 128, 64>;
};
template <typename Element>
struct BwdConfigFor<Element, 256> {
  using type = BwdConfig<Element, 256, 64>;
};

// ---- GQA schedule: when it is used, and with how many CTAs per kv head ----
//
// The default grid has one CTA per (key block, kv head, batch) and loops over all heads_per_kv
// query heads in it. For GQA / MQA with few such CTAs per SM the last wave decides the time:
// e.g. B = 4, T = 4096, 16 query heads over 2 kv heads, H = 128, causal: 32 x 2 x 4 = 256 CTAs
// on 132 SMs, key block n doing 8 x (64 - 2n) steps (512 .. 16), 516 steps per SM on average
// counting 2 steps of per-CTA overhead, so the 8 key-block-0 CTAs alone are as long as the
// average SM's load; the default grid dispatches them at linear positions 0, 32, ..., 224,
// the last ones only after ~300 steps, and a list-scheduling count gives 820 steps (1.59x the
// average). The GQA schedule (v3_backward_kernel<Cfg, true, *>) dispatches the longest key blocks
// first (normal mode) and may split the group's query heads over kv_split CTAs, whose fp32
// dK / dV partials v3_backward_dkv_reduce_kernel sums. choose_schedule counts the candidates
// with the same list-scheduling model (CTAs dispatched in grid order onto the first free SM,
// cost in steps of one CTA step) and takes the cheapest; docs/perf-notes-v3.md, "v3 backward,
// GQA split", has the numbers.

constexpr int kMaxKvSplit = 4;  // splits are 1, 2 or 4 (a power of two)
// The most SMs of an sm_90 part (H100 SXM, H200, GH200): the dkv_partial workspace is sized
// from the shape for this count (the Python side has no device), and the rule never picks
// more CTAs per kv head on a device with fewer SMs.
constexpr int kWorkspaceSmCount = 132;
// The GQA schedule is considered below this many default-grid CTAs per SM.
constexpr int kGqaMaxCtasPerSm = 4;
// The default grid's key blocks may be cut into up to this many CTAs each (choose_block_parts)
// when the grid has fewer CTAs than SMs. (Cutting only the key blocks of a larger grid's partial
// last wave measured no gain: docs/perf-notes.md, session 27.)
constexpr int kMaxBlockParts = 4;
// Model costs, in steps of one CTA (10.5 MFLOP, ~2.56 us on the H200 at H = 128; measured:
// main kernel of H=128 T=4096 B=4 N=16, 1.48 ms causal / 580 modelled steps, 2.72 ms
// non-causal / 1056): per-CTA overhead (K / V load, pipeline fill, dK / dV store), its extra
// with fp32 partials, and a reduce kernel's traffic (~9 MB per step at ~3.5 TB/s) + a launch.
constexpr double kCtaOverheadSteps = 2.0;
constexpr double kPartialStoreSteps = 0.5;
constexpr double kReduceBytesPerStep = 9.0e6;
constexpr double kReduceLaunchSteps = 1.0;
// Measured (docs/perf-notes-v3.md, "v3 backward, GQA split", device results): under causal
// masking the unsplit GQA schedule ran 5-21% slower per modelled step than s = 2 (3 shapes:
// 3.16 / 2.69 / 2.89 us against 2.61 / 2.57 / 2.75), which the count does not see; 1.08 makes
// the rule pick the measured fastest of s = 1, 2, 4 on all three.
constexpr double kUnsplitGqaFactor = 1.08;

// The main kernel's keys per CTA (n) and queries per step (m) at a head dim (its BwdConfig; the
// element type does not change them).
struct BlockSizes {
  int n, m;
};
template <int kHeadDim>
constexpr BlockSizes block_sizes_of() {
  using Cfg = typename BwdConfigFor<__nv_bfloat16, kHeadDim>::type;
  return {Cfg::kBlockN, Cfg::kBlockM};
}
BlockSizes block_sizes(int64_t head_dim) {
  return head_dim == 64    ? block_sizes_of<64>()
         : head_dim == 128 ? block_sizes_of<128>()
                           : block_sizes_of<256>();
}
int64_t key_blocks(const AttentionShape& sh) {
  const int bn = block_sizes(sh.head_dim).n;
  return (sh.kv_len + bn - 1) / bn;
}

// CTAs of the default grid: key blocks x kv heads x batch.
int64_t default_grid_ctas(const AttentionShape& sh) {
  return key_blocks(sh) * sh.num_kv_heads * sh.batch;
}

// The most CTAs per key block the dkv_partial workspace is sized for (1: never split).
int workspace_block_parts(const AttentionShape& sh) {
  return default_grid_ctas(sh) < kWorkspaceSmCount ? kMaxBlockParts : 1;
}

bool gqa_schedule_considered(const AttentionShape& sh, int sm_count) {
  if (sh.num_kv_heads <= 0 || sh.num_heads <= sh.num_kv_heads) return false;
  return default_grid_ctas(sh) < int64_t(kGqaMaxCtasPerSm) * sm_count;
}

// The largest split the dkv_partial workspace is sized for (1: none, a 4-byte workspace).
int workspace_kv_split(const AttentionShape& sh) {
  if (!gqa_schedule_considered(sh, kWorkspaceSmCount)) return 1;
  const int64_t g = sh.num_heads / sh.num_kv_heads;
  for (int s = kMaxKvSplit; s > 1; s /= 2)
    if (g % s == 0) return s;
  return 1;
}

int64_t dkv_slot_elems(const AttentionShape& sh) {
  return sh.batch * sh.kv_len * sh.num_kv_heads * sh.head_dim;
}

// Steps of one head over key block n (full lengths), as key_block_of counts them.
int64_t steps_per_head(const AttentionShape& sh, const BwdParams& p, int64_t n) {
  const BlockSizes blocks = block_sizes(sh.head_dim);
  const int64_t c0 = n * blocks.n, c1 = std::min(c0 + blocks.n, sh.kv_len) - 1;
  int64_t begin, end;
  kept_query_blocks(c0, c1, sh.q_len, p.window_left, p.window_right, blocks.m, &begin, &end);
  return end - begin;
}

// Steps of one head over each key block (full lengths).
std::vector<int64_t> steps_per_key_block(const AttentionShape& sh, const BwdParams& p) {
  std::vector<int64_t> per_head(size_t(key_blocks(sh)));
  for (size_t n = 0; n < per_head.size(); ++n) per_head[n] = steps_per_head(sh, p, int64_t(n));
  return per_head;
}

// Modelled time (steps) of a schedule: split < 1 = the default grid, its key blocks cut into
// block_parts CTAs each, else the GQA schedule.
double schedule_cost(const AttentionShape& sh, bool deterministic, int split, int block_parts,
                     int sm_count, const std::vector<int64_t>& per_head) {
  const int64_t blocks = int64_t(per_head.size());
  const bool gqa = split >= 1;
  const int s = gqa ? split : 1;
  const int64_t groups = sh.batch * sh.num_kv_heads * s;
  const int64_t heads = sh.num_heads / sh.num_kv_heads / s;
  const int parts = gqa ? 1 : block_parts;  // CTAs per key block
  const double overhead = kCtaOverheadSteps + (s * parts > 1 ? kPartialStoreSteps : 0.0);
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int i = 0; i < sm_count; ++i) free_at.push(0.0);
  double end = 0.0;
  for (int64_t i = 0; i < blocks * groups * parts; ++i) {
    int64_t n;
    if (gqa) {  // key block slowest: ascending (longest first), deterministic descending
      n = deterministic ? blocks - 1 - i / groups : i / groups;
    } else {
      const int64_t x = i / parts % blocks;
      n = deterministic ? blocks - 1 - x : x;
    }
    const int64_t part = i % parts, m = per_head[n];  // key_block_of's share of a part
    const double t = free_at.top() + heads * double((part + 1) * m / parts - part * m / parts) +
                     overhead;
    free_at.pop();
    free_at.push(t);
    end = std::max(end, t);
  }
  if (s * parts > 1) {
    const double bytes = double(dkv_slot_elems(sh)) * (2.0 * s * parts * 4 + 2 * 2);
    end += bytes / kReduceBytesPerStep + kReduceLaunchSteps;
  } else if (gqa) {
    end *= kUnsplitGqaFactor;
  }
  return end;
}

// The main kernel's grid: split -1 = the default grid, its key blocks cut into block_parts CTAs
// each; S >= 1 = the GQA schedule with that many CTAs per kv head; -2 = none that the call can
// take.
struct BwdSchedule {
  int split = -1;
  int block_parts = 1;
};

// Whether cutting the default grid's key blocks is counted: normal mode, a grid of fewer CTAs
// than SMs, partial slots available.
bool block_parts_considered(const AttentionShape& sh, bool deterministic, int sm_count,
                            int max_parts) {
  return !deterministic && max_parts > 1 && default_grid_ctas(sh) < sm_count;
}

// The CTAs per key block of the default grid (1 .. max_parts) the count finds fastest; 1 (no
// parts) unless 1% faster.
int choose_block_parts(const AttentionShape& sh, bool deterministic, int sm_count, int max_parts,
                       const std::vector<int64_t>& per_head) {
  int best = 1;
  if (!block_parts_considered(sh, deterministic, sm_count, max_parts)) return best;
  double best_cost = schedule_cost(sh, deterministic, -1, 1, sm_count, per_head);
  for (int parts = 2; parts <= max_parts; ++parts) {
    const double cost = schedule_cost(sh, deterministic, -1, parts, sm_count, per_head);
    if (cost < 0.99 * best_cost) {
      best = parts;
      best_cost = cost;
    }
  }
  return best;
}

// The default grid (cut into parts or not) or the GQA schedule, whichever the count finds
// faster.
BwdSchedule choose_schedule(const AttentionShape& sh, const BwdParams& p, bool deterministic,
                            int sm_count, int max_split, int max_parts) {
  BwdSchedule best;
  const bool gqa = gqa_schedule_considered(sh, sm_count);
  if (!gqa && !block_parts_considered(sh, deterministic, sm_count, max_parts)) return best;
  struct Entry {
    std::array<int64_t, 12> key;
    BwdSchedule schedule;
  };
  static std::mutex mutex;
  static std::vector<Entry> cache;
  const std::array<int64_t, 12> key{sh.batch, sh.q_len, sh.kv_len, sh.num_heads, sh.num_kv_heads,
                                    sh.head_dim, p.window_left, p.window_right,
                                    int64_t(deterministic), sm_count, max_split, max_parts};
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Entry& e : cache)
      if (e.key == key) return e.schedule;
  }
  const std::vector<int64_t> per_head = steps_per_key_block(sh, p);
  best.block_parts = choose_block_parts(sh, deterministic, sm_count, max_parts, per_head);
  if (gqa) {
    const int64_t g = sh.num_heads / sh.num_kv_heads;
    double best_cost =
        schedule_cost(sh, deterministic, -1, best.block_parts, sm_count, per_head);
    for (int s = 1; s <= std::min<int64_t>(max_split, g); s *= 2) {
      if (g % s != 0) continue;
      const double cost = schedule_cost(sh, deterministic, s, 1, sm_count, per_head);
      if (cost < 0.99 * best_cost) {  // a smaller split unless 1% slower
        best.split = s;
        best_cost = cost;
      }
    }
    if (best.split >= 1) best.block_parts = 1;
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() >= 64) cache.erase(cache.begin());
  cache.push_back({key, best});
  return best;
}

#ifdef JAX_FLASH_V3_BWD_TIMELINE
timeline::Buffer timeline_buffer;  // V3BackwardSetTimeline
#endif

// The BwdParams fields of launch_main that choose_schedule reads (windows).
BwdParams window_params(const BackwardArgs& a) {
  BwdParams p{};
  set_score_params(p, a.fwd.spec);
  return p;
}

// schedule.split < 1: the default grid (v3_backward_kernel<Cfg, false, *>; the kPart kernel
// when its key blocks are cut into block_parts > 1 CTAs); else the GQA schedule.
template <class Cfg>
cudaError_t launch_main(const BackwardArgs& a, const V3BackwardWorkspace& ws, bool deterministic,
                        const BwdSchedule& schedule, cudaStream_t stream) {
  const int split = schedule.split;
  const AttentionShape& sh = a.fwd.shape;
  BwdParams p;
  if (!encode_tensor_map(&p.tma_q, a.fwd.q, a.fwd.dtype, sh.batch, sh.q_len, sh.num_heads,
                         sh.head_dim, Cfg::kBlockM) ||
      !encode_tensor_map(&p.tma_do, a.dout, a.fwd.dtype, sh.batch, sh.q_len, sh.num_heads,
                         sh.head_dim, Cfg::kBlockM) ||
      !encode_tensor_map(&p.tma_k, a.fwd.k, a.fwd.dtype, sh.batch, sh.kv_len, sh.num_kv_heads,
                         sh.head_dim, Cfg::kBlockN) ||
      !encode_tensor_map(&p.tma_v, a.fwd.v, a.fwd.dtype, sh.batch, sh.kv_len, sh.num_kv_heads,
                         sh.head_dim, Cfg::kBlockN) ||
      (!Cfg::kSplitHeadDim &&  // head dim 256 stores dK / dV from registers
       (!encode_tensor_map(&p.tma_dk, a.dk, a.fwd.dtype, sh.batch, sh.kv_len, sh.num_kv_heads,
                           sh.head_dim, kKeyGradBoxRows) ||
        !encode_tensor_map(&p.tma_dv, a.dv, a.fwd.dtype, sh.batch, sh.kv_len, sh.num_kv_heads,
                           sh.head_dim, kKeyGradBoxRows)))) {
    return cudaErrorInvalidValue;
  }
  p.dk = a.dk;
  p.dv = a.dv;
  p.dq_accum = ws.dq_accum;
  p.dsum = ws.dsum;
  p.lse_log2 = ws.lse_log2;
  p.dq_semaphore = deterministic ? ws.dq_semaphore : nullptr;
  p.q_seqlens = a.fwd.q_seqlens;
  p.kv_seqlens = a.fwd.kv_seqlens;
  p.q_len = int(sh.q_len);
  p.kv_len = int(sh.kv_len);
  p.num_heads = int(sh.num_heads);
  p.num_kv_heads = int(sh.num_kv_heads);
  p.heads_per_kv = int(sh.num_heads / sh.num_kv_heads);
  p.q_len_padded = int(padded_rows(sh.q_len));
  const MaskSpec& spec = a.fwd.spec;
  p.scale = spec.scale;
  set_score_params(p, spec);

  const bool gqa = split >= 1, parts = !gqa && schedule.block_parts > 1;
  const int kv_split = gqa ? split : 1;
  p.kv_split = kv_split;
  p.kv_split_log2 = kv_split == 4 ? 2 : kv_split == 2 ? 1 : 0;
  p.heads_per_cta = p.heads_per_kv / kv_split;
  p.dkv_partial = gqa || parts ? ws.dkv_partial : nullptr;
  p.dkv_slot_elems = gqa || parts ? dkv_slot_elems(sh) : 0;
  const int64_t blocks = key_blocks(sh), virtual_kv_heads = sh.num_kv_heads * kv_split;
  if (gqa && (blocks > 65535 || virtual_kv_heads > 65535)) return cudaErrorInvalidValue;
  p.key_blocks = int(blocks);
  p.block_parts = schedule.block_parts;
  // Default grid: key block 0 first (x fastest): under causal masking it has the most query
  // blocks, and deterministic mode needs lower key blocks dispatched before the higher ones
  // that wait for them; a key block's parts one after another in that order. GQA schedule: the
  // key block the slowest index (key_block_of).
  const dim3 grid =
      gqa     ? dim3(unsigned(virtual_kv_heads), unsigned(sh.batch), unsigned(blocks))
      : parts ? dim3(unsigned(default_grid_ctas(sh) * schedule.block_parts))
              : dim3(unsigned(blocks), unsigned(sh.num_kv_heads), unsigned(sh.batch));
#ifdef JAX_FLASH_V3_BWD_TIMELINE
  if (!timeline_buffer.fits(int64_t(grid.x) * grid.y * grid.z)) return cudaErrorInvalidValue;
  p.timeline = timeline_buffer.records;
#endif
  // Deterministic mode at head dims 64 / 128: the kernels with the dQ reducer warp.
  constexpr bool kReducer = Cfg::kDqByBulkReduce;
  void (*const kernel)(BwdParams) =
      parts ? v3_backward_kernel<Cfg, false, false, true>
      : deterministic && kReducer
          ? (gqa ? v3_backward_kernel<Cfg, true, kReducer>
                 : v3_backward_kernel<Cfg, false, kReducer>)
          : (gqa ? v3_backward_kernel<Cfg, true, false> : v3_backward_kernel<Cfg, false, false>);
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim>
cudaError_t launch_all(const BackwardArgs& a, const V3BackwardWorkspace& ws, bool deterministic,
                       const BwdSchedule& schedule, int sm_count, cudaStream_t stream) {
  using Cfg = typename BwdConfigFor<Element, kHeadDim>::type;
  const int split = schedule.split;
  const AttentionShape& sh = a.fwd.shape;
  PrePostParams pp;
  pp.out = a.fwd.out;
  pp.dout = a.dout;
  pp.lse = a.fwd.lse;
  pp.dq = a.dq;
  pp.dq_accum = ws.dq_accum;
  pp.dsum = ws.dsum;
  pp.lse_log2 = ws.lse_log2;
  pp.dq_semaphore = deterministic ? ws.dq_semaphore : nullptr;
  pp.q_len = int(sh.q_len);
  pp.num_heads = int(sh.num_heads);
  pp.q_len_padded = int(padded_rows(sh.q_len));
  pp.scale = a.fwd.spec.scale;
  const dim3 row_grid(unsigned(pp.q_len_padded / kDqTileRows), unsigned(sh.num_heads),
                      unsigned(sh.batch));
  const dim3 pre_grid(row_grid.x * (kHeadDim / 64), row_grid.y, row_grid.z);
  cudaError_t err;
  if (sh.q_len > 0) {
    v3_backward_preprocess_kernel<Element, kHeadDim><<<pre_grid, 256, 0, stream>>>(pp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  err = launch_main<Cfg>(a, ws, deterministic, schedule, stream);
  if (err != cudaSuccess) return err;
  if (const int slots = split > 1 ? split : schedule.block_parts; slots > 1) {
    const int64_t slot = dkv_slot_elems(sh);
    const int64_t blocks = std::min<int64_t>((slot / 4 + 255) / 256, int64_t(8) * sm_count);
    v3_backward_dkv_reduce_kernel<Element><<<unsigned(std::max<int64_t>(blocks, 1)), 256, 0,
                                             stream>>>(ws.dkv_partial, slot, slots,
                                                       a.fwd.spec.scale, a.dk, a.dv);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (sh.q_len > 0) {
    v3_backward_postprocess_kernel<Element, kHeadDim><<<row_grid, 128, 0, stream>>>(pp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

V3BackwardWorkspaceBytes V3BackwardWorkspaceSizes(const AttentionShape& sh, bool deterministic) {
  const int64_t rows = sh.batch * sh.num_heads * padded_rows(sh.q_len);
  V3BackwardWorkspaceBytes b;
  b.dq_accum = rows * sh.head_dim * 4;
  b.dsum = rows * 4;
  b.lse_log2 = rows * 4;
  b.dq_semaphore = deterministic ? rows / kDqTileRows * 4 : 4;
  // Slots for the larger of the GQA split and the key blocks' parts.
  const int slots = std::max(workspace_kv_split(sh), workspace_block_parts(sh));
  b.dkv_partial = slots > 1 ? 2 * slots * dkv_slot_elems(sh) * 4 : 4;
  return b;
}

int V3BackwardMaxKvSplit(const AttentionShape& shape) { return workspace_kv_split(shape); }

int V3BackwardMaxBlockParts(const AttentionShape& shape) { return workspace_block_parts(shape); }

#ifdef JAX_FLASH_V3_BWD_TIMELINE
void V3BackwardSetTimeline(uint64_t* records, int64_t ctas) {
  timeline_buffer.set(records, ctas);
}
#endif

namespace {

// V3BackwardUnsupportedReason on a device of `info` (null: none could be queried), which the
// entry points query once per call.
const char* unsupported_reason(const BackwardArgs& a, const DeviceInfo* info) {
  const AttentionShape& sh = a.fwd.shape;
  if (a.fwd.dtype != DType::kBF16 && a.fwd.dtype != DType::kF16)
    return "v3 backward needs bfloat16 or float16";
  if (sh.head_dim != 64 && sh.head_dim != 128 && sh.head_dim != 256)
    return "v3 backward needs head dim 64, 128 or 256";
  if (a.fwd.bias.data != nullptr || a.dbias != nullptr)
    return "v3 backward does not take a bias tensor";
  if (a.fwd.mask.data != nullptr) return "v3 backward does not take a mask tensor";
  // Pre- and postprocessing move out, dout and dq in 16-byte pieces (TMA reads dout too); TMA
  // stores dk and dv (tensor maps need 16-byte-aligned addresses).
  if ((reinterpret_cast<uintptr_t>(a.fwd.out) | reinterpret_cast<uintptr_t>(a.dout) |
       reinterpret_cast<uintptr_t>(a.dq) | reinterpret_cast<uintptr_t>(a.dk) |
       reinterpret_cast<uintptr_t>(a.dv)) % 16 != 0)
    return "v3 backward needs 16-byte-aligned out, dout, dq, dk and dv";
  if (!(a.fwd.spec.scale > 0.f)) return "v3 backward needs scale > 0";
  if (sh.num_kv_heads <= 0 || sh.num_heads % sh.num_kv_heads != 0)
    return "query heads must be a multiple of kv heads";
  if (sh.kv_len < 1) return "v3 backward needs at least one key";
  if (sh.batch > 65535 || sh.num_kv_heads > 65535 || sh.num_heads > 65535)
    return "v3 backward launches batch and heads on grid dimensions of at most 65535";
  if (padded_rows(sh.q_len) >= (int64_t(1) << 31) || sh.kv_len >= (int64_t(1) << 31))
    return "v3 backward indexes rows with 32-bit integers";
  if (info == nullptr) return "no CUDA device";
  if (info->major != 9 || info->minor != 0) return "v3 backward needs an sm_90 (Hopper) device";
  return nullptr;
}

// The schedule V3BackwardScheduled runs: kv_split 0 = choose_schedule's, else kv_split as given
// (-1 = the default grid, its key blocks cut into block_parts CTAs each: -1 = choose_block_parts's
// choice, 1 = whole). split -2: one this call cannot take.
BwdSchedule resolve_schedule(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                             bool deterministic, int kv_split, int block_parts, int sm_count) {
  const AttentionShape& sh = args.fwd.shape;
  const bool partials = workspace.dkv_partial != nullptr;
  const int max_split = partials ? workspace_kv_split(sh) : 1;
  const int max_parts = partials ? workspace_block_parts(sh) : 1;
  BwdSchedule invalid;
  invalid.split = -2;
  if (kv_split == 0) {
    if (block_parts != -1) return invalid;
    return choose_schedule(sh, window_params(args), deterministic, sm_count, max_split, max_parts);
  }
  if (kv_split == -1) {
    BwdSchedule s;
    if (block_parts == -1) {
      s.block_parts = choose_block_parts(sh, deterministic, sm_count, max_parts,
                                         steps_per_key_block(sh, window_params(args)));
    } else if (block_parts < 1 || block_parts > max_parts || (deterministic && block_parts > 1)) {
      return invalid;
    } else {
      s.block_parts = block_parts;
    }
    return s;
  }
  const int64_t g = sh.num_heads / sh.num_kv_heads;
  if (block_parts != -1 || kv_split < 1 || kv_split > kMaxKvSplit ||
      (kv_split & (kv_split - 1)) != 0 || g % kv_split != 0 || kv_split > std::max(max_split, 1))
    return invalid;
  BwdSchedule s;
  s.split = kv_split;
  return s;
}

}  // namespace

const char* V3BackwardUnsupportedReason(const BackwardArgs& a) {
  DeviceInfo info;
  return unsupported_reason(a, current_device(&info));
}

cudaError_t V3BackwardScheduled(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                                bool deterministic, int kv_split, cudaStream_t stream,
                                int block_parts) {
  DeviceInfo info;
  if (unsupported_reason(args, current_device(&info)) != nullptr) return cudaErrorInvalidValue;
  if (workspace.dq_accum == nullptr || workspace.dsum == nullptr ||
      workspace.lse_log2 == nullptr || (deterministic && workspace.dq_semaphore == nullptr))
    return cudaErrorInvalidValue;
  if (args.fwd.shape.batch * args.fwd.shape.num_heads == 0) return cudaSuccess;
  const BwdSchedule schedule =
      resolve_schedule(args, workspace, deterministic, kv_split, block_parts, info.sm_count);
  if (schedule.split == -2) return cudaErrorInvalidValue;
  const int sms = info.sm_count;
  const bool bf16 = args.fwd.dtype == DType::kBF16;
  const BackwardArgs& a = args;
  const V3BackwardWorkspace& ws = workspace;
  const bool det = deterministic;
  if (a.fwd.shape.head_dim == 64)
    return bf16 ? launch_all<__nv_bfloat16, 64>(a, ws, det, schedule, sms, stream)
                : launch_all<__half, 64>(a, ws, det, schedule, sms, stream);
  if (a.fwd.shape.head_dim == 128)
    return bf16 ? launch_all<__nv_bfloat16, 128>(a, ws, det, schedule, sms, stream)
                : launch_all<__half, 128>(a, ws, det, schedule, sms, stream);
  return bf16 ? launch_all<__nv_bfloat16, 256>(a, ws, det, schedule, sms, stream)
              : launch_all<__half, 256>(a, ws, det, schedule, sms, stream);
}

cudaError_t V3Backward(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                       bool deterministic, cudaStream_t stream) {
  return V3BackwardScheduled(args, workspace, deterministic, 0, stream);
}

namespace {

// The schedule V3Backward would run on a device of sm_count SMs (0: the current device; split -2
// when it cannot be known).
BwdSchedule chosen_schedule(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                            bool deterministic, int sm_count) {
  BwdSchedule unknown;
  unknown.split = -2;
  const AttentionShape& sh = args.fwd.shape;
  if (sh.num_kv_heads <= 0 || sh.num_heads % sh.num_kv_heads || sh.kv_len < 1) return unknown;
  if (sm_count <= 0) {
    DeviceInfo info;
    if (current_device_info(&info) != cudaSuccess) return unknown;
    sm_count = info.sm_count;
  }
  return resolve_schedule(args, workspace, deterministic, 0, -1, sm_count);
}

}  // namespace

int V3BackwardChosenSplit(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                          bool deterministic, int sm_count) {
  return std::max(chosen_schedule(args, workspace, deterministic, sm_count).split, -1);
}

int V3BackwardChosenBlockParts(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                               bool deterministic, int sm_count) {
  const BwdSchedule s = chosen_schedule(args, workspace, deterministic, sm_count);
  return s.split == -1 ? s.block_parts : 1;
}

}  // namespace jax_flash
