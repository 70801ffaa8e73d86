// Constants of the online softmax that every CUDA schedule shares.
#pragma once

namespace jax_flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// With conditional rescaling (FlashAttention-4's idea) a row's running max stays stale while
// the probabilities it gives stay below 2^this (log2 units), so that once the maxima settle most
// key blocks rescale nothing: v2 at head dim 256 keeps the max until a block's exceeds it by more
// than this; the running-max softmax (v3's forward, v2 up to head dim 128) does not take a
// block's max at all while the sums of the probabilities stay below 2^this. 2^8 is far inside
// the range of bf16 / f16 and of the fp32 sums.
constexpr float kRescaleThreshold = 8.f;
// 2^kRescaleThreshold: the running-max softmax (v2 / v3 forward) keeps a block while each
// thread's partial sums of its probabilities stay below this.
constexpr float kProbabilitySumBound = float(1 << int(kRescaleThreshold));

}  // namespace jax_flash
