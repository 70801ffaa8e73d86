// v3: the Hopper (sm_90a) FlashAttention forward.
//
// One CTA per SM, persistent over (m-block, head, batch) tiles, with warp-specialized roles:
//
//   warpgroup 0      producer: one thread issues TMA loads of the Q tile and of K / V tiles into
//                    a kStages-deep shared-memory ring; every buffer has a "full" mbarrier (TMA
//                    transaction bytes) and an "empty" mbarrier (consumers are done reading).
//   warpgroups 1..W  consumers: each owns 64 rows of the kBlockM-row Q tile. S = Q K^T runs as
//                    wgmma with K in shared memory and Q in registers (loaded once per tile with
//                    ldmatrix; in shared memory too where the registers do not fit: head dim
//                    256, the 192-row and 192-key tiles); O += P V as wgmma with P from
//                    registers (the fp32 accumulator layout of S is the register A layout of the
//                    PV product, so P needs no shuffles) and V read transposed from shared memory.
//
// Overlap, as in FlashAttention-3:
//   * intra-warpgroup: block j's S GEMM and block j+1's PV GEMM are issued back to back; the
//     softmax of S_j runs while the tensor cores still work on PV_{j+1}.
//   * inter-warpgroup ("pingpong"): a ring of named barriers lets one consumer warpgroup issue
//     its GEMMs at a time, so one warpgroup's softmax overlaps the other's GEMMs.
//   * across tiles (head dims 64 and 128 with 128-key blocks, where three Q buffers fit): the
//     producer loads the next tiles' Q while this one runs; a tile's last PV GEMM is issued
//     together with the next tile's first S GEMM, like S_j with PV_{j+1} inside a tile
//     (consume_tile), and each consumer warpgroup then writes the finished output into its own
//     rows of that tile's Q buffer and stores it with TMA (stage_output). Head dim 256 and the
//     wide head dim 128 tile (one Q buffer) run the last PV alone, then stage the output in the
//     last key block's K / V stage (warpgroup 0 in its K tile, 1 in its V tile) and store it with
//     TMA (write_output), and the stage goes back to the producer once the store has read it.
//   * setmaxnreg moves registers from the producer (which needs few) to the consumers.
//   * persistent grid, static schedule: CTA i takes work units i, i + grid, ... A unit is one
//     tile, or under causal masking the pair of m-blocks {last - k, k}, whose costs add up to
//     the same for every k (longest first), so that the static assignment balances. Units are
//     grouped by heads whose K / V fit in L2.
//   * clusters of two CTAs (where both m-blocks of a band start at the same key block: no left
//     window; use_cluster): the pair runs two m-blocks of one head side by side; each CTA loads
//     half of every K / V block into both with TMA multicast, and a stage is free once the
//     consumers of both CTAs released it (exchange_release). Half the K / V traffic from L2 per
//     CTA. Under causal masking the longer tile's last blocks are loaded by its CTA alone, and
//     the other CTA passes those stage uses (produce_tile).
//
// Tiles (kBlockM x kBlockN): head dim 64: 128 x 128, or 192 x 128 (three consumer warpgroups)
// on long sequences; 128: 128 x 128, 192 x 80 (three consumer warpgroups) for most rows of long
// ones, or 128 x 192 on long causal ones; 256: 128 x 80. Two K / V stages (three at head dim 64).
//
// Shared memory tiles are 64-column slabs of 128-byte rows in the 128-byte swizzle that TMA
// writes and wgmma reads (slab c of a tile with R rows starts at c * R * 128 bytes). K-major
// operands (Q, K) step 16 columns by adding 32 bytes to the descriptor start address; the
// MN-major V (the B operand of PV) steps 16 rows by 2048 bytes, with slabs LBO bytes apart.
//
// Semantics are those of docs/architecture.md, minus the bias and mask tensors (refused here,
// served by v2): scale, softcap, top-left causal, sliding window, q / kv sequence lengths, GQA.
// Rows with no kept key get out = 0 and lse = -inf.
#include "v3.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "divmod.h"
#include "hopper.cuh"
#include "v3_fwd_tiles.h"
#include "v3_fwd_units.h"
#ifdef JAX_FLASH_V3_FWD_TIMELINE
#include "timeline.cuh"
#endif

namespace jax_flash {
namespace {

using namespace hopper;

// ------------------------------------------------------------------------------------------
// Tile configuration
// ------------------------------------------------------------------------------------------

template <typename Element_, int kHeadDim_, int kBlockN_, int kConsumerWarpgroups_,
          bool kConditionalRescale_, int kExp2EmulationPeriod_, int kClusterSize_>
struct Config {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  // Head dim 64 (three fit beside three Q buffers; not at head dims 128 / 256): a third stage lets
  // the CTA of a cluster that runs one block ahead of the other (causal, see produce_tile) still
  // find the next block loaded; measured -1.3..-1.6% at T = 1024, +-0.1% elsewhere
  // (docs/perf-notes-v3.md, session 17; without clusters it had measured +-0.3%, session 12).
  static constexpr int kStages = kHeadDim_ == 64 ? 3 : 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  static constexpr bool kConditionalRescale = kConditionalRescale_;
  static constexpr int kExp2EmulationPeriod = kExp2EmulationPeriod_;
  // 2: the two CTAs of a cluster run two m-blocks of one head side by side, and each loads half
  // of every K / V block into both (TMA multicast): half the K / V reads from L2 per CTA.
  static constexpr int kClusterSize = kClusterSize_;
  static constexpr int kKVBoxRows = kBlockN / kClusterSize;  // rows of one K / V load
  // Each consumer warpgroup loads its 64 Q rows into registers once per tile (ldmatrix), and
  // the S GEMM reads A from there instead of shared memory: the Q share of the tensor cores'
  // shared-memory reads (a third of the S GEMM's) goes away. Where the H / 4 registers fit:
  // measured -3.8% at head dim 64 T = 1024, -0..-1.5% elsewhere; the 192-row tile spilled 144
  // bytes with them (docs/perf-notes-v3.md, session 16).
  static constexpr bool kQInRegisters =
      kConsumerWarpgroups == 2 && kHeadDim <= 128 && kBlockN <= 128;
  static constexpr int kQFragments = kQInRegisters ? kHeadDim / 16 : 1;  // 1: unused
  // mbarriers per stage: K and V "full" and "empty", and in a cluster "peer" (exchange_release)
  static constexpr int kStageBarriers = kClusterSize > 1 ? 6 : 4;

  // After setmaxnreg the CTA's launch allocation is split between the producer and consumers.
  static constexpr int kProducerRegisters = kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 240 : 160;
  static_assert(128 * kProducerRegisters + 128 * kConsumerWarpgroups * kConsumerRegisters <=
                kThreads * launch_registers_per_thread(kThreads));

