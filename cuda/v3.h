// Host launcher of the v3 forward kernel: Hopper (sm_90a) only, bf16 / fp16, head dims 64,
// 128 and 256, no bias or mask tensor (the Python schedule sends those calls to v2).
// cuda/v3_fwd_sm90.cu holds the kernel and docs/perf-notes-v3.md its measurements.
#pragma once

#include <cuda_runtime.h>

#include "attention_args.h"

namespace jax_flash {

// Switches for the two FlashAttention-4 ideas that port to Hopper, kept so each can be measured
// as a delta (tests/gpu/harness_v3.cu). The library runs V3DefaultTuning(head_dim).
struct V3Tuning {
  // Keep the running row max (and skip the O / row-sum rescale of the warp) unless a row's max
  // grows by more than 8 in log2 units; P then stays <= 2^8, which fp32 / bf16 / fp16 hold.
  bool conditional_rescale = false;
  // 0: every exp2 on the special-function unit. p > 0: every p-th 8-column chunk of the score
  // tile through a degree-3 polynomial on the FMA units instead.
  int exp2_emulation_period = 0;
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

}  // namespace jax_flash
