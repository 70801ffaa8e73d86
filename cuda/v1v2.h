// Host launchers of the sm_80 tensor-core schedules v1 (FlashAttention-1) and v2
// (FlashAttention-2), forward and backward. bf16 / f16, head dims that are multiples of 8 up to
// 256. Every launcher only enqueues work on `stream` and returns the launch error.
//
// Workspaces are device buffers the caller owns until the work completes (the FFI handlers get
// them as extra outputs of the call; sizes in float elements below):
//   v1 forward:        o_accum  [B, N, T, H] f32   the running normalized output between key blocks
//   v1 / v2 backward:  dq_accum                    dQ summed over key blocks (fp32); size and
//                                                  layout below
//                      dsum     [B, N, T]    f32   D = rowsum(dout * out)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_args.h"

namespace jax_flash {

constexpr int64_t kV1V2MaxHeadDim = 256;
constexpr int64_t kV1V2HeadDimMultiple = 8;

// The kernels are instantiated for head-dim capacities 64, 128 and 256; a head dim runs in the
// smallest capacity that holds it, its extra columns zero-filled.
constexpr int64_t v1v2_head_dim_capacity(int64_t head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

template <int kCapacity>
struct HeadDimCapacity {
  static constexpr int value = kCapacity;
};

// Calls f(HeadDimCapacity<c>{}) for the capacity c of head_dim.
template <typename F>
cudaError_t dispatch_head_dim_capacity(int64_t head_dim, F&& f) {
  if (head_dim <= 0 || head_dim > kV1V2MaxHeadDim || head_dim % kV1V2HeadDimMultiple != 0)
    return cudaErrorInvalidValue;
  switch (v1v2_head_dim_capacity(head_dim)) {
    case 64: return f(HeadDimCapacity<64>{});
    case 128: return f(HeadDimCapacity<128>{});
    default: return f(HeadDimCapacity<256>{});
  }
}

inline int64_t v1_forward_accum_elements(const AttentionShape& s) {
  return s.batch * s.num_heads * s.q_len * s.head_dim;
}

struct BackwardWorkspace {
  float* dq_accum = nullptr;  // backward_dq_accum_elements floats, layout private to the kernels
  float* dsum = nullptr;      // [B, N, T]
};

// dq_accum holds, per (batch, head), the query rows rounded up to a multiple of 128 (which
// every backward query block, 64 or 128 rows, divides) x the head-dim capacity, in blocks of
// the backward's query block, each stored in the order of the dQ MMA fragments, so that a
// warp's fp32 atomics cover 32 consecutive floats.
constexpr int64_t kBackwardQueryBlockMultiple = 128;
inline int64_t backward_dq_accum_elements(const AttentionShape& s) {
  const int64_t rows = (s.q_len + kBackwardQueryBlockMultiple - 1) / kBackwardQueryBlockMultiple *
                       kBackwardQueryBlockMultiple;
  return s.batch * s.num_heads * rows * v1v2_head_dim_capacity(s.head_dim);
}
inline int64_t backward_dsum_elements(const AttentionShape& s) {
  return s.batch * s.num_heads * s.q_len;
}

// v1: one CTA per (batch, head); key blocks outermost, query steps of 16 rows inside, the four
// warps splitting each key block and combining through shared memory; the output is kept
// normalized in o_accum between key blocks.
cudaError_t launch_v1_forward(const ForwardArgs& args, float* o_accum, cudaStream_t stream);

// v2: one CTA per (query block, head, batch); warps split the query block, online softmax in
// registers, normalization once at the end.
cudaError_t launch_v2_forward(const ForwardArgs& args, cudaStream_t stream);

// Backward (FlashAttention-2 kernels): D = rowsum(dout * out); one CTA per key block
// accumulates dK, dV in registers over all query blocks (and all query heads of its kv head)
// and adds dQ into dq_accum; a last kernel converts dq_accum to dq. dbias (when requested) is
// zeroed and then written per tile.
//   v2: the key blocks of a head run in parallel, dQ by fp32 atomics.
//   v1: one CTA per (batch, kv head) walks all key blocks in turn, so dQ needs no atomics
//       (FlashAttention-1's sequential schedule over the same tile code).
cudaError_t launch_v1_backward(const BackwardArgs& args, const BackwardWorkspace& workspace,
                               cudaStream_t stream);
cudaError_t launch_v2_backward(const BackwardArgs& args, const BackwardWorkspace& workspace,
                               cudaStream_t stream);

}  // namespace jax_flash