  static constexpr int kSlabs = kHeadDim / 64;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one K or one V stage
  static constexpr int kSmemLimit = 227 * 1024;
  // The layout with q_buffers Q buffers: Q buffers, K stages, V stages, then the mbarriers (a
  // full and an empty one per Q buffer and per K or V stage), + 1024 bytes of base alignment.
  static constexpr int kv_offset(int q_buffers) { return q_buffers * kQBytes; }
  static constexpr int barrier_offset(int q_buffers) {
    return kv_offset(q_buffers) + 2 * kStages * kKVBytes;
  }
  static constexpr int smem_bytes(int q_buffers) {
    return barrier_offset(q_buffers) + 8 * (2 * q_buffers + kStageBarriers * kStages) + 1024;
  }
  // Three Q buffers where they fit (head dims 64 and 128 with 128-key blocks; not 256, not the
  // wide 192-key tile): the next tile's Q loads while this tile runs, and each tile's output is
  // staged in its own Q buffer and stored by TMA (see stage_output); the third lets every tile,
  // one key block long or not, take the previous tile's last PV (release_staged_output). With one
  // buffer, Q waits for the previous tile's last S GEMM and the output is staged in the last
  // K / V stage (kStageOutputInKV).
  static constexpr int kQBuffers = smem_bytes(3) <= kSmemLimit ? 3 : 1;
  static constexpr bool kStageOutput = kQBuffers > 1;
  // One Q buffer: each consumer warpgroup stages its output in the tile's last K / V stage
  // instead (warpgroup 0 in the K tile, 1 in the V tile; write_output), stores it with TMA
  // and starts its next tile; the stage goes back to the producer once the store has read it.
  // From registers, the output stores held the warpgroup 2.2-2.6 us at every tile's end (all
  // CTAs store at once); staged, a tile's fixed cost fell from ~3.9 to ~2.5 us: head dim 256
  // -3.0..-3.6% at T = 1024, -1.6..-2.9% at 4096, -0.3% at 16384 (docs/perf-notes.md, session 35).
  static constexpr bool kStageOutputInKV = !kStageOutput;
  static constexpr int kKOffset = kv_offset(kQBuffers);
  static constexpr int kVOffset = kKOffset + kStages * kKVBytes;
  static constexpr int kBarrierOffset = barrier_offset(kQBuffers);
  static constexpr int kSmemBytes = smem_bytes(kQBuffers);
  static_assert(kSmemBytes <= kSmemLimit, "tile does not fit in shared memory");
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0 && kBlockN <= 256);
  static_assert(kClusterSize == 1 || kClusterSize == 2);
  static_assert(!kStageOutputInKV || (kConsumerWarpgroups == 2 && 64 * kHeadDim * 2 <= kKVBytes),
                "a warpgroup's output must fit in a K or V stage, one per warpgroup");
};

// The mbarriers, in order, at kBarrierOffset: one per Q buffer / K or V stage, 8 bytes apart.
// In a cluster, then a K and a V "peer" barrier per stage.
struct BarrierAddresses {
  uint32_t q_full, q_empty, k_full, k_empty, v_full, v_empty;  // of buffer / stage 0
  uint32_t k_peer, v_peer;
  template <class Cfg>
  __device__ static BarrierAddresses at(uint32_t base) {
    constexpr int s = Cfg::kStages, q = Cfg::kQBuffers;
    const uint32_t kv = base + 16 * q;
    return {base, base + 8 * q, kv, kv + 8 * s, kv + 16 * s, kv + 24 * s, kv + 32 * s,
            kv + 40 * s};
  }
};

// Everything the kernel reads besides shared memory. Passed as a __grid_constant__ parameter,
// so the tensor maps stay in parameter space where TMA can read them.
struct Params {
  CUtensorMap tma_q, tma_k, tma_v;
  CUtensorMap tma_o;  // boxes of 64 rows (one consumer warpgroup)
  void* out;
  float* lse;
  const int32_t* q_seqlens;   // may be null: all T rows valid
  const int32_t* kv_seqlens;  // may be null: all S keys valid
  int q_len, kv_len, num_heads;
  // Rows per batch element of q / out / lse: q_len, or more where this launch runs a range of
  // each sequence's rows (QueryRows). q, out and lse then start at the range's first row, row
  // q_row_begin of each sequence, from which a tile counts its q_seqlens.
  int batch_rows;
  int q_row_begin;
  float scale_log2;   // exponent scale (log2 units) applied to the possibly capped score
  float softcap;      // 0 = off
  float softcap_inv;  // scale / softcap
  int window_left;    // -1 = unbounded
  int window_right;   // causal folded in; -1 = unbounded
  int num_m_blocks;
  bool pair_m_blocks;  // a work unit is two m-blocks (see decode_tile)
  int num_units;
  // The divisors of each tile's decode (decode_tile, produce_tile), prepared on the host
  // (cuda/divmod.h): dividing by a runtime int costs an I2F / MUFU.RCP / F2I sequence each time.
  UnitGroups groups;            // a unit's order and (batch, head) pair (cuda/v3_fwd_units.h)
  DivMod div_num_heads;         // splits a (batch, head) pair index
  DivMod div_heads_per_kv;      // query heads per kv head: a tile's kv head
#ifdef JAX_FLASH_V3_FWD_TIMELINE
  uint64_t* timeline;  // v3_fwd_timeline records (cuda/v3.h); null: none
#endif
};

// ------------------------------------------------------------------------------------------
// Timeline instrumentation (-DJAX_FLASH_V3_FWD_TIMELINE only; layout in cuda/v3.h)
// ------------------------------------------------------------------------------------------
// TIMELINE_START(p, record) points the CTA at its records (one thread, before a __syncthreads);
// TIMELINE_EVENT(event, record) stamps an event of the CTA; TIMELINE_TILE_EVENT(tile, e,
// record) stamps event e of the CTA's tile number `tile` (non-empty tiles in the order the CTA
// runs them: the producer's and each consumer's q_count); TIMELINE_CONSUMER_EVENT(c, tile, e)
// stamps consumer event e of ConsumerState c's warpgroup, TIMELINE_BLOCK_EVENT(c, tile, block, e)
// its event e of steady block `block` (TIMELINE_SOFTMAX_EVENT: the two that change the schedule,
// cuda/v3.h); TIMELINE_TILE_SHAPE(tile, t) and
// TIMELINE_CTA_INFO(tiles, record) store value records. Without the macro they expand to
// nothing, so the default build's code is unchanged. Every event of a non-empty tile is stamped
// once per tile, so that a slot's record, overwritten by later tiles, ends up all of one tile.

#ifdef JAX_FLASH_V3_FWD_TIMELINE
namespace tl = v3_fwd_timeline;

#define TIMELINE_START(p, record)                                   \
  do {                                                              \
    if (record) timeline::set_cta_records(p.timeline, tl::kEvents); \
  } while (0)
#define TIMELINE_EVENT(event, record) timeline::stamp(event, record)
#define TIMELINE_TILE_EVENT(tile, e, record) \
  timeline::stamp(tl::tile_event(tile, tl::e), record)
#define TIMELINE_CONSUMER_EVENT(c, tile, e) \
  timeline::stamp(tl::consumer_tile_event(tile, (c).warpgroup, tl::e), (c).leader)
#define TIMELINE_BLOCK_EVENT(c, tile, block, e)                                               \
  timeline::stamp(tl::consumer_block_event(tile, (c).warpgroup, min(block, tl::kLoggedBlocks - 1), \
                                           tl::e),                                            \
                  (c).leader && (block) < tl::kLoggedBlocks)
#ifdef JAX_FLASH_V3_FWD_TIMELINE_SOFTMAX
#define TIMELINE_SOFTMAX_EVENT(c, tile, block, e) TIMELINE_BLOCK_EVENT(c, tile, block, e)
#else
#define TIMELINE_SOFTMAX_EVENT(c, tile, block, e)
#endif
#define TIMELINE_TILE_SHAPE(tile, t)                                                          \
  timeline::store_values(tl::tile_event(tile, tl::kTileShape), (t).m_block, (t).n_max - (t).n_min, \
                         true)
#define TIMELINE_CTA_INFO(tiles, record) timeline::store_cta_info(tl::kCtaInfo, tiles, record)
#else
#define TIMELINE_START(p, record)
#define TIMELINE_EVENT(event, record)
#define TIMELINE_TILE_EVENT(tile, e, record)
#define TIMELINE_CONSUMER_EVENT(c, tile, e)
#define TIMELINE_BLOCK_EVENT(c, tile, block, e)
#define TIMELINE_SOFTMAX_EVENT(c, tile, block, e)
#define TIMELINE_TILE_SHAPE(tile, t)
#define TIMELINE_CTA_INFO(tiles, record)
#endif

// 2^x on the FMA pipe: x = j + f with j = round(x), |f| <= 1/2; 2^f by a degree-3 polynomial
// (relative error 1.0e-4, below bf16 / fp16 rounding of P); j added to the exponent bits. The
// clamp keeps the exponent field positive; a masked (-inf) element becomes ~2^-125, which
// changes no sum visibly (rows with no kept key are recognised by their -inf max instead).
__device__ __forceinline__ float exp2_fma(float x) {
  x = fmaxf(x, -125.f);
  const float shifted = x + 12582912.f;  // 1.5 * 2^23: the integer part lands in the low bits
  const float f = x - (shifted - 12582912.f);
  float p = fmaf(0.05500893f, f, 0.242211f);
  p = fmaf(p, f, 0.6932829f);
  p = fmaf(p, f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
}

// ------------------------------------------------------------------------------------------
// The GEMMs of one consumer warpgroup (wrappers and descriptors: hopper.cuh)
// ------------------------------------------------------------------------------------------

// s = Q_w K^T for this warpgroup's 64 rows: Q from the registers qa (kQInRegisters), else from
// shared memory at q_rows (row 0 of the warpgroup in slab 0).
template <class Cfg>
__device__ __forceinline__ void issue_qk(uint32_t q_rows,
                                         const uint32_t (&qa)[Cfg::kQFragments][4],
                                         uint32_t k_tile, float (&s)[Cfg::kBlockN / 2]) {
  if constexpr (Cfg::kQInRegisters) {
    using Op = typename Gmma<typename Cfg::Element, Cfg::kBlockN>::RSK;
    gemm_rs_kmajor<Op, Cfg::kQFragments, Cfg::kBlockN * 128>(qa, GmmaDescriptor::kmajor(k_tile),
                                                              s);
  } else {
    using Op = typename Gmma<typename Cfg::Element, Cfg::kBlockN>::template SS<>;
    gemm_ss_kmajor<Op, Cfg::kHeadDim, Cfg::kBlockM * 128, Cfg::kBlockN * 128>(
        GmmaDescriptor::kmajor(q_rows), GmmaDescriptor::kmajor(k_tile), s);
  }
}

// o += P V with P in registers (the A fragments of 16-column steps) and V MN-major.
template <class Cfg>
__device__ __forceinline__ void issue_pv(const uint32_t (&p)[Cfg::kBlockN / 16][4],
                                         uint32_t v_tile, float (&o)[Cfg::kHeadDim / 2]) {
  using Op = typename Gmma<typename Cfg::Element, Cfg::kHeadDim>::RS;
  gemm_rs_mnmajor<Op>(p, v_tile, Cfg::kBlockN * 128, o);
}

// ------------------------------------------------------------------------------------------
// Tiles: which (batch, head, m-block)s a work unit holds, and which key blocks each visits
// ------------------------------------------------------------------------------------------

struct Tile {
  int batch, head, m_block;
  int q_rows;   // valid query rows of this batch (q_seqlens)
  int kv_cols;  // valid keys of this batch (kv_seqlens)
  int n_min, n_max;  // key blocks [n_min, n_max) hold every kept key of the tile's rows
  int n_peer;   // in a cluster, the other CTA's n_max (its tile shares n_min); alone, n_max
  __device__ bool empty() const { return n_max <= n_min; }
  // Key blocks both CTAs of a cluster step through, this one's and the other's: the ring's
  // stages must hold the same block in both for the shared loads.
  __device__ int n_lead() const { return max(n_max, n_peer); }
};

// Work units: CTA i runs units i, i + grid, ... A unit is one tile or, when the cost of a tile
// grows with its m-block (causal without a left window), the pair of m-blocks {last - k, k},
// so that every unit costs the same and the static assignment balances. Units come in groups
// of (batch, head) pairs whose K / V fit in L2 (UnitGroups); inside a group the longest m-blocks
// come first, heads innermost. In clusters of two, units 2i and 2i + 1 are m-blocks 2j and
// 2j + 1 of one head: the grid is even, so the cluster's CTAs (ranks 0 and 1) run them side by
// side, and the groups count units in twos. With pairs too, the cluster's second tiles are
// m-blocks 2k and 2k + 1, the higher one (the longer) on the other rank than in the first tiles,
// so that each CTA runs about half of the blocks only one of the pair visits (see produce_tile).
// Returns false when the unit has no `second` tile.
template <class Cfg>
__device__ bool decode_tile(const Params& p, int unit, bool second, Tile& t) {
  // Tested before the unit's decode, a chain of dependent multiply-shifts that every tile
  // boundary would otherwise run twice without pairs.
  if (second && !p.pair_m_blocks) return false;
  constexpr int kCluster = Cfg::kClusterSize;
  int bh;
  const int order = p.groups.order_of(unit / kCluster, &bh);
  // Bands: kCluster adjacent m-blocks, which a cluster runs side by side. The first tile's band
  // counts down from the last, the second's (with pairs) up from the first.
  const int first_band = p.num_m_blocks / kCluster - 1 - order;
  if (second && order >= first_band) return false;
  const int rank = unit % kCluster;

  t.batch = p.div_num_heads.divmod(bh, t.head);
  t.m_block = second ? kCluster * order + kCluster - 1 - rank : kCluster * first_band + rank;
  t.q_rows = p.q_seqlens ? max(0, min(p.q_seqlens[t.batch] - p.q_row_begin, p.q_len)) : p.q_len;
  t.kv_cols = p.kv_seqlens ? max(0, min(p.kv_seqlens[t.batch], p.kv_len)) : p.kv_len;

  // The last key block of m-block m's rows (empty rows past q_rows: up to the batch's last row).
  const auto key_end = [&](int m) {
    const int row_hi = min((m + 1) * Cfg::kBlockM, t.q_rows) - 1;
    int col_hi = t.kv_cols - 1;
    if (p.window_right >= 0) col_hi = min(col_hi, row_hi + p.window_right);
    return col_hi;
  };
  const int col_hi = key_end(t.m_block);
  const int col_lo = p.window_left >= 0 ? max(0, t.m_block * Cfg::kBlockM - p.window_left) : 0;
  // The two tiles of a cluster's pair run both or neither, as their CTAs share K / V loads: a
  // tile past its batch's rows (q_seqlens) runs with all rows masked, which writes what an
  // empty tile writes (out 0, lse -inf), while the other tile has rows. Both start at key 0:
  // use_cluster takes no left window.
  const int pair_row_lo = t.m_block / kCluster * kCluster * Cfg::kBlockM;
  const bool no_rows = min(pair_row_lo + kCluster * Cfg::kBlockM, t.q_rows) <= pair_row_lo;
  if (no_rows || col_hi < col_lo) {
    t.n_min = t.n_max = t.n_peer = 0;
  } else {
    t.n_min = col_lo / Cfg::kBlockN;
    t.n_max = col_hi / Cfg::kBlockN + 1;
    t.n_peer = kCluster > 1 ? max(key_end(t.m_block ^ 1), col_lo) / Cfg::kBlockN + 1 : t.n_max;
  }
  return true;
}

// ------------------------------------------------------------------------------------------
// Producer: one thread streams Q, then K_j and V_j for j from the last key block down
// ------------------------------------------------------------------------------------------

// The shared addresses of K / V stage `stage` (the producer's load targets, the consumers' GEMM
// operands).
template <class Cfg>
__device__ __forceinline__ uint32_t k_tile(uint32_t smem, int stage) {
  return smem + Cfg::kKOffset + stage * Cfg::kKVBytes;
}
template <class Cfg>
__device__ __forceinline__ uint32_t v_tile(uint32_t smem, int stage) {
  return smem + Cfg::kVOffset + stage * Cfg::kKVBytes;
}

// The mbarrier phase parity of a K / V stage's use `slot` (uses counted over tiles): the "peer"
// barriers' in a cluster, and alone the "full" and "empty" ones' too (StagePhases).
template <class Cfg>
__device__ __forceinline__ uint32_t block_phase(int slot) {
  return uint32_t(slot / Cfg::kStages) & 1;
}

// The phase parities of the K / V stages' "full" and "empty" barriers, by stage use (`slot`,
// counted over tiles). Alone every use holds a block: block_phase. In a cluster a use this CTA
// passes (a block only the other CTA's tile visits, produce_tile) touches neither barrier, so
// each stage keeps the parity of its next block in a bit. (A passed use that completed both
// phases instead would let a consumer that skips it find the stage's next phase "done" before
// the producer passed the use: its wait for the parity after next passes at once.)
template <class Cfg>
struct StagePhases {
  uint32_t next_bits = 0;  // in a cluster, bit s: the parity of stage s's next block
  // The parity of the block about to take use `slot`, and of the one that took it (whose K was
  // waited for; no later use of that stage taken since).
  __device__ uint32_t next(int slot) const {
    if constexpr (Cfg::kClusterSize > 1) return (next_bits >> (slot % Cfg::kStages)) & 1;
    return block_phase<Cfg>(slot);
  }
  __device__ uint32_t taken(int slot) const {
    if constexpr (Cfg::kClusterSize > 1) return next(slot) ^ 1;
    return block_phase<Cfg>(slot);
  }
  // A block took use `slot`.
  __device__ void advance(int slot) {
    if constexpr (Cfg::kClusterSize > 1) next_bits ^= 1u << (slot % Cfg::kStages);
  }
};

// Key block nb of K or V into `dst`, signalling `bar`. In a cluster of two, this CTA loads its
// half of the block's rows into both CTAs, whose `bar` each expect the whole block; a block only
// this CTA's tile visits (`alone`) it loads whole into its own shared memory.
template <class Cfg>
__device__ __forceinline__ void load_kv(const CUtensorMap* map, uint32_t dst, uint32_t bar,
                                        int nb, int kv_head, int batch, bool alone) {
  if constexpr (Cfg::kClusterSize == 1) {
    tma_load_tile<Cfg::kSlabs, Cfg::kBlockN>(map, dst, bar, nb * Cfg::kBlockN, kv_head, batch);
  } else {
    constexpr int kRows = Cfg::kKVBoxRows;
    const int rank = int(cluster_cta_rank());
    const auto load_half = [&](int half, uint16_t ctas) {
      tma_load_tile_multicast<Cfg::kSlabs, Cfg::kBlockN, kRows>(
          map, dst + half * kRows * 128, bar, nb * Cfg::kBlockN + half * kRows, kv_head, batch,
          ctas);
    };
    if (alone) {
      for (int half = 0; half < Cfg::kClusterSize; ++half) load_half(half, uint16_t(1 << rank));
    } else {
      load_half(rank, uint16_t((1 << Cfg::kClusterSize) - 1));
    }
  }
}

// In a cluster a stage is free once the consumers of both CTAs released it, since the next
// block lands in both. Each CTA's consumers release it in their own CTA's "empty" barrier as
// without clusters; once that phase completed, the producer tells the other CTA's producer (a
// remote arrival on its "peer" barrier) and waits for the same word from it. One arrival per
// stage use each way, so the peer barrier's phase parity is the use's: `phase`. (Measured
// against each consumer warp arriving in both CTAs: as fast or faster, by up to 1.4%, and
// the consumers' code and registers stay as without clusters; docs/perf-notes-v3.md.)
template <class Cfg>
__device__ __forceinline__ void exchange_release(uint32_t peer_bar, uint32_t phase) {
  if constexpr (Cfg::kClusterSize > 1) {
    mbarrier_arrive_cluster(peer_bar, cluster_cta_rank() ^ 1);
    mbarrier_wait(peer_bar, phase);
  }
}

// Waits until a K or V stage (its "empty" and "peer" barriers) is free for use `slot`: its last
// block read by this CTA's consumers, and in a cluster by the other CTA's too
// (exchange_release, one exchange per use).
template <class Cfg>
__device__ __forceinline__ void acquire_stage(uint32_t empty_bar, uint32_t peer_bar, int slot,
                                              const StagePhases<Cfg>& phases) {
  mbarrier_wait(empty_bar, phases.next(slot) ^ 1);
  exchange_release<Cfg>(peer_bar, block_phase<Cfg>(slot));
}

// Streams one tile's Q and its K_j, V_j (j from the last key block down). q_count: non-empty
// tiles so far, which selects the Q buffer and its phase.
template <class Cfg>
__device__ __forceinline__ void produce_tile(const Params& p, const Tile& t, uint32_t smem,
                                             const BarrierAddresses& bars, int& block_count,
                                             StagePhases<Cfg>& phases, int& q_count) {
  const int kv_head = p.div_heads_per_kv.divide(t.head);
  const int q_buffer = q_count % Cfg::kQBuffers;
  const uint32_t q_phase = (q_count / Cfg::kQBuffers) & 1;
  ++q_count;
  TIMELINE_TILE_SHAPE(q_count - 1, t);
  const auto load_q = [&] {
    mbarrier_wait(bars.q_empty + 8 * q_buffer, q_phase ^ 1);
    mbarrier_arrive_expect_tx(bars.q_full + 8 * q_buffer, Cfg::kQBytes);
    tma_load_tile<Cfg::kSlabs, Cfg::kBlockM>(&p.tma_q, smem + q_buffer * Cfg::kQBytes,
                                             bars.q_full + 8 * q_buffer,
                                             t.m_block * Cfg::kBlockM, t.head, t.batch);
    TIMELINE_TILE_EVENT(q_count - 1, kQIssued, true);
  };
  // Two buffers: this one was released early in the previous tile, so Q goes ahead of the
  // ring (it is then in flight for about two key blocks before the tile starts).
  if constexpr (Cfg::kQBuffers > 1) load_q();
  // In a cluster the stage uses follow the pair's key blocks (Tile::n_lead): a block only the
  // other CTA's tile visits takes a use here too, passed with the exchange alone (no load, no
  // arrival on this CTA's barriers: StagePhases), which the consumers skip (consume_tile). A
  // passed use does not wait for its stage to be released here: it writes nothing, and the
  // stage may hold the pending tile's last V, which the consumers release only after the next
  // tile's first block, behind this use, is in (tests/gpu/v3_fwd_protocol_model.py).
  constexpr bool kCluster = Cfg::kClusterSize > 1;
  for (int nb = (kCluster ? t.n_lead() : t.n_max) - 1; nb >= t.n_min; --nb, ++block_count) {
    const int stage = block_count % Cfg::kStages;
    const bool alone = kCluster && nb >= t.n_peer;
    if (kCluster && nb >= t.n_max) {
      exchange_release<Cfg>(bars.k_peer + 8 * stage, block_phase<Cfg>(block_count));
      exchange_release<Cfg>(bars.v_peer + 8 * stage, block_phase<Cfg>(block_count));
      continue;
    }

    acquire_stage<Cfg>(bars.k_empty + 8 * stage, bars.k_peer + 8 * stage, block_count, phases);
    mbarrier_arrive_expect_tx(bars.k_full + 8 * stage, Cfg::kKVBytes);
    load_kv<Cfg>(&p.tma_k, k_tile<Cfg>(smem, stage), bars.k_full + 8 * stage, nb, kv_head,
                 t.batch, alone);
    // One buffer: Q waits until every consumer warp released the last tile's, so the first K
    // goes ahead of it.
    if constexpr (Cfg::kQBuffers == 1) {
      if (nb == t.n_max - 1) load_q();
    }
    acquire_stage<Cfg>(bars.v_empty + 8 * stage, bars.v_peer + 8 * stage, block_count, phases);
    mbarrier_arrive_expect_tx(bars.v_full + 8 * stage, Cfg::kKVBytes);
    load_kv<Cfg>(&p.tma_v, v_tile<Cfg>(smem, stage), bars.v_full + 8 * stage, nb, kv_head,
                 t.batch, alone);
    phases.advance(block_count);
    TIMELINE_TILE_EVENT(q_count - 1, kFirstKvIssued, nb == t.n_max - 1);
    TIMELINE_TILE_EVENT(q_count - 1, kLastKvIssued, nb == t.n_min);
  }
}

template <class Cfg>
__device__ void run_producer(const Params& p, uint32_t smem, BarrierAddresses bars) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_q)));
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_k)));
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_v)));
  // for the consumers' output stores
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.tma_o)));
  int block_count = 0;  // stage uses so far, over all tiles: selects stage and phase
  StagePhases<Cfg> phases;
  int q_count = 0;
  for (int unit = blockIdx.x; unit < p.num_units; unit += gridDim.x) {
    for (int second = 0; second < 2; ++second) {
      Tile t;
      if (!decode_tile<Cfg>(p, unit, second, t)) break;
      if (!t.empty()) produce_tile<Cfg>(p, t, smem, bars, block_count, phases, q_count);
    }
  }
  // In a cluster, this CTA exits only once every stage is free in both CTAs: the consumers of
  // both have then read every block, so each half this CTA multicast into the other CTA has
  // landed (nothing else waits for those copies here before the exit).
  if constexpr (Cfg::kClusterSize > 1) {
    for (int use = 0; use < Cfg::kStages; ++use, ++block_count) {
      const int stage = block_count % Cfg::kStages;
      acquire_stage<Cfg>(bars.k_empty + 8 * stage, bars.k_peer + 8 * stage, block_count, phases);
      acquire_stage<Cfg>(bars.v_empty + 8 * stage, bars.v_peer + 8 * stage, block_count, phases);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Consumer: scores, online softmax, output
// ------------------------------------------------------------------------------------------

// softcap, then -inf outside the kept set. `row` / `col`: absolute position of element 0.
template <class Cfg>
__device__ __forceinline__ void shape_scores(float (&s)[Cfg::kBlockN / 2], const Params& p,
                                             const Tile& t, int row, int col, bool masked) {
  if (p.softcap > 0.f) {
#pragma unroll
    for (int i = 0; i < Cfg::kBlockN / 2; ++i) s[i] = p.softcap * tanh_mufu(s[i] * p.softcap_inv);
  }
  if (!masked) return;
  // Each row keeps one interval of columns [lo, hi] (empty past the valid query rows), here
  // relative to `col`, so that every element compares its compile-time offset (no per-column
  // add).
  int lo[2], hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row + 8 * r;
    int last = t.kv_cols - 1;
    if (p.window_right >= 0) last = min(last, q + p.window_right);
    if (q >= t.q_rows) last = -1;
    hi[r] = last - col;
    lo[r] = (p.window_left >= 0 ? max(0, q - p.window_left) : 0) - col;
  }
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / 2; ++i) {
    const int r = (i / 2) % 2;
    const int offset = 8 * (i / 4) + i % 2;
    s[i] = (offset >= lo[r]) & (offset <= hi[r]) ? s[i] : -INFINITY;
  }
}

