// Host launcher of the v3 forward kernel: Hopper (sm_90a) only, bf16 / fp16, head dims 64,
// 128 and 256, no bias or mask tensor (the Python schedule sends those calls to v2).
// cuda/v3_fwd_sm90.cu holds the kernel and docs/perf-notes-v3.md its measurements.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_args.h"

namespace jax_flash {

// Switches for the two FlashAttention-4 ideas that port to Hopper, kept so each can be measured
// as a delta (tests/gpu/harness_v3.cu). The library runs V3DefaultTuning(head_dim).
struct V3Tuning {
  // A key block after a tile's first takes P at the running row max, without its own max and
  // without rescaling O / the row sums, unless some P of the warp's rows could reach 2^8 (which
  // fp32 / bf16 / fp16 hold); off: every block takes its max and rescales.
  bool conditional_rescale = false;
  // 0: every exp2 on the special-function unit. p > 0: every p-th 8-column chunk of the score
  // tile through a degree-3 polynomial on the FMA units instead.
  int exp2_emulation_period = 0;

  bool operator==(const V3Tuning& o) const {
    return conditional_rescale == o.conditional_rescale &&
           exp2_emulation_period == o.exp2_emulation_period;
  }
};

// The switches V3Forward uses for a head dim (64, 128 or 256).
V3Tuning V3DefaultTuning(int64_t head_dim);

// nullptr when V3Forward can run `args` on the current device, else the reason it cannot.
const char* V3ForwardUnsupportedReason(const ForwardArgs& args);

// Enqueues the forward on `stream`. Returns cudaErrorInvalidValue for unsupported arguments
// (see V3ForwardUnsupportedReason), else the launch error, if any.
cudaError_t V3Forward(const ForwardArgs& args, cudaStream_t stream);

// The same with explicit switches. Only V3DefaultTuning(head_dim) is compiled into the library;
// the other combinations exist (for bf16) only when built with -DJAX_FLASH_V3_TUNING_VARIANTS,
// and otherwise this returns cudaErrorNotSupported.
cudaError_t V3ForwardTuned(const ForwardArgs& args, const V3Tuning& tuning, cudaStream_t stream);

#ifdef JAX_FLASH_V3_FWD_TIMELINE
// ---- Timeline of the forward kernel (measurement builds only: -DJAX_FLASH_V3_FWD_TIMELINE;
// tests/gpu/build_v3_timeline.sh, harness_v3 mode --timeline) ----
// Each CTA of v3_forward_kernel writes kEvents records of two uint64 at
// records + 2 * kEvents * blockIdx.x (cuda/timeline.cuh): timer records (%globaltimer ns,
// %clock64) and value records. Events not reached keep what the caller stored there.
namespace v3_fwd_timeline {
// Consumer warpgroups: 2, or 3 for head dim 64's 192-row tile.
constexpr int kMaxConsumers = 3;
// A CTA runs n tiles (its non-empty ones, counted 0 .. n-1 in the order it runs them). Slots 0
// and 1 hold tiles 0 and 1; tile k >= 2 goes to slot 2 + k % 2, overwriting tile k - 2, so that
// slots 2 and 3 end up holding tiles n-2 and n-1 (the count need not be known in advance).
constexpr int kTileSlots = 4;
enum Event : int {
  kCtaInfo = 0,   // value: (%smid, n)
  kEntry,         // thread 0, after the __syncthreads that follows the mbarrier init
  kConsumerExit,  // + w: consumer warpgroup w (0-based) done, its output stores completed
  kTiles = kConsumerExit + kMaxConsumers,  // + slot * kTileEvents: the slot's tile
};
// Events of one tile.
enum TileEvent : int {
  kTileShape = 0,  // value: (m-block, key blocks)
  kQIssued,        // producer: the Q load issued
  kFirstKvIssued,  // producer: K and V of the tile's first key block (the last one) issued
  kLastKvIssued,   // producer: K and V of its last key block issued
  kConsumer,       // + w * kConsumerEvents: consumer warpgroup w, recorded by its thread 0
};
enum ConsumerEvent : int {
  kQWait = 0,       // the tile starts: the wait for its Q begins
  kQFull,           // that wait returned
  kFirstTurn,       // the pingpong turn of the first S GEMM acquired
  kFirstScores,     // the first S GEMM's wait returned
  kFirstBlockDone,  // first key block done (with the previous tile's last PV and output, fused)
  kLoopDone,        // every key block's S and softmax done; only the last PV is left
  kLastPvTurn,      // the turn that issues the last PV acquired (fused: the next tile's first)
  kLastPvDone,      // the last PV GEMM's wait returned (fused: and the next tile's block 0
                    // softmax done, which ptxas orders before that wait)
  kStagingFree,     // the output may be staged: with one Q buffer, once its row sums are taken
                    // and its K / V tile is free (staging_tile_barrier)
  kStaged,          // the output in shared memory (stmatrix and the proxy fence done)
  kStored,          // output written: staged and its TMA store issued (head dim 256: stored)
  kConsumerEvents,
};
// Per steady-loop key block of a tile (its blocks 1 .. kLoggedBlocks after the first, in the
// order run) and consumer warpgroup: where the pingpong turn and the GEMM waits fall.
constexpr int kLoggedBlocks = 8;
enum BlockEvent : int {
  kBlockTurn = 0,  // the block's turn acquired (S_j and PV_{j+1} are issued in it)
  kBlockScores,    // S_j's wait returned
  // Only with -DJAX_FLASH_V3_FWD_TIMELINE_SOFTMAX (stamps between the waits and the softmax
  // can move ptxas's schedule):
  kBlockSoftmax,   // its softmax done
  kBlockPvDone,    // PV_{j+1}'s wait returned (before the softmax, which writes PV's fragments)
  kBlockEvents,
};
constexpr int kConsumerBlocks = kConsumer + kMaxConsumers * kConsumerEvents;
constexpr int kTileEvents = kConsumerBlocks + kMaxConsumers * kLoggedBlocks * kBlockEvents;
constexpr int kEvents = kTiles + kTileSlots * kTileEvents;
// The record of tile event e of the CTA's tile number `tile` (the kernel stamps it, the harness
// reads it).
__host__ __device__ constexpr int tile_event(int tile, int e) {
  return kTiles + (tile < 2 ? tile : 2 + (tile & 1)) * kTileEvents + e;
}
// The record of consumer event e of consumer warpgroup w in the CTA's tile number `tile`.
__host__ __device__ constexpr int consumer_tile_event(int tile, int w, int e) {
  return tile_event(tile, kConsumer + w * kConsumerEvents + e);
}
// The record of block event e of steady block `block` (0-based) of that tile and warpgroup.
__host__ __device__ constexpr int consumer_block_event(int tile, int w, int block, int e) {
  return tile_event(tile, kConsumerBlocks + (w * kLoggedBlocks + block) * kBlockEvents + e);
}
}  // namespace v3_fwd_timeline

// From the next launch on, the forward kernel records into `records` (room for `ctas` CTAs,
// 16 * kEvents bytes each, 16-byte aligned); null: no recording. A launch of more CTAs fails
// with cudaErrorInvalidValue. A forward split over two launches (head dim 64's row split) records
// its first, the 192-row tile's. Host state, not per stream.
void V3ForwardSetTimeline(uint64_t* records, int64_t ctas);
#endif

// ---- Backward (cuda/v3_bwd_sm90.cu; FFI target jax_flash_v3_bwd in xla_ffi/gpu_v3.cc) ----
// bf16 / fp16, head dims 64, 128 and 256, no bias or mask tensor (v2's backward serves those).

// Device workspaces of V3Backward, owned by the caller until the work completes (the FFI
// handler gets them as extra outputs). Sizes: V3BackwardWorkspaceSizes. None needs clearing.
struct V3BackwardWorkspace {
  float* dq_accum = nullptr;     // dQ summed over key blocks, fp32, layout private to the kernel
  float* dsum = nullptr;         // [B, N, T_pad] D = rowsum(dout * out); T_pad = T rounded to 128
  float* lse_log2 = nullptr;     // [B, N, T_pad] lse * log2(e), +inf for rows with no kept key
  int32_t* dq_semaphore = nullptr;  // deterministic mode only: per 64 query rows of a head
  // fp32 dK / dV partials, [2][s][B, S, K, H]: of the GQA schedule's query-head split (GQA /
  // MQA with few (key block, kv head, batch) CTAs per SM) or of the default grid's key blocks cut
  // into parts (fewer such CTAs than SMs), s = the larger of V3BackwardMaxKvSplit(shape) and
  // V3BackwardMaxBlockParts(shape). May be null (neither).
  float* dkv_partial = nullptr;
};

struct V3BackwardWorkspaceBytes {
  int64_t dq_accum = 0, dsum = 0, lse_log2 = 0, dq_semaphore = 0, dkv_partial = 0;
};

// Bytes of each workspace (dq_semaphore: 4 bytes when not deterministic, never 0; dkv_partial:
// 2 * s * B * S * K * H * 4 with s = max(V3BackwardMaxKvSplit(shape),
// V3BackwardMaxBlockParts(shape)) when s > 1, else 4 bytes).
V3BackwardWorkspaceBytes V3BackwardWorkspaceSizes(const AttentionShape& shape, bool deterministic);

// The most CTAs per kv head the backward may split a GQA group's query heads over, from the
// shape alone (1: never split). > 1 when heads_per_kv > 1 and (key blocks x kv heads x batch) <
// 4 x 132, where key blocks = ceil(S / 128) (ceil(S / 64) at head dim 256): the largest divisor
// of heads_per_kv that is at most 4. jax_flash/schedules/v3.py mirrors this rule.
int V3BackwardMaxKvSplit(const AttentionShape& shape);

// The most CTAs the backward may cut a key block of its default grid into, from the shape alone
// (1: never): 4 when key blocks x kv heads x batch < 132, else 1. Key blocks are 128 keys (64
// at head dim 256). jax_flash/schedules/v3.py mirrors this rule.
int V3BackwardMaxBlockParts(const AttentionShape& shape);

// nullptr when V3Backward can run `args` on the current device, else the reason it cannot.
const char* V3BackwardUnsupportedReason(const BackwardArgs& args);

// Enqueues preprocess, the main kernel and postprocess on `stream`: writes dq, dk, dv (args.dbias
// must be null). deterministic: dQ partials are added in a fixed (key block) order, so two runs
// give bitwise equal dq. Returns cudaErrorInvalidValue for unsupported arguments or missing
// workspaces, else the launch error, if any.
cudaError_t V3Backward(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                       bool deterministic, cudaStream_t stream);

// V3Backward with the schedule of the main kernel given, for measurement: kv_split 0 = the rule
// V3Backward applies; -1 = the default grid (one CTA per key block, kv head and batch); S >= 1
// = the GQA schedule (longest key blocks first, the kv head's query heads split over S CTAs;
// S must divide heads_per_kv and, when > 1, be at most V3BackwardMaxKvSplit(shape) with
// workspace.dkv_partial set). block_parts, with kv_split -1 only: the CTAs each key block of the
// default grid is cut into, over shares of its query blocks: -1 = the rule's, 1 = whole, 2 ..
// V3BackwardMaxBlockParts(shape) (normal mode, workspace.dkv_partial set).
// cudaErrorInvalidValue for a schedule it cannot take.
cudaError_t V3BackwardScheduled(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                                bool deterministic, int kv_split, cudaStream_t stream,
                                int block_parts = -1);

// The schedule V3Backward would run on a device of sm_count SMs (0: the current device; host
// only, no device needed otherwise): -1 = the default grid, else the GQA schedule's split.
int V3BackwardChosenSplit(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                          bool deterministic, int sm_count = 0);

// The CTAs per key block V3Backward would cut its default grid into (1: whole, or the GQA
// schedule), as above.
int V3BackwardChosenBlockParts(const BackwardArgs& args, const V3BackwardWorkspace& workspace,
                               bool deterministic, int sm_count = 0);

#ifdef JAX_FLASH_V3_BWD_TIMELINE
// ---- Timeline of the backward main kernel (measurement builds only: -DJAX_FLASH_V3_BWD_TIMELINE;
// tests/gpu/build_v3_bwd_timeline.sh, harness mode --timeline) ----
// Each CTA of v3_backward_kernel writes kEvents records of two uint64 at
// records + 2 * kEvents * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)):
// %globaltimer (ns, common to all SMs but coarse: it steps about every 0.5 us on the H200) and
// %clock64 (cycles of the CTA's SM, exact), both read at the event. Record kCtaInfo holds
// (%smid, the CTA's steps) instead. Events not reached keep what the caller stored there.
namespace v3_bwd_timeline {
// Steps traced: 0, 1, 2 and the last three (steps - 3 .. steps - 1); slot s is step s for
// s < 3, else step steps - kTracedSteps + s. A CTA of fewer than 6 steps records each step
// once, in its lowest slot.
constexpr int kTracedSteps = 6;
enum Event : int {
  kCtaInfo = 0,
  kEntry,     // thread 0, after the __syncthreads that follows the mbarrier init
  kKvIssued,  // producer: the K and V loads issued
  kQIssued,   // + slot: producer, the traced step's Q / dO / lse / D loads issued
  kConsumer = kQIssued + kTracedSteps,  // + w * kConsumerEvents: consumer warpgroup w + 1
};
// Consumer warpgroup w (0: warpgroup 1, the dQ owner at head dims 64 / 128; 1: warpgroup 2,
// the helper), recorded by its thread 0.
enum ConsumerEvent : int {
  kKvFull = 0,                          // the kv_full wait returned
  kQFull = 1,                           // + slot: the step's q_full wait returned
  kScoresDone = kQFull + kTracedSteps,  // + slot: the wgmma wait for S^T returned
  kStepEnd = kScoresDone + kTracedSteps,  // + slot: end of step (the owner: dQ add issued)
  kDrained = kStepEnd + kTracedSteps,   // the final wgmma wait (every GEMM done) returned
  kStagingRead,  // head dims 64 / 128: the last dQ bulk reduce has read the staging buffer
  kExit,         // the dK / dV stores issued: the warpgroup's last instruction
  kConsumerEvents,
};
constexpr int kEvents = 64;
static_assert(kConsumer + 2 * kConsumerEvents <= kEvents);
// The record of consumer event e of consumer warpgroup w (0 or 1).
__host__ __device__ constexpr int consumer_event(int w, int e) {
  return kConsumer + w * kConsumerEvents + e;
}
}  // namespace v3_bwd_timeline

// From the next launch on, the main kernel records into `records` (room for `ctas` CTAs,
// 16 * kEvents bytes each, 16-byte aligned); null: no recording. A launch of more CTAs fails
// with cudaErrorInvalidValue. Host state, not per stream.
void V3BackwardSetTimeline(uint64_t* records, int64_t ctas);
#endif

}  // namespace jax_flash
