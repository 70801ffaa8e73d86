// Plain argument structs shared by the CPU kernel, the CUDA kernels and the FFI handlers.
// No CUDA or XLA dependency: the handlers fill these, the kernels only read them.
// docs/architecture.md defines the semantics every kernel implements.
#pragma once
#include <cstdint>

namespace jax_flash {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Sizes of one attention call. Query head n reads kv head n / (num_heads / num_kv_heads).
struct AttentionShape {
  int64_t batch = 0;         // B
  int64_t q_len = 0;         // T
  int64_t kv_len = 0;        // S
  int64_t num_heads = 0;     // N
  int64_t num_kv_heads = 0;  // K
  int64_t head_dim = 0;      // H
};

// Which (t, s) pairs are kept and how scores are formed.
struct MaskSpec {
  float scale = 1.f;
  float softcap = 0.f;        // 0 = off; else x = softcap * tanh(x / softcap)
  bool is_causal = false;     // keep s <= t (top-left aligned)
  int32_t window_left = -1;   // keep s >= t - window_left  (-1 = unbounded)
  int32_t window_right = -1;  // keep s <= t + window_right (-1 = unbounded)
};

// A broadcastable 4-D [b, n, t, s] tensor: element strides, 0 on broadcast dims.
template <typename T>
struct Broadcast4D {
  const T* data = nullptr;  // nullptr = absent
  int64_t stride_b = 0, stride_n = 0, stride_t = 0, stride_s = 0;
};

struct ForwardArgs {
  AttentionShape shape;
  MaskSpec spec;
  DType dtype = DType::kBF16;
  const void* q = nullptr;  // [B, T, N, H], contiguous
  const void* k = nullptr;  // [B, S, K, H]
  const void* v = nullptr;  // [B, S, K, H]
  Broadcast4D<float> bias;     // additive, after scale/softcap
  Broadcast4D<uint8_t> mask;   // nonzero = keep
  const int32_t* q_seqlens = nullptr;   // [B]
  const int32_t* kv_seqlens = nullptr;  // [B]
  void* out = nullptr;   // [B, T, N, H]
  float* lse = nullptr;  // [B, N, T], natural log, -inf for rows with no kept key
};

struct BackwardArgs {
  ForwardArgs fwd;            // inputs as in the forward; fwd.out / fwd.lse are read, not written
  const void* dout = nullptr; // [B, T, N, H]
  void* dq = nullptr;         // [B, T, N, H]
  void* dk = nullptr;         // [B, S, K, H]
  void* dv = nullptr;         // [B, S, K, H]
  float* dbias = nullptr;     // [B, N, T, S] full gradient of the bias term, or nullptr
};

}  // namespace jax_flash