// Whether any element of this warpgroup's 64 rows x key block nb may be outside the kept set.
template <class Cfg>
__device__ __forceinline__ bool block_needs_mask(const Params& p, const Tile& t, int row_lo,
                                                 int nb) {
  const int row_hi = row_lo + 63;
  const int col_lo = nb * Cfg::kBlockN, col_hi = col_lo + Cfg::kBlockN - 1;
  return col_hi >= t.kv_cols || row_hi >= t.q_rows ||
         (p.window_right >= 0 && col_hi > row_lo + p.window_right) ||
         (p.window_left >= 0 && col_lo < row_hi - p.window_left);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Running statistics of this thread's two rows: max of the raw (capped) scores and the sum
// of exp2((s - max) * scale_log2) over this thread's columns (the quad sums them at the end).
struct RowStats {
  float max[2];
  float sum[2];
};

// exp2((score - max) * scale_log2) for accumulator element i (given max * scale_log2): on the
// FMA pipe in every kExp2EmulationPeriod-th 8-column chunk (the thread's elements 4c..4c+3),
// else on the MUFU.
template <class Cfg>
__device__ __forceinline__ float probability(int i, float score, float scale_log2,
                                             float max_scaled) {
  const float x = fmaf(score, scale_log2, -max_scaled);
  constexpr int period = Cfg::kExp2EmulationPeriod;
  const bool on_fma = period > 0 && (i / 4) % (period > 0 ? period : 1) == period - 1;
  return on_fma ? exp2_fma(x) : exp2_mufu(x);
}

// Turns the scores of one key block into unnormalized probabilities in place and updates the
// row statistics. Returns in o_scale the factor the accumulated O (and sum) must be multiplied
// by: exp2 of the max's change, or exactly 1 when the max is kept.
template <class Cfg, bool kFirstBlock>
__device__ __forceinline__ void online_softmax(float (&s)[Cfg::kBlockN / 2], RowStats& st,
                                               float scale_log2, float (&o_scale)[2]) {
  float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / 2; ++i) {
    block_max[(i / 2) % 2] = fmaxf(block_max[(i / 2) % 2], s[i]);
  }
  float max_scaled[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    block_max[r] = quad_max(block_max[r]);
    float new_max;
    if (kFirstBlock) {
      new_max = block_max[r];
    } else {
      new_max = fmaxf(st.max[r], block_max[r]);
    }
    o_scale[r] = (kFirstBlock || new_max == -INFINITY)
                     ? 1.f
                     : exp2_mufu((st.max[r] - new_max) * scale_log2);
    st.max[r] = new_max;
    // A row with nothing kept yet exponentiates -inf - 0 = -inf: probabilities 0, not NaN.
    max_scaled[r] = new_max == -INFINITY ? 0.f : new_max * scale_log2;
  }
  float block_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < Cfg::kBlockN / 2; ++i) {
    const int r = (i / 2) % 2;
    s[i] = probability<Cfg>(i, s[i], scale_log2, max_scaled[r]);
    block_sum[r] += s[i];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.sum[r] = kFirstBlock ? block_sum[r] : fmaf(st.sum[r], o_scale[r], block_sum[r]);
  }
}

