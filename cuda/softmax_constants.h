// Constants of the online softmax that every CUDA schedule shares.
#pragma once

namespace jax_flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// With conditional rescaling a row's running max stays stale until a block's exceeds it by more
// than this (log2 units), so that once the maxima settle most key blocks rescale nothing
// (FlashAttention-4's idea; v2 and v3). Probabilities then reach at most 2^8, far inside the
// range of bf16 / f16 and of the fp32 sums.
constexpr float kRescaleThreshold = 8.f;

}  // namespace jax_flash
