// The CPU flash-attention kernel: tiled online softmax (forward) and the FlashAttention-2
// backward, multi-threaded, f32 accumulation for f32 / bf16 / f16 storage.
// docs/architecture.md defines what is computed; cpu_handlers.cc is the FFI front end.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/attention_args.h"

namespace jax_flash::cpu {

constexpr int64_t kMaxHeadDim = 256;

// Both return an empty string on success, else why the call was refused (nothing written).
// Work memory is O(tile) per thread plus, for the backward, one f32 [B, N, T] buffer.
std::string Forward(const ForwardArgs& args);
std::string Backward(const BackwardArgs& args);

// Instruction-set variants of the kernel ("avx512", "avx2", "generic"): the ones this CPU can
// run, best first; the one in use (the best, unless changed); and a switch for tests.
std::vector<std::string> SupportedVariants();
std::string ActiveVariant();
bool SetActiveVariant(const std::string& name);

}  // namespace jax_flash::cpu