// Conditional rescaling (kConditionalRescale): the softmax of a steady key block at the row's
// running max, without this block's max. The max's FMNMX chain, its shuffles, the rescale
// factors and the O rescale are online_softmax's work on every block, and the loop's pace
// follows the softmax's instruction count (docs/perf-notes-v3.md, session 20). Here
// P = exp2((s - max) * scale_log2) goes straight into the PV GEMM's fragments pa and the
// block's sums into st.sum; s is left as it was. That is valid while every P stays below
// kProbabilitySumBound (softmax_constants.h); each thread's partial sum of a row bounds its
// elements, so the check needs no quad shuffle. Returns false, warp-uniformly and with only pa
// changed, when a partial sum reaches the bound, is NaN, or a row has no running max yet (-inf:
// its P are inf or NaN); the caller then runs online_softmax on s, which moves the max to the
// block's, so that the next blocks pass again. The max is only a reference point that keeps P in
// range: both paths compute the same function. Rows past the tile's valid rows (row, row + 8
// against q_rows), masked in every block, take the reference +inf: P = 0, as online_softmax
// gives them, without falling back on every block of the warp.
template <class Cfg>
__device__ __forceinline__ bool softmax_at_running_max(const float (&s)[Cfg::kBlockN / 2],
                                                       RowStats& st, float scale_log2, int row,
                                                       int q_rows,
                                                       uint32_t (&pa)[Cfg::kBlockN / 16][4]) {
  float max_scaled[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    max_scaled[r] = row + 8 * r < q_rows ? st.max[r] * scale_log2 : INFINITY;
  }
  float block_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 8 * kk + 2 * j, r = j % 2;  // the pair's elements i, i + 1: row r
      const float lo = probability<Cfg>(i, s[i], scale_log2, max_scaled[r]);
      const float hi = probability<Cfg>(i + 1, s[i + 1], scale_log2, max_scaled[r]);
      block_sum[r] += lo;
      block_sum[r] += hi;
      pa[kk][j] = pack2<typename Cfg::Element>(lo, hi);
    }
  }
  if (!__all_sync(0xffffffff, block_sum[0] < kProbabilitySumBound &&
                                  block_sum[1] < kProbabilitySumBound)) {
    return false;
  }
  st.sum[0] += block_sum[0];
  st.sum[1] += block_sum[1];
  return true;
}

template <class Cfg>
__device__ __forceinline__ void rescale_output(float (&o)[Cfg::kHeadDim / 2],
                                               const float (&o_scale)[2]) {
#pragma unroll
  for (int i = 0; i < Cfg::kHeadDim / 2; ++i) o[i] *= o_scale[(i / 2) % 2];
}

// What the output of a tile whose row statistics are final needs besides O (its lse is already
// written, so the statistics need not stay in registers while the last PV runs).
struct FinishedTile {
  int row_lo;         // this warpgroup's first row
  int head, batch;
  int q_buffer;       // the tile's Q buffer (stage_output writes the output there)
  float inv_sum[2];   // 1 / row sum of this thread's two rows (0: no kept key)
};

// 1 / x for a row sum of a row with a kept key: the MUFU reciprocal and one Newton step, the
// fast path of `1.f / x` (rcp.rn), bit for bit. The sum is about 1 or more (the element at the
// row max contributes exp2(0), more against a stale max) and below 2^40, far inside the range
// where that path is exact; `1.f / x` also tests the exponent and branches to a subroutine for
// extreme operands, which kept ptxas from overlapping the two rows' finishes.
__device__ __forceinline__ float reciprocal_of_sum(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return fmaf(r, fmaf(-x, r, 1.f), r);
}

// Writes the lse of this thread's two rows (rows < q_len, by the lane that holds column 0 of
// the row) and returns what the output needs. row_lo: the warpgroup's first row. Branch-free, so
// that the two rows' shuffles, reciprocals and logs overlap: this runs between a tile's last
// softmax and the next tile's first GEMM turn.
template <class Cfg>
__device__ __forceinline__ FinishedTile finish_tile(const Params& p, const Tile& t, int row_lo,
                                                    const Lane& lane, const RowStats& st,
                                                    int q_buffer) {
  FinishedTile f = {row_lo, t.head, t.batch, q_buffer, {}};
  float* const lse_rows = p.lse + (int64_t(t.batch) * p.num_heads + t.head) * p.batch_rows;
  float sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) sum[r] = quad_sum(st.sum[r]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row_lo + lane.row0 + 8 * r;
    const bool none_kept = st.max[r] == -INFINITY;
    f.inv_sum[r] = none_kept ? 0.f : reciprocal_of_sum(sum[r]);
    if (lane.col0 == 0 && q < p.q_len) {
      lse_rows[q] = none_kept ? -INFINITY : (st.max[r] * p.scale_log2 + log2_mufu(sum[r])) * kLn2;
    }
  }
  return f;
}

// out = 0 for the 64 rows of this warpgroup from row_lo on (rows past q_len are not stored):
// the output of an empty tile, which loads no Q and stages nothing. Zeros need no layout:
// consecutive threads store consecutive 16-byte chunks of a row.
template <class Cfg>
__device__ __forceinline__ void store_zero_output(const Params& p, const Tile& t, int row_lo) {
  using Element = typename Cfg::Element;
  constexpr int kRowChunks = Cfg::kHeadDim * int(sizeof(Element)) / 16;
  for (int i = threadIdx.x % 128; i < 64 * kRowChunks; i += 128) {
    const int q = row_lo + i / kRowChunks;
    if (q >= p.q_len) break;  // i grows with the row
    Element* out_row = static_cast<Element*>(p.out) +
                       ((int64_t(t.batch) * p.batch_rows + q) * p.num_heads + t.head) *
                           Cfg::kHeadDim;
    reinterpret_cast<uint4*>(out_row)[i % kRowChunks] = make_uint4(0, 0, 0, 0);
  }
}

// Named barrier ids 1..W: barrier w lets consumer warpgroup w issue its GEMMs next. Ids
// W+1..2W: consumer warpgroup w's 128 threads before its output store (stage_output). Ids
// 2W+1..2W+2 (kStageOutputInKV): the other warpgroup no longer reads the K / V tile that
// warpgroup w stages its output in (write_output).
__device__ __forceinline__ int scheduler_barrier(int warpgroup) { return 1 + warpgroup; }
template <class Cfg>
__device__ __forceinline__ int output_barrier(int warpgroup) {
  return 1 + Cfg::kConsumerWarpgroups + warpgroup;
}
template <class Cfg>
__device__ __forceinline__ int staging_tile_barrier(int warpgroup) {
  return 1 + 2 * Cfg::kConsumerWarpgroups + warpgroup;
}

// What one consumer warpgroup keeps across tiles: its place in the CTA and in the pipelines.
struct ConsumerState {
  int warpgroup;
  bool warp_leader;  // arrives on "empty" barriers for its warp
  bool leader;       // thread 0 of the warpgroup: issues and waits for its output stores
  Lane lane;
  int my_barrier, next_barrier;  // pingpong: wait for my turn, then pass it on
  uint32_t q_rows;  // shared address of this warpgroup's first Q row (slab 0) in Q buffer 0
  int block_count;  // stage uses so far (key blocks; in a cluster passed ones too): the stage
  int q_count;      // non-empty tiles started so far: selects Q buffer and phase
  // The buffer an output store reads, not yet handed back (-1: none): a Q buffer
  // (kStageOutput) or the K / V stage whose K (warpgroup 0) or V tile it is (kStageOutputInKV).
  int unreleased;
};

