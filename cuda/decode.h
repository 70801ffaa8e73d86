// Split-KV decoding ("Flash-Decoding") over a contiguous or paged KV cache.
//
// One launch computes attention for a few query rows per sequence (T small) against a long
// cache. The key range of each (sequence, kv head) is cut into `num_splits` pieces, one thread
// block each; every block packs all query rows that read its kv head (T rows x N/K query heads)
// into one tile, so each cache byte is read from memory once. Blocks write a partial
// (out, logsumexp) per split; the last block of a (sequence, kv head) to finish (an arrival
// counter tells) merges them with the logsumexp identity, so one launch does everything. With
// one split the block writes the result directly.
//
// Which keys a query row sees (all conditions are intervals in the key position s):
//   s < kv_len[b]                                  (the valid prefix of the cache)
//   query row t sits at position  qpos = t + (causal_from_end ? kv_len[b] - T : 0)
//   is_causal:         s <= qpos
//   window_left >= 0:  s >= qpos - window_left
//   window_right >= 0: s <= qpos + window_right
//   t < q_seqlens[b]   (when given; other rows give out 0, lse -inf)
// kv_len[b] = min(max(cache_seqlens[b], 0), capacity) + (k_new ? T : 0).
// causal_from_end = true is flash_decode's contract (the T new tokens are the last T positions);
// false is the top-left convention of docs/architecture.md.
//
// Appending (k_new != nullptr): rows k_new[b, t] / v_new[b, t] are stored at cache position
// cache_len[b] + t of the caches k / v (in place), and attention reads those keys straight from
// k_new, so the store and the reads never touch the same memory in one launch. Positions at or
// past the capacity, and pages whose id is outside [0, num_pages), are neither read nor written.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "attention_args.h"

namespace jax_flash {

struct DecodeArgs {
  // Sizes. Query rows per block tile = q_len * (num_heads / num_kv_heads).
  int32_t batch = 0;         // B
  int32_t q_len = 0;         // T
  int32_t num_heads = 0;     // N
  int32_t num_kv_heads = 0;  // K
  int32_t head_dim = 0;      // H: 64, 128 or 256
  DType dtype = DType::kBF16;  // kBF16 or kF16

  // Scores and masking (see the header comment).
  float scale = 1.f;
  float softcap = 0.f;  // 0 = off
  bool is_causal = true;
  bool causal_from_end = true;
  int32_t window_left = -1;
  int32_t window_right = -1;

  const void* q = nullptr;  // [B, T, N, H]
  // The cache: contiguous [B, capacity, K, H] (block_table == nullptr) or pages
  // [num_pages, page_size, K, H] with block_table [B, max_pages] (capacity = max_pages *
  // page_size). With an append these are also written.
  void* k = nullptr;
  void* v = nullptr;
  int64_t capacity = 0;
  const int32_t* block_table = nullptr;
  int32_t max_pages = 0;
  int32_t page_size_log2 = 0;  // page size is a power of two
  int64_t num_pages = 0;
  const int32_t* cache_seqlens = nullptr;  // [B] keys in the cache (before any append)
  const int32_t* q_seqlens = nullptr;      // [B] valid query rows, or nullptr = all T
  const void* k_new = nullptr;             // [B, T, K, H] or nullptr (no append)
  const void* v_new = nullptr;

  void* out = nullptr;   // [B, T, N, H]
  float* lse = nullptr;  // [B, N, T] natural log, -inf for rows that see no key

  // Split-KV workspaces (used when num_splits > 1): partial outputs [num_splits, B, T, N, H],
  // partial logsumexps [num_splits, B, N, T], arrival counters (DecodeCounterCount ints, zeroed
  // by LaunchDecode with a memset before the kernel).
  int32_t num_splits = 1;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  int32_t* counters = nullptr;
};

// Head dims and dtypes the kernels are built for.
bool DecodeSupports(int64_t head_dim, DType dtype);

// Query rows one thread block holds; more rows per kv head are spread over several blocks.
constexpr int kDecodeMaxRowsPerBlock = 64;

// Arrival counters one launch needs (zeroed by LaunchDecode itself).
int64_t DecodeCounterCount(const DecodeArgs& args);

// The split count for `args` (its num_splits ignored): one block per multiprocessor of the
// current device when that keeps at least 90% of them busy (not for pages under 64 rows), else
// enough splits that one wave fills every block slot (multiprocessors x resident blocks of this
// kernel); no split shorter than 4 key tiles of 64, at most max_splits. `max_keys` bounds the
// key range of a sequence (capacity, plus T when appending).
cudaError_t DecodeAutoSplits(const DecodeArgs& args, int64_t max_keys, int max_splits,
                             int* splits);

// Enqueues the decoding of `args` on `stream`; returns the first CUDA error (launch
// configuration included). cudaErrorInvalidValue for an unsupported head dim / dtype.
cudaError_t LaunchDecode(const DecodeArgs& args, cudaStream_t stream);

}  // namespace jax_flash