// A tile whose key blocks are done but whose last PV is not issued yet (see consume_tile): its
// P is in the fragments, its partial O in the accumulator.
struct PendingTile {
  FinishedTile f;
  bool valid;
};

// The output of this warpgroup's 64 rows goes to shared memory at `rows` (64-column slabs
// slab_bytes apart, in the layout TMA loads Q in), then one thread stores it with TMA, so that
// the warpgroup can start its next tile while the store runs. The buffer is released to the
// producer once the store has read it (release_staged_output, during the warpgroup's next
// GEMMs). Where: its rows of the tile's Q buffer, which no S GEMM of this warpgroup reads any
// more (kStageOutput: this needs more than one Q buffer), or a K / V tile (write_output).
// `tile`: the CTA's tile number, only for the timeline's stamps.
template <class Cfg>
__device__ __forceinline__ void stage_output(const Params& p, const FinishedTile& f,
                                             const ConsumerState& c,
                                             const float (&o)[Cfg::kHeadDim / 2],
                                             uint32_t rows, uint32_t slab_bytes, int tile) {
  using Element = typename Cfg::Element;
  constexpr int kSteps = Cfg::kHeadDim / 16;
  // O / row sum as A fragments (register j: the row + 8 (j % 2), whose 1 / sum it takes), one
  // stmatrix per 16 columns instead of a 4-byte store per 2 columns and row.
  uint32_t a[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a[kk][j] = pack2<Element>(o[8 * kk + 2 * j] * f.inv_sum[j % 2],
                                o[8 * kk + 2 * j + 1] * f.inv_sum[j % 2]);
    }
  }
  store_fragments_swizzled(rows, slab_bytes, c.lane.row0 & ~15, 0, threadIdx.x % 32, a);
  fence_proxy_async_shared();
  TIMELINE_CONSUMER_EVENT(c, tile, kStaged);
  named_barrier_sync(output_barrier<Cfg>(c.warpgroup), 128);
  if (c.leader) {
#pragma unroll
    for (int slab = 0; slab < Cfg::kSlabs; ++slab) {
      tma_store_box(&p.tma_o, rows + slab * slab_bytes, slab * 64, f.row_lo, f.head, f.batch);
    }
    bulk_commit();
  }
}

// Issues this warpgroup's GEMMs in its pingpong turn: wait for it, issue, pass it on.
template <class IssueGemms>
__device__ __forceinline__ void issue_in_turn(const ConsumerState& c, IssueGemms&& issue) {
  named_barrier_sync(c.my_barrier, 256);
  wgmma_fence();
  issue();
  named_barrier_arrive(c.next_barrier, 256);
}

// S of key block nb (K in `stage`) has landed: free the K stage (and Q after the tile's last
// block), then softcap and mask the scores. The tile's last K tile, where warpgroup 0 stages its
// output (kStageOutputInKV), is freed by that store instead, once warpgroup 1 is done with it.
template <class Cfg>
__device__ __forceinline__ void take_scores(const Params& p, const Tile& t,
                                            const BarrierAddresses& bars,
                                            const ConsumerState& c, int stage, int nb,
                                            int row_lo, float (&s)[Cfg::kBlockN / 2]) {
  fence_registers(s);
  const bool last = nb == t.n_min;
  if (c.warp_leader) {
    if (!(Cfg::kStageOutputInKV && last && c.warpgroup == 0)) {
      mbarrier_arrive(bars.k_empty + 8 * stage);
    }
    // One Q buffer: released after the tile's last S (more: after the output store has read
    // it, see release_staged_output).
    if (!Cfg::kStageOutput && last) mbarrier_arrive(bars.q_empty);
  }
  if (Cfg::kStageOutputInKV && last && c.warpgroup == 1) {
    named_barrier_arrive(staging_tile_barrier<Cfg>(0), 256);
  }
  shape_scores<Cfg>(s, p, t, row_lo + c.lane.row0, nb * Cfg::kBlockN + c.lane.col0,
                    block_needs_mask<Cfg>(p, t, row_lo, nb));
}

// O += P V (V in `stage`) has landed: O and the fragments are free, and so is the V stage,
// unless `staged_in` (a tile's last V tile, where warpgroup 1 stages its output: freed by that
// store instead).
template <class Cfg>
__device__ __forceinline__ void take_output(const BarrierAddresses& bars, const ConsumerState& c,
                                            int stage, float (&o)[Cfg::kHeadDim / 2],
                                            uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                            bool staged_in = false) {
  fence_registers(o);
  fence_registers(pa);
  if (c.warp_leader && !staged_in) mbarrier_arrive(bars.v_empty + 8 * stage);
}

// Hands the buffer of the last staged output store back to the producer once the store has
// read it (only the issuing thread can wait for that). Called after each GEMM issue, so that the
// wait overlaps the GEMMs.
//   Q buffer (kStageOutput): the store of tile n is issued in tile n + 1's first block, and the
//   next issue releases it: tile n + 1's second block, or, when tile n + 1 has one key block,
//   tile n + 2's first. Either way before tile n + 3 waits for the Q that the producer loads
//   into the same buffer (three buffers; with two, tile n + 2 would wait for a release that
//   only its own first issue makes).
//   K / V stage (kStageOutputInKV): the store of tile n is issued at its end; tile n + 1's first
//   issue releases it (its first block is in the other stage), or, in a cluster where tile
//   n + 1 starts with an odd count of the other CTA's blocks, the wait for its first block
//   (consume_tile). This warpgroup's 4 arrivals of the stage's 8.
template <class Cfg>
__device__ __forceinline__ void release_staged_output(const BarrierAddresses& bars,
                                                      ConsumerState& c) {
  if constexpr (Cfg::kStageOutput) {
    bulk_read_wait_then_arrive_if(c.leader && c.unreleased >= 0, bars.q_empty + 8 * c.unreleased);
  } else {
    bulk_read_wait_then_arrive_if<4>(
        c.leader && c.unreleased >= 0,
        (c.warpgroup == 0 ? bars.k_empty : bars.v_empty) + 8 * c.unreleased);
  }
  c.unreleased = -1;
}

// The output of a tile whose last PV has landed in o; `stage`: the K / V stage of the tile's
// last key block. With one Q buffer (kStageOutputInKV) it goes to that stage's K tile
// (warpgroup 0) or V tile (warpgroup 1), 64 rows a slab. The other warpgroup reads both in its
// last S and PV GEMMs, so each waits for the one it takes (staging_tile_barrier); its own reads of
// the stage are done. This warpgroup's "empty" arrivals of the stage for that tile wait for the
// store (take_scores, take_output): its leader makes them once the store has read the tile
// (release_staged_output). `tile`: as in stage_output.
template <class Cfg>
__device__ __forceinline__ void write_output(const Params& p, const FinishedTile& f,
                                             ConsumerState& c,
                                             const float (&o)[Cfg::kHeadDim / 2],
                                             uint32_t smem, int stage, int tile) {
  if constexpr (Cfg::kStageOutput) {
    TIMELINE_CONSUMER_EVENT(c, tile, kStagingFree);
    stage_output<Cfg>(p, f, c, o, c.q_rows + f.q_buffer * Cfg::kQBytes, Cfg::kBlockM * 128, tile);
    c.unreleased = f.q_buffer;
  } else {
    named_barrier_sync(staging_tile_barrier<Cfg>(c.warpgroup), 256);
    TIMELINE_CONSUMER_EVENT(c, tile, kStagingFree);
    const uint32_t rows = c.warpgroup == 0 ? k_tile<Cfg>(smem, stage) : v_tile<Cfg>(smem, stage);
    stage_output<Cfg>(p, f, c, o, rows, 64 * 128, tile);
    c.unreleased = stage;
  }
}

// A tile's last PV in a GEMM turn of its own, then its output (finish() gives where it goes):
// every tile with one Q buffer (head dim 256, the wide tile: the next tile's Q cannot be there
// yet), and the last tile of a CTA otherwise.
template <class Cfg, class Finish>
__device__ __forceinline__ void last_pv_alone(const Params& p, uint32_t smem,
                                              const BarrierAddresses& bars, ConsumerState& c,
                                              const StagePhases<Cfg>& phases,
                                              float (&o)[Cfg::kHeadDim / 2],
                                              uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                              Finish&& finish) {
  const int prev = (c.block_count - 1) % Cfg::kStages;
  mbarrier_wait(bars.v_full + 8 * prev, phases.taken(c.block_count - 1));
  issue_in_turn(c, [&] {
    TIMELINE_CONSUMER_EVENT(c, c.q_count - 1, kLastPvTurn);
    issue_pv<Cfg>(pa, v_tile<Cfg>(smem, prev), o);
    wgmma_commit();
  });
  wgmma_wait<0>();
  TIMELINE_CONSUMER_EVENT(c, c.q_count - 1, kLastPvDone);
  take_output<Cfg>(bars, c, prev, o, pa, Cfg::kStageOutputInKV && c.warpgroup == 1);
  // Warpgroup 1 stages its output in this V tile (write_output).
  if (Cfg::kStageOutputInKV && c.warpgroup == 0) {
    named_barrier_arrive(staging_tile_barrier<Cfg>(1), 256);
  }
  write_output<Cfg>(p, finish(), c, o, smem, prev, c.q_count - 1);
  TIMELINE_CONSUMER_EVENT(c, c.q_count - 1, kStored);
}

// One non-empty tile: S = Q K^T, online softmax and O += P V over its key blocks (last first).
// o / s / pa are the warpgroup's register tiles. The tile's last PV is left pending: with staged
// outputs it is issued together with the next tile's first S GEMM (a valid `pending` on entry),
// as the steady state issues S_j with PV_{j+1}, so that a tile boundary costs one
// GEMM turn like any key block instead of a lone PV turn and a lone S turn with the first
// block's softmax exposed between them; the finished tile's output is staged while the new
// tile's first S runs. With one Q buffer (head dim 256) the last PV runs alone at the end of
// the tile, as the next Q cannot have arrived yet.
template <class Cfg>
__device__ __forceinline__ void consume_tile(const Params& p, const Tile& t, uint32_t smem,
                                             const BarrierAddresses& bars, ConsumerState& c,
                                             StagePhases<Cfg>& phases, PendingTile& pending,
                                             float (&o)[Cfg::kHeadDim / 2],
                                             float (&s)[Cfg::kBlockN / 2],
                                             uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                             uint32_t (&qa)[Cfg::kQFragments][4]) {
  constexpr int kStages = Cfg::kStages;
  const int row_lo = t.m_block * Cfg::kBlockM + c.warpgroup * 64;  // this warpgroup's rows
  const int q_buffer = c.q_count % Cfg::kQBuffers;
  const uint32_t q_rows = c.q_rows + q_buffer * Cfg::kQBytes;
  // In a cluster, after an odd count of passed stage uses (below), the first block takes the
  // stage of the previous tile's staged output (kStageOutputInKV), which the producer loads (and
  // the Q behind it, one Q buffer) only once the store has read it.
  if constexpr (Cfg::kStageOutputInKV && Cfg::kClusterSize > 1) {
    if (c.unreleased == (c.block_count + t.n_lead() - t.n_max) % kStages) {
      release_staged_output<Cfg>(bars, c);
    }
  }
  // Timeline: this tile is number c.q_count until the increment, c.q_count - 1 after it; the
  // pending tile (fused) c.q_count - 2.
  TIMELINE_CONSUMER_EVENT(c, c.q_count, kQWait);
  mbarrier_wait(bars.q_full + 8 * q_buffer, (c.q_count / Cfg::kQBuffers) & 1);
  TIMELINE_CONSUMER_EVENT(c, c.q_count, kQFull);
  if constexpr (Cfg::kQInRegisters) {
    load_fragments_swizzled(q_rows, Cfg::kBlockM * 128, c.lane.row0 & ~15, 0, threadIdx.x % 32,
                            qa);
  }
  ++c.q_count;
  const int pending_block = c.block_count - 1;  // the pending tile's last key block (kFused)
  // In a cluster, the stage uses of the blocks only the other CTA's tile visits (produce_tile).
  if constexpr (Cfg::kClusterSize > 1) c.block_count += t.n_lead() - t.n_max;
  RowStats st = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
  float o_scale[2];
  // First key block: S, fused with the pending tile's last PV when kFused. Two copies of the
  // block, not one with a branch inside: with a branch around the waits that count the PV's
  // commit group ptxas serializes the wgmmas (C7514), and with an empty commit group in place
  // of the PV it issues a dummy HGMMA for it.
  const auto first_block = [&](auto fused) {
    constexpr bool kFused = decltype(fused)::value;
    const int nb = t.n_max - 1;
    const int stage = c.block_count % kStages;
    const int prev = pending_block % kStages;  // the pending tile's last V (kFused)
    mbarrier_wait(bars.k_full + 8 * stage, phases.next(c.block_count));
    if (kFused) mbarrier_wait(bars.v_full + 8 * prev, phases.taken(pending_block));
    phases.advance(c.block_count);
    issue_in_turn(c, [&] {
      TIMELINE_CONSUMER_EVENT(c, c.q_count - 1, kFirstTurn);
      if constexpr (kFused) {
        TIMELINE_CONSUMER_EVENT(c, c.q_count - 2, kLastPvTurn);
      }
      issue_qk<Cfg>(q_rows, qa, k_tile<Cfg>(smem, stage), s);
      wgmma_commit();
      if constexpr (kFused) {
        issue_pv<Cfg>(pa, v_tile<Cfg>(smem, prev), o);
        wgmma_commit();
      }
    });
    // The store staged in the previous tile's first block, when that tile had no second block.
    release_staged_output<Cfg>(bars, c);
    wgmma_wait<kFused ? 1 : 0>();    // S done; the pending PV may still run
    TIMELINE_CONSUMER_EVENT(c, c.q_count - 1, kFirstScores);
    take_scores<Cfg>(p, t, bars, c, stage, nb, row_lo, s);
    online_softmax<Cfg, true>(s, st, p.scale_log2, o_scale);
    if constexpr (kFused) {
      wgmma_wait<0>();
      // nvcc 13.0 places this wait's SASS before the softmax above (docs/perf-notes-v3.md, "the
      // softmax never overlapped the PV GEMM"); the stamp stays after both.
      TIMELINE_CONSUMER_EVENT(c, c.q_count - 2, kLastPvDone);
      take_output<Cfg>(bars, c, prev, o, pa);
      write_output<Cfg>(p, pending.f, c, o, smem, prev, c.q_count - 2);
      TIMELINE_CONSUMER_EVENT(c, c.q_count - 2, kStored);
    }
  };
  if (Cfg::kStageOutput && pending.valid) {
    first_block(std::bool_constant<Cfg::kStageOutput>());
  } else {
    first_block(std::false_type());
  }
#pragma unroll
  for (int i = 0; i < Cfg::kHeadDim / 2; ++i) o[i] = 0.f;
  accumulator_to_fragments<typename Cfg::Element>(s, pa);
  ++c.block_count;
  TIMELINE_CONSUMER_EVENT(c, c.q_count - 1, kFirstBlockDone);
  // Steady state: S_j and PV_{j+1} in flight together; softmax(S_j) overlaps PV_{j+1}.
  for (int nb = t.n_max - 2; nb >= t.n_min; --nb, ++c.block_count) {
    const int stage = c.block_count % kStages;
    const int prev = (c.block_count - 1) % kStages;
    mbarrier_wait(bars.k_full + 8 * stage, phases.next(c.block_count));
    mbarrier_wait(bars.v_full + 8 * prev, phases.taken(c.block_count - 1));
    phases.advance(c.block_count);
    issue_in_turn(c, [&] {
      TIMELINE_BLOCK_EVENT(c, c.q_count - 1, t.n_max - 2 - nb, kBlockTurn);
      issue_qk<Cfg>(q_rows, qa, k_tile<Cfg>(smem, stage), s);
      wgmma_commit();
      issue_pv<Cfg>(pa, v_tile<Cfg>(smem, prev), o);
      wgmma_commit();
    });
    if constexpr (Cfg::kStageOutput) {
      release_staged_output<Cfg>(bars, c);  // the store issued in this tile's first block (fused)
    }
    wgmma_wait<1>();  // S_j done, PV_{j+1} may still run
    TIMELINE_BLOCK_EVENT(c, c.q_count - 1, t.n_max - 2 - nb, kBlockScores);
    take_scores<Cfg>(p, t, bars, c, stage, nb, row_lo, s);
    // PV_{j+1} reads pa, which the softmax writes.
    wgmma_wait<0>();
    TIMELINE_SOFTMAX_EVENT(c, c.q_count - 1, t.n_max - 2 - nb, kBlockPvDone);
    take_output<Cfg>(bars, c, prev, o, pa);
    if (!(Cfg::kConditionalRescale &&
          softmax_at_running_max<Cfg>(s, st, p.scale_log2, row_lo + c.lane.row0, t.q_rows,
                                      pa))) {
      online_softmax<Cfg, false>(s, st, p.scale_log2, o_scale);
      rescale_output<Cfg>(o, o_scale);
      accumulator_to_fragments<typename Cfg::Element>(s, pa);
    }
    TIMELINE_SOFTMAX_EVENT(c, c.q_count - 1, t.n_max - 2 - nb, kBlockSoftmax);
  }
  TIMELINE_CONSUMER_EVENT(c, c.q_count - 1, kLoopDone);
  if constexpr (Cfg::kStageOutput) {
    // lse now, so that the row statistics are not live across the fused tile boundary.
    pending = {finish_tile<Cfg>(p, t, row_lo, c.lane, st, q_buffer), true};
  } else {
    // After the PV: at head dim 256 the statistics fit next to O, the finished rows did not.
    last_pv_alone<Cfg>(p, smem, bars, c, phases, o, pa,
                       [&] { return finish_tile<Cfg>(p, t, row_lo, c.lane, st, q_buffer); });
  }
}

template <class Cfg>
__device__ void run_consumer(const Params& p, uint32_t smem, BarrierAddresses bars,
                             int warpgroup) {
  constexpr int W = Cfg::kConsumerWarpgroups;
  const int thread = threadIdx.x % 128;
  ConsumerState c;
  c.warpgroup = warpgroup;
  c.warp_leader = thread % 32 == 0;
  c.lane = Lane::of(thread);
  c.my_barrier = scheduler_barrier(warpgroup);
  c.next_barrier = scheduler_barrier((warpgroup + 1) % W);
  c.leader = thread == 0;
  c.q_rows = smem + warpgroup * 64 * 128;
  c.block_count = 0;
  c.q_count = 0;
  c.unreleased = -1;
  StagePhases<Cfg> phases;

  // The first warpgroup goes first.
  if (warpgroup == W - 1) named_barrier_arrive(scheduler_barrier(0), 256);

  float o[Cfg::kHeadDim / 2];
  float s[Cfg::kBlockN / 2];
  uint32_t pa[Cfg::kBlockN / 16][4];
  uint32_t qa[Cfg::kQFragments][4];
  PendingTile pending;
  pending.valid = false;
  for (int unit = blockIdx.x; unit < p.num_units; unit += gridDim.x) {
    for (int second = 0; second < 2; ++second) {
      Tile t;
      if (!decode_tile<Cfg>(p, unit, second, t)) break;
      if (t.empty()) {
        // No kept key and no Q loaded: lse = -inf (finish_tile) and out = 0, without touching
        // the registers (a pending tile's O stays where it is).
        const RowStats none = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
        const int row_lo = t.m_block * Cfg::kBlockM + warpgroup * 64;
        finish_tile<Cfg>(p, t, row_lo, c.lane, none, 0);
        store_zero_output<Cfg>(p, t, row_lo);
        continue;
      }
      consume_tile<Cfg>(p, t, smem, bars, c, phases, pending, o, s, pa, qa);
    }
  }
  if (pending.valid) {
    last_pv_alone<Cfg>(p, smem, bars, c, phases, o, pa, [&] { return pending.f; });
  }
  // In a cluster the producer's last exchange waits for the stage of the last staged output.
  if constexpr (Cfg::kStageOutputInKV) release_staged_output<Cfg>(bars, c);
  // The shared memory the output stores read must outlive them; wait for them to finish.
  if (c.leader) bulk_wait_all();
  TIMELINE_EVENT(tl::kConsumerExit + warpgroup, c.leader);
  TIMELINE_CTA_INFO(c.q_count, c.leader && warpgroup == 0);
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) v3_forward_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  // TMA's 128-byte swizzle and the wgmma descriptors assume 1024-byte-aligned tiles.
  const uint32_t smem = (smem_address(smem_raw) + 1023) & ~1023u;
  const BarrierAddresses bars = BarrierAddresses::at<Cfg>(smem + Cfg::kBarrierOffset);
  constexpr uint32_t kEmptyArrivals = 4 * Cfg::kConsumerWarpgroups;  // one per consumer warp
  // A staged Q buffer is released by the one thread per warpgroup that stored the output.
  constexpr uint32_t kQEmptyArrivals =
      Cfg::kStageOutput ? Cfg::kConsumerWarpgroups : kEmptyArrivals;
  if (threadIdx.x == 0) {
    for (int b = 0; b < Cfg::kQBuffers; ++b) {
      mbarrier_init(bars.q_full + 8 * b, 1);
      mbarrier_init(bars.q_empty + 8 * b, kQEmptyArrivals);
    }
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbarrier_init(bars.k_full + 8 * s, 1);
      mbarrier_init(bars.k_empty + 8 * s, kEmptyArrivals);
      mbarrier_init(bars.v_full + 8 * s, 1);
      mbarrier_init(bars.v_empty + 8 * s, kEmptyArrivals);
      if (Cfg::kClusterSize > 1) {
        mbarrier_init(bars.k_peer + 8 * s, 1);
        mbarrier_init(bars.v_peer + 8 * s, 1);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  TIMELINE_START(p, threadIdx.x == 0);
  // In a cluster, the other CTA's barriers must be initialized before any load or release
  // reaches them.
  if constexpr (Cfg::kClusterSize > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  TIMELINE_EVENT(tl::kEntry, threadIdx.x == 0);

  // Broadcast from lane 0 so that the compiler knows it is warp-uniform: the addresses derived
  // from it (a warpgroup's Q rows, the S GEMM's A descriptor) then live in uniform registers.
  // Not at head dim 256: there ptxas spills 12-36 bytes with it, at each tile's start and end,
  // and the tiles ran 0-6.5% slower (docs/perf-notes.md, session 23).
  const int warpgroup = Cfg::kHeadDim == 256 ? int(threadIdx.x / 128)
                                             : __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  if (warpgroup == 0) {
    shrink_registers<Cfg::kProducerRegisters>();
    if (threadIdx.x == 0) run_producer<Cfg>(p, smem, bars);
  } else {
    grow_registers<Cfg::kConsumerRegisters>();
    run_consumer<Cfg>(p, smem, bars, warpgroup - 1);
  }
  // No cluster barrier before exit: every remote operation into the other CTA is waited for
  // (its producer waits for each peer arrival, run_producer's last exchange for the consumers
  // of both to have read each multicast block). One here made ptxas spill 76 bytes in the head
  // dim 256 consumers.
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

// Tile shapes per head dim (FlashAttention-3's choices where they fit this kernel's layout),
// and the alternatives that alternative_rows picks by sequence length and masking:
//   kTall: head dim 64, 192 x 128 (three consumer warpgroups);
//   kTall: head dim 128, 192 x 80 (three consumer warpgroups at 160 registers: O 64, S 40 and
//          P 20 per thread): two warpgroups' GEMMs run beside a warpgroup's softmax, though the
//          tensor pipe stays as busy as on the wide tile (ncu 85%: each warpgroup's own cycle
//          sets the pace). Per row 4.5-5.5% faster than the 128-row tile on long sequences
//          (harness, settled, docs/perf-notes.md session 22), 3% slower at T = 1024.
//   kWide: head dim 128, 128 x 192: each key block's fixed cost (row-max reductions, pingpong
//          hand-offs, wgmma waits) spread over 1.5x the keys; one Q buffer (next to two 192-key
//          K / V stages shared memory holds no second one), so no tile fusion. Measured -1.0%
//          at T = 16384, -2.2..-2.4% at T = 16384 causal (docs/perf-notes-v3.md, session 12).
//          Head dim 64's 128 x 256 does not fit: S of the next block, P and O need more than
//          240 registers, and ptxas serializes the wgmmas.
enum class TileShape { kStandard, kTall, kWide };
constexpr int kWideBlockN = 192, kTallBlockN128 = 80;
template <typename Element, int kHeadDim, TileShape kTile, int kClusterSize,
          bool kConditionalRescale, int kExp2EmulationPeriod>
struct ConfigFor;
template <typename Element, TileShape kTile, int C, bool R, int E>
struct ConfigFor<Element, 64, kTile, C, R, E> {
  using type = Config<Element, 64, 128, kTile == TileShape::kTall ? 3 : 2, R, E, C>;
};
template <typename Element, TileShape kTile, int C, bool R, int E>
struct ConfigFor<Element, 128, kTile, C, R, E> {
  static constexpr int kBlockN = kTile == TileShape::kWide   ? kWideBlockN
                                 : kTile == TileShape::kTall ? kTallBlockN128
                                                             : 128;
  using type = Config<Element, 128, kBlockN, kTile == TileShape::kTall ? 3 : 2, R, E, C>;
};
template <typename Element, int C, bool R, int E>
struct ConfigFor<Element, 256, TileShape::kStandard, C, R, E> {
  using type = Config<Element, 256, 80, 2, R, E, C>;
};

#ifdef JAX_FLASH_V3_TUNING_VARIANTS
// Measurement builds: JAX_FLASH_V3_TILE (0 standard, 1 the head dim's alternative for the rows,
// 2 head dim 128's wide tile for any rows) and JAX_FLASH_V3_CLUSTER (1 alone, 2 in pairs where
// allowed) override the choices below.
int dispatch_override(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : -1;
}
#endif

// A range of every sequence's query rows that one launch runs: [begin, begin + count).
struct QueryRows {
  int64_t begin;
  int64_t count;
};

// Whether a launch may run a range of the query rows that does not start at row 0: where a row's
// scores do not depend on its position (no causal mask or window; a range's rows past a query
// length are found by Params::q_row_begin).
bool rows_are_interchangeable(const ForwardArgs& a) {
  const MaskSpec& m = a.spec;
  return !m.is_causal && m.window_left < 0 && m.window_right < 0;
}

// How many leading rows of every sequence run on the head dim's alternative tile (kTall at head
// dims 64 and 128; kWide at 128 where rows are not interchangeable, see dispatch_head_dim); the
// rest run on its standard tile (a second launch where both parts have rows).
// Head dim 64: the 192-row tile is faster on long sequences (T = 16384: +19% non-causal, +10%
// causal) and slower on short or causal ones, where its partial and diagonal tiles waste more
// (T = 1024 causal: -13%); measured in docs/perf-notes-v3.md. Where rows are interchangeable,
// v3_tall_tile_rows (cuda/v3_fwd_tiles.h) weighs the two; under causal masking or a window the
// tall tile runs from 8192 rows on (2048 with a left window only).
// Head dim 128, rows interchangeable: v3_tall_tile_rows, where 80-key blocks pad the keys by at
// most 2% more than 128-key blocks do (S = 4096: 4160 keys). Causal or a right window (no left
// one): the wide tile from 16384 rows on (a diagonal block of 192 keys wastes 64 more per tile,
// which only long tiles hide: measured -2.2..-2.4% at T = 16384), where its last, partial key
// block pads the keys by at most 1% more than 128-key blocks do.
int64_t alternative_rows(const ForwardArgs& a, int sm_count) {
  const MaskSpec& m = a.spec;
  const bool causal_like = m.is_causal || m.window_right >= 0;
  const int64_t t = a.shape.q_len, s = a.shape.kv_len;
  const int64_t batch_heads = a.shape.batch * a.shape.num_heads;
#ifdef JAX_FLASH_V3_TUNING_VARIANTS
  const int forced = dispatch_override("JAX_FLASH_V3_TILE");
  if (forced == 0 || (forced >= 1 && a.shape.head_dim == 256)) return 0;
  if (forced >= 1) return t;
#endif
  if (a.shape.head_dim == 64) {
    if (rows_are_interchangeable(a))
      return v3_tall_tile_rows(batch_heads, t, sm_count, kTallTileRule64);
    return t >= (causal_like ? 8192 : 2048) ? t : 0;
  }
  if (a.shape.head_dim != 128) return 0;
  // Whether key blocks of block_n pad the keys by at most `percent` % more than 128-key ones do.
  const auto pads_within = [s](int64_t block_n, int64_t percent) {
    const auto padded = [s](int64_t n) { return (s + n - 1) / n * n; };
    return padded(block_n) * 100 <= padded(128) * (100 + percent);
  };
  if (rows_are_interchangeable(a)) {
    return pads_within(kTallBlockN128, 2)
               ? v3_tall_tile_rows(batch_heads, t, sm_count, kTallTileRule128)
               : 0;
  }
  if (m.window_left >= 0 || t < 16384) return 0;
  return pads_within(kWideBlockN, 1) ? t : 0;
}

// Clusters of two CTAs sharing each K / V block (Config::kClusterSize): measured (harness,
// settled; docs/perf-notes-v3.md, session 15) -5% at T = 1024 for head dims 128 / 256, -2..-3%
// at T = 4096 / 16384, -1..-2% at head dim 64, non-causal. Under causal masking (session 17,
// library A/B, host-timed) +2.3..+5.2% throughput at head dim 256, +1.8 / +3.0% at head dim 128
// T = 4096 / 16384; head dim 64 on its 128-row tile with three stages (Config::kStages) -1.6%
// time at T = 1024 and -0.6% at T = 4096 (harness). Slower under causal masking: head dim 128
// at T = 1024 (library -1.6% throughput; two stages, a third does not fit) and head dim 64's
// 192-row tile (harness +4.1% / +5.8% time with two / three stages), which therefore run alone.
// Where both m-blocks of a band start at the same key block (no left window; causal and right
// windows end them apart, see produce_tile) and the m-blocks come in whole bands (an even
// number: a band never straddles two heads). Query lengths are fine (decode_tile).
bool use_cluster(const ForwardArgs& a, QueryRows rows, int block_m) {
  const MaskSpec& m = a.spec;
  const int64_t m_blocks = (rows.count + block_m - 1) / block_m;
  if (m.window_left >= 0 || m_blocks % 2 != 0) return false;
#ifdef JAX_FLASH_V3_TUNING_VARIANTS
  const int forced = dispatch_override("JAX_FLASH_V3_CLUSTER");
  if (forced == 1 || forced == 2) return forced == 2;
#endif
  const bool causal_like = m.is_causal || m.window_right >= 0;
  if (!causal_like || a.shape.head_dim == 256) return true;
  return a.shape.head_dim == 64 ? block_m == 128 : rows.count >= 4096;
}

// The CTAs of a persistent forward grid: at most one per SM and per unit; in clusters of two, as
// many pairs as fit at once (a cluster's CTAs share a GPC, so an odd SM of a GPC stays idle).
template <class Cfg>
cudaError_t persistent_grid(const void* kernel, cudaLaunchConfig_t config, int num_units,
                            int sm_count, int* grid) {
  if constexpr (Cfg::kClusterSize == 1) {
    *grid = std::min(num_units, sm_count);
    return cudaSuccess;
  } else {
    // Queried once per kernel and SM count (a driver call, not to be paid per launch).
    static std::atomic<int64_t> cached{0};  // sm_count << 32 | clusters
    int64_t known = cached.load(std::memory_order_relaxed);
    if (known >> 32 != sm_count) {
      config.gridDim = dim3(Cfg::kClusterSize * (sm_count / Cfg::kClusterSize));
      int clusters = 0;
      const cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
      if (err != cudaSuccess) return err;
      if (clusters < 1) return cudaErrorInvalidConfiguration;
      known = int64_t(sm_count) << 32 | clusters;
      cached.store(known, std::memory_order_relaxed);
    }
    const int clusters = int(known & 0xffffffff);
    *grid = Cfg::kClusterSize * std::min(num_units / Cfg::kClusterSize, clusters);
    return cudaSuccess;
  }
}

// The switches the library runs per head dim (measured in docs/perf-notes-v3.md).
template <int kHeadDim>
struct DefaultTuning {
  static constexpr bool kConditionalRescale = true;
  static constexpr int kExp2EmulationPeriod = 0;
  static V3Tuning value() { return {kConditionalRescale, kExp2EmulationPeriod}; }
};

#ifdef JAX_FLASH_V3_FWD_TIMELINE
timeline::Buffer timeline_buffer;  // V3ForwardSetTimeline
#endif

// Runs query rows `rows` of every sequence (all of them, or a range where
// rows_are_interchangeable: the launch sees q, out and lse from the range's first row on).
template <class Cfg>
cudaError_t launch(const ForwardArgs& a, QueryRows rows, int sm_count, cudaStream_t stream) {
  const AttentionShape& sh = a.shape;
  if (rows.begin != 0 && !rows_are_interchangeable(a)) return cudaErrorInvalidValue;
  const int64_t row_offset = rows.begin * sh.num_heads * sh.head_dim;  // elements of q / out
  const void* q = static_cast<const uint16_t*>(a.q) + row_offset;
  void* out = static_cast<uint16_t*>(a.out) + row_offset;
  Params p;
  if (!encode_tensor_map(&p.tma_q, q, a.dtype, sh.batch, rows.count, sh.q_len, sh.num_heads,
                         sh.head_dim, Cfg::kBlockM) ||
      !encode_tensor_map(&p.tma_k, a.k, a.dtype, sh.batch, sh.kv_len, sh.num_kv_heads,
                         sh.head_dim, Cfg::kKVBoxRows) ||
      !encode_tensor_map(&p.tma_v, a.v, a.dtype, sh.batch, sh.kv_len, sh.num_kv_heads,
                         sh.head_dim, Cfg::kKVBoxRows) ||
      !encode_tensor_map(&p.tma_o, out, a.dtype, sh.batch, rows.count, sh.q_len, sh.num_heads,
                         sh.head_dim, 64)) {
    return cudaErrorInvalidValue;
  }
  p.out = out;
  p.lse = a.lse + rows.begin;
  p.q_seqlens = a.q_seqlens;
  p.kv_seqlens = a.kv_seqlens;
  p.q_len = int(rows.count);
  p.batch_rows = int(sh.q_len);
  p.q_row_begin = int(rows.begin);
  p.kv_len = int(sh.kv_len);
  p.num_heads = int(sh.num_heads);
  const int heads_per_kv = int(sh.num_heads / sh.num_kv_heads);
  const MaskSpec& spec = a.spec;
  set_score_params(p, spec);
  p.num_m_blocks = int((rows.count + Cfg::kBlockM - 1) / Cfg::kBlockM);
  // Causal without a left window: a tile's cost grows with its m-block; pair them up.
  p.pair_m_blocks = p.window_right >= 0 && p.window_left < 0;
  // In clusters, pairs of bands (decode_tile); use_cluster: an even number of m-blocks.
  const int bands_per_head = p.num_m_blocks / Cfg::kClusterSize;
  const int units_per_head =
      p.pair_m_blocks ? Cfg::kClusterSize * ((bands_per_head + 1) / 2) : p.num_m_blocks;
  const int64_t batch_heads = sh.batch * sh.num_heads;
  p.num_units = int(units_per_head * batch_heads);
  if (p.num_units == 0) return cudaSuccess;
  // num_units < 2^31 (V3ForwardUnsupportedReason), as DivMod needs for the decode's dividends.
  p.groups = UnitGroups::of(units_per_head / Cfg::kClusterSize, batch_heads, heads_per_kv,
                            sh.kv_len, sh.head_dim);
  p.div_num_heads = DivMod(p.num_heads);
  p.div_heads_per_kv = DivMod(heads_per_kv);

  const auto kernel = v3_forward_kernel<Cfg>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = Cfg::kClusterSize;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = Cfg::kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = Cfg::kClusterSize > 1 ? 1 : 0;  // alone: launched as before clusters
  int grid;
  err = persistent_grid<Cfg>(reinterpret_cast<const void*>(kernel), config, p.num_units,
                             sm_count, &grid);
  if (err != cudaSuccess) return err;
  config.gridDim = dim3(grid);
#ifdef JAX_FLASH_V3_FWD_TIMELINE
  if (!timeline_buffer.fits(grid)) return cudaErrorInvalidValue;
  p.timeline = rows.begin == 0 ? timeline_buffer.records : nullptr;  // a split's first launch
#endif
  return cudaLaunchKernelEx(&config, kernel, p);
}

// Launches the instantiation of (Element, kHeadDim, kTile) compiled for `tuning`: the head
// dim's default, plus (bf16, JAX_FLASH_V3_TUNING_VARIANTS builds) every switch combination.
template <typename Element, int kHeadDim, TileShape kTile, int kCluster>
cudaError_t launch_tuned(const ForwardArgs& a, QueryRows rows, const V3Tuning& tuning,
                         int sm_count, cudaStream_t stream) {
  using D = DefaultTuning<kHeadDim>;
  if (tuning == D::value()) {
    using Cfg = typename ConfigFor<Element, kHeadDim, kTile, kCluster, D::kConditionalRescale,
                                   D::kExp2EmulationPeriod>::type;
    return launch<Cfg>(a, rows, sm_count, stream);
  }
#ifdef JAX_FLASH_V3_TUNING_VARIANTS
  constexpr int kPeriod = 4;  // the emulation period tests/gpu/harness_v3.cu measures
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    if (tuning.exp2_emulation_period != 0 && tuning.exp2_emulation_period != kPeriod) {
      return cudaErrorNotSupported;
    }
    const bool emulated = tuning.exp2_emulation_period != 0;
    constexpr int C = kCluster;
    if (tuning.conditional_rescale && emulated)
      return launch<typename ConfigFor<Element, kHeadDim, kTile, C, true, kPeriod>::type>(
          a, rows, sm_count, stream);
    if (tuning.conditional_rescale)
      return launch<typename ConfigFor<Element, kHeadDim, kTile, C, true, 0>::type>(
          a, rows, sm_count, stream);
    if (emulated)
      return launch<typename ConfigFor<Element, kHeadDim, kTile, C, false, kPeriod>::type>(
          a, rows, sm_count, stream);
    return launch<typename ConfigFor<Element, kHeadDim, kTile, C, false, 0>::type>(
        a, rows, sm_count, stream);
  }
#endif
  return cudaErrorNotSupported;
}

// The tile in clusters of two where use_cluster allows, else alone.
template <typename Element, int kHeadDim, TileShape kTile>
cudaError_t launch_clustered(const ForwardArgs& a, QueryRows rows, const V3Tuning& tuning,
                             int sm_count, cudaStream_t stream) {
  using D = DefaultTuning<kHeadDim>;
  using Cfg = typename ConfigFor<Element, kHeadDim, kTile, 1, D::kConditionalRescale,
                                 D::kExp2EmulationPeriod>::type;
  return use_cluster(a, rows, Cfg::kBlockM)
             ? launch_tuned<Element, kHeadDim, kTile, 2>(a, rows, tuning, sm_count, stream)
             : launch_tuned<Element, kHeadDim, kTile, 1>(a, rows, tuning, sm_count, stream);
}

// The head dim's alternative tile for the rows alternative_rows gives it, its standard tile for
// the rest.
template <typename Element, int kHeadDim, TileShape kAlternative>
cudaError_t launch_tile(const ForwardArgs& a, const V3Tuning& tuning, int sm_count,
                        cudaStream_t stream) {
  const int64_t t = a.shape.q_len, alternative = alternative_rows(a, sm_count);
  if (alternative == t) {
    return launch_clustered<Element, kHeadDim, kAlternative>(a, {0, t}, tuning, sm_count, stream);
  }
  if (alternative > 0) {
    const cudaError_t err = launch_clustered<Element, kHeadDim, kAlternative>(
        a, {0, alternative}, tuning, sm_count, stream);
    if (err != cudaSuccess) return err;
  }
  return launch_clustered<Element, kHeadDim, TileShape::kStandard>(
      a, {alternative, t - alternative}, tuning, sm_count, stream);
}

template <typename Element>
cudaError_t dispatch_head_dim(const ForwardArgs& a, const V3Tuning& tuning, int sm_count,
                              cudaStream_t stream) {
  switch (a.shape.head_dim) {
    case 64: return launch_tile<Element, 64, TileShape::kTall>(a, tuning, sm_count, stream);
    case 128:
#ifdef JAX_FLASH_V3_TUNING_VARIANTS
      if (dispatch_override("JAX_FLASH_V3_TILE") == 2)
        return launch_tile<Element, 128, TileShape::kWide>(a, tuning, sm_count, stream);
#endif
      // alternative_rows: the tall tile where rows are interchangeable, else the wide one.
      return rows_are_interchangeable(a)
                 ? launch_tile<Element, 128, TileShape::kTall>(a, tuning, sm_count, stream)
                 : launch_tile<Element, 128, TileShape::kWide>(a, tuning, sm_count, stream);
    case 256:
      return launch_clustered<Element, 256, TileShape::kStandard>(a, {0, a.shape.q_len}, tuning,
                                                                  sm_count, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t dispatch(const ForwardArgs& a, const V3Tuning& tuning, int sm_count,
                     cudaStream_t stream) {
  return a.dtype == DType::kBF16
             ? dispatch_head_dim<__nv_bfloat16>(a, tuning, sm_count, stream)
             : dispatch_head_dim<__half>(a, tuning, sm_count, stream);
}

// V3ForwardUnsupportedReason on a device of `info` (null: none could be queried), which the
// entry points query once per call.
const char* unsupported_reason(const ForwardArgs& a, const DeviceInfo* info) {
  const AttentionShape& sh = a.shape;
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) return "v3 needs bfloat16 or float16";
  if (sh.head_dim != 64 && sh.head_dim != 128 && sh.head_dim != 256)
    return "v3 needs head dim 64, 128 or 256";
  if (a.bias.data != nullptr) return "v3 does not take a bias tensor";
  if (a.mask.data != nullptr) return "v3 does not take a mask tensor";
  if (!(a.spec.scale > 0.f)) return "v3 needs scale > 0";
  if (sh.num_kv_heads <= 0 || sh.num_heads % sh.num_kv_heads != 0)
    return "query heads must be a multiple of kv heads";
  if (sh.kv_len < 1) return "v3 needs at least one key";
  if (sh.q_len >= (int64_t(1) << 31) || sh.kv_len >= (int64_t(1) << 31) ||
      sh.batch * sh.num_heads * ((sh.q_len + 63) / 64) >= (int64_t(1) << 31))
    return "v3 indexes rows and tiles with 32-bit integers";
  // TMA loads q, k, v and stores out: their global addresses must be 16-byte aligned.
  for (const void* p : {a.q, a.k, a.v, static_cast<const void*>(a.out)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
      return "v3 needs q, k, v and out 16-byte aligned (TMA)";
  if (info == nullptr) return "no CUDA device";
  if (info->major != 9 || info->minor != 0) return "v3 needs an sm_90 (Hopper) device";
  return nullptr;
}

}  // namespace

const char* V3ForwardUnsupportedReason(const ForwardArgs& a) {
  DeviceInfo info;
  return unsupported_reason(a, current_device(&info));
}

cudaError_t V3ForwardTuned(const ForwardArgs& args, const V3Tuning& tuning, cudaStream_t stream) {
  DeviceInfo info;
  if (unsupported_reason(args, current_device(&info)) != nullptr) return cudaErrorInvalidValue;
  return dispatch(args, tuning, info.sm_count, stream);
}

V3Tuning V3DefaultTuning(int64_t head_dim) {
  return head_dim == 64    ? DefaultTuning<64>::value()
         : head_dim == 128 ? DefaultTuning<128>::value()
                           : DefaultTuning<256>::value();
}

#ifdef JAX_FLASH_V3_FWD_TIMELINE
void V3ForwardSetTimeline(uint64_t* records, int64_t ctas) {
  timeline_buffer.set(records, ctas);
}
#endif

cudaError_t V3Forward(const ForwardArgs& args, cudaStream_t stream) {
  return V3ForwardTuned(args, V3DefaultTuning(args.shape.head_dim), stream);
}

}  // namespace jax_flash
