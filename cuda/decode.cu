// Split-KV decoding kernels (decode.h has the contract).
//
// Block = 4 warps = one (sequence b, kv head, row block, split). The block's query rows (up to
// 64: T x group packed, padded to 16-row tiles) stay in shared memory / registers while the
// split's keys stream through a cp.async ring of kStages tiles of 64 keys (16-byte copies into
// an XOR-swizzled layout). The warps of one row tile divide each key tile among themselves
// (each keeps its own online-softmax state) and merge through shared memory at the end, so a
// single 16-row tile still keeps all 4 warps busy. Scores and P·V run on mma.sync m16n8k16
// (bf16 / f16 in, f32 accumulate): decode is bandwidth-bound and the tensor cores make the
// arithmetic of the padded rows free.
#include "decode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "device_attribute.h"
#include "tile.cuh"

namespace jax_flash {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockKeys = 64;  // keys per pipeline stage
using tile::cp_async_commit;
using tile::cp_async_wait;
using tile::fast_exp2;
using tile::quad_max;
using tile::quad_sum;
template <typename Elem>
using ElemOps = tile::Element<Elem>;

// Copies 16 bytes global -> shared (zeros when !valid) / loads fragments at a generic smem pointer.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  tile::cp_async_16(tile::smem_address(dst), src, valid);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  tile::ldmatrix_x4(r, tile::smem_address(p));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  tile::ldmatrix_x4_trans(r, tile::smem_address(p));
}

template <int kHeadDim, int kRowTiles>
struct Tiling {
  static constexpr int kRows = 16 * kRowTiles;           // query rows per block
  static constexpr int kKeySlices = kWarps / kRowTiles;  // warps sharing one row tile
  static constexpr int kWarpKeys = kBlockKeys / kKeySlices;
  static constexpr int kChunks = kHeadDim / 8;           // 16-byte chunks per row
  // 3 stages for H = 128 (100 KB: 2 blocks per SM) measured faster than 2 stages (3 blocks per
  // SM) and than 4 (1 block per SM) on the H200.
  static constexpr int kStages = kHeadDim <= 64 ? 4 : 3;
  static constexpr int kTileElems = kBlockKeys * kHeadDim;
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  static constexpr int kMergeStride = kHeadDim + 4;  // f32 row pitch of the merge buffer
  static constexpr size_t kPipeBytes = size_t(kStages) * 2 * kTileElems * 2;
  static constexpr size_t kMergeBytes =
      size_t(kKeySlices) * kRows * (kMergeStride + 2) * sizeof(float);
  static constexpr size_t kSmemBytes =
      size_t(kRows) * kHeadDim * 2 + (kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes);
  static_assert(kWarpKeys >= 16 && kWarpKeys % 16 == 0, "a warp needs whole 16-key mma steps");
};

// ---- warp-wide reductions (the quad ones and the PTX wrappers come from tile.cuh) ----------

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Element offset of row (key position) `pos` of the swizzled [rows][kHeadDim] smem tile, chunk c.
template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// ---- the sequence view ---------------------------------------------------------------------

// What one block knows about its sequence: lengths and where cache rows live.
struct Sequence {
  int b, kv_head;
  int cache_len;  // rows taken from the cache; positions >= cache_len come from k_new
  int kv_len;     // keys of the sequence (cache_len + appended rows)
  int q_valid;    // query rows that exist (others see no key)
};

__device__ Sequence sequence_of(const DecodeArgs& a, int b, int kv_head) {
  Sequence s;
  s.b = b;
  s.kv_head = kv_head;
  long long cache = a.cache_seqlens[b];
  cache = cache < 0 ? 0 : (cache > a.capacity ? a.capacity : cache);
  s.cache_len = static_cast<int>(cache);
  s.kv_len = s.cache_len + (a.k_new != nullptr ? a.q_len : 0);
  int q_valid = a.q_seqlens != nullptr ? a.q_seqlens[b] : a.q_len;
  s.q_valid = q_valid < 0 ? 0 : (q_valid > a.q_len ? a.q_len : q_valid);
  return s;
}

// Element offset of cache row `pos` (< capacity) for the block's kv head; -1 if its page is not
// a valid page id.
__device__ __forceinline__ int64_t cache_row(const DecodeArgs& a, const Sequence& s, int pos) {
  int64_t row;
  if (a.block_table != nullptr) {
    const int page = __ldg(a.block_table + int64_t(s.b) * a.max_pages + (pos >> a.page_size_log2));
    if (page < 0 || page >= a.num_pages) return -1;
    row = (int64_t(page) << a.page_size_log2) + (pos & ((1 << a.page_size_log2) - 1));
  } else {
    row = int64_t(s.b) * a.capacity + pos;
  }
  return (row * a.num_kv_heads + s.kv_head) * a.head_dim;
}

// Key interval [lo, hi) that query row t sees (docs in decode.h).
struct KeyInterval {
  int lo, hi;
};

__device__ __forceinline__ KeyInterval keys_of_row(const DecodeArgs& a, const Sequence& s, int t) {
  if (t >= s.q_valid) return {0, 0};
  const int qpos = t + (a.causal_from_end ? s.kv_len - a.q_len : 0);
  int lo = 0, hi = s.kv_len;
  if (a.is_causal) hi = min(hi, qpos + 1);
  if (a.window_left >= 0) lo = max(lo, qpos - a.window_left);
  if (a.window_right >= 0) hi = min(hi, qpos + a.window_right + 1);
  return {lo, max(lo, hi)};
}

// ---- the split-KV kernel -------------------------------------------------------------------

template <typename Elem, int kHeadDim, int kRowTiles>
struct SplitKv {
  using Tile = Tiling<kHeadDim, kRowTiles>;
  static constexpr int kRows = Tile::kRows;
  static constexpr int kChunks = Tile::kChunks;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kWarpKeys = Tile::kWarpKeys;
  static constexpr int kKeyTiles = kWarpKeys / 8;  // n8 score tiles per warp
  static constexpr int kDimSteps = kHeadDim / 16;  // k16 steps of Q·Kᵀ
  static constexpr int kOutTiles = kHeadDim / 8;   // n8 output tiles

  const DecodeArgs& a;
  const Sequence seq;
  const int group;       // query heads per kv head
  const int rows;        // query rows of this kv head (T * group)
  const int row0;        // first row of this block
  Elem* const sQ;        // [kRows][kHeadDim] swizzled
  Elem* const sPipe;     // kStages x (K tile, V tile), each [kBlockKeys][kHeadDim] swizzled
  const int tid, warp, lane;

  __device__ Elem* k_tile(int stage) const { return sPipe + stage * 2 * Tile::kTileElems; }
  __device__ Elem* v_tile(int stage) const { return k_tile(stage) + Tile::kTileElems; }

  // Block-row r -> (query position t, query head n); false for padding rows.
  __device__ bool row_coords(int r, int& t, int& n) const {
    const int gr = row0 + r;
    if (gr >= rows) return false;
    t = gr / group;
    n = seq.kv_head * group + gr % group;
    return true;
  }

  __device__ void load_query() const {
    for (int i = tid; i < kRows * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      int t = 0, n = 0;
      const bool real = row_coords(r, t, n);
      const Elem* src = static_cast<const Elem*>(a.q) +
                        ((int64_t(seq.b) * a.q_len + t) * a.num_heads + n) * kHeadDim + c * 8;
      cp_async_16(sQ + swizzled<kHeadDim>(r, c), src, real);
    }
  }

  // This thread's 16-byte chunk of row 0 of each source; a key row is row_stride elements apart.
  // Row index math per key is one multiply (plus a page-table load when paged).
  struct RowStream {
    const Elem* k_cache;    // contiguous: row 0 of sequence b; paged: row 0 of the page pool
    const Elem* v_cache;
    const Elem* k_new;      // appended row 0 of sequence b
    const Elem* v_new;
    const int32_t* pages;   // block_table row of sequence b (paged)
    int64_t row_stride;     // K * H
  };

  __device__ RowStream row_stream() const {
    const int64_t row_stride = int64_t(a.num_kv_heads) * kHeadDim;
    const int64_t chunk = int64_t(seq.kv_head) * kHeadDim + (tid % kChunks) * 8;
    const int64_t seq_rows = a.block_table != nullptr ? 0 : int64_t(seq.b) * a.capacity;
    const int64_t new_rows = int64_t(seq.b) * a.q_len;
    RowStream st;
    st.k_cache = static_cast<const Elem*>(a.k) + seq_rows * row_stride + chunk;
    st.v_cache = static_cast<const Elem*>(a.v) + seq_rows * row_stride + chunk;
    const bool appends = a.k_new != nullptr;
    st.k_new = appends ? static_cast<const Elem*>(a.k_new) + new_rows * row_stride + chunk : nullptr;
    st.v_new = appends ? static_cast<const Elem*>(a.v_new) + new_rows * row_stride + chunk : nullptr;
    st.pages = a.block_table != nullptr ? a.block_table + int64_t(seq.b) * a.max_pages : nullptr;
    st.row_stride = row_stride;
    return st;
  }

  // Copies a tile whose kBlockKeys rows are consecutive cache rows starting at k_row / v_row
  // (this thread's chunk): one pointer step per row.
  __device__ void load_consecutive_rows(const RowStream& st, const Elem* k_row, const Elem* v_row,
                                        int stage) const {
    constexpr int kRowStep = kThreads / kChunks;
    const int c = tid % kChunks;
    const int64_t step = kRowStep * st.row_stride;
    const int64_t first = (tid / kChunks) * st.row_stride;
    Elem* sk = k_tile(stage);
    Elem* sv = v_tile(stage);
#pragma unroll
    for (int i = 0; i < kBlockKeys / kRowStep; ++i) {
      const int r = tid / kChunks + i * kRowStep;
      cp_async_16(sk + swizzled<kHeadDim>(r, c), k_row + first + i * step, true);
      cp_async_16(sv + swizzled<kHeadDim>(r, c), v_row + first + i * step, true);
    }
  }

  // Any tile: per row, the end of the key range, appended rows and (kPaged) the page table.
  // Keys >= end and rows of invalid pages read as zeros.
  template <bool kPaged>
  __device__ void load_rows_one_by_one(const RowStream& st, int first, int end,
                                       int stage) const {
    constexpr int kRowStep = kThreads / kChunks;
    constexpr int kRowsPerThread = kBlockKeys / kRowStep;
    const int c = tid % kChunks;
    Elem* sk = k_tile(stage);
    Elem* sv = v_tile(stage);
    // Every page-table read of the tile is issued before the first copy needs one: one table
    // round trip per tile, not one per row.
    int pages[kRowsPerThread];
    if constexpr (kPaged) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int pos = first + tid / kChunks + i * kRowStep;
        pages[i] = pos < end && pos < seq.cache_len ? __ldg(st.pages + (pos >> a.page_size_log2)) : 0;
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = tid / kChunks + i * kRowStep;
      const int pos = first + r;
      bool live = pos < end;
      const Elem* k_src = st.k_cache;
      const Elem* v_src = st.v_cache;
      int row = pos;
      if (live && pos >= seq.cache_len) {
        k_src = st.k_new;
        v_src = st.v_new;
        row = pos - seq.cache_len;
      } else if constexpr (kPaged) {
        const int page = pages[i];
        live = live && page >= 0 && page < a.num_pages;
        row = (page << a.page_size_log2) | (pos & ((1 << a.page_size_log2) - 1));
      }
      const int64_t off = live ? int64_t(row) * st.row_stride : 0;
      cp_async_16(sk + swizzled<kHeadDim>(r, c), k_src + off, live);
      cp_async_16(sv + swizzled<kHeadDim>(r, c), v_src + off, live);
    }
  }

  // Issues the copies of keys [first, first + kBlockKeys) (first is a multiple of kBlockKeys).
  // Most tiles lie inside the cached prefix, and inside one page when pages hold >= kBlockKeys
  // rows: those take the per-tile address path; the rest go row by row.
  __device__ void load_keys(const RowStream& st, int first, int end, int stage) const {
    const bool whole = first + kBlockKeys <= min(end, seq.cache_len);
    if (a.block_table == nullptr) {
      if (whole) {
        const int64_t row = int64_t(first) * st.row_stride;
        load_consecutive_rows(st, st.k_cache + row, st.v_cache + row, stage);
      } else {
        load_rows_one_by_one<false>(st, first, end, stage);
      }
      return;
    }
    if (whole && (1 << a.page_size_log2) >= kBlockKeys) {
      const int page = __ldg(st.pages + (first >> a.page_size_log2));
      if (page >= 0 && page < a.num_pages) {
        const int64_t row =
            ((int64_t(page) << a.page_size_log2) + (first & ((1 << a.page_size_log2) - 1))) *
            st.row_stride;
        load_consecutive_rows(st, st.k_cache + row, st.v_cache + row, stage);
        return;
      }
    }
    load_rows_one_by_one<true>(st, first, end, stage);
  }

  // Stores the appended rows into the cache (done once per (sequence, kv head)).
  __device__ void store_appended_rows() const {
    for (int i = tid; i < a.q_len * kChunks; i += kThreads) {
      const int t = i / kChunks, c = i % kChunks;
      const int pos = seq.cache_len + t;
      if (pos >= a.capacity) continue;
      const int64_t dst = cache_row(a, seq, pos);
      if (dst < 0) continue;
      const int64_t src =
          ((int64_t(seq.b) * a.q_len + t) * a.num_kv_heads + seq.kv_head) * kHeadDim + c * 8;
      const uint4 kv = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(a.k_new) + src);
      const uint4 vv = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(a.v_new) + src);
      *reinterpret_cast<uint4*>(static_cast<Elem*>(a.k) + dst + c * 8) = kv;
      *reinterpret_cast<uint4*>(static_cast<Elem*>(a.v) + dst + c * 8) = vv;
    }
  }

  // ---- per-warp online softmax state ----
  int row_tile, key_slice;
  KeyInterval row_keys[2];  // the two rows this thread holds: lane/4 and lane/4 + 8
  float row_max[2];         // running max of the scores in log2 units (-inf: nothing seen)
  float row_sum[2];         // running sum of exp2(score - max), thread-partial
  float acc[kOutTiles][4];  // unnormalized output rows, mma C layout
  uint32_t q_frag[Tile::kQInRegisters ? kDimSteps : 1][4];

  __device__ void query_fragment(int kk, uint32_t (&frag)[4]) const {
    const int r = row_tile * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    ldmatrix_x4(frag, sQ + swizzled<kHeadDim>(r, kk * 2 + (lane >> 4)));
  }

  // Q·Kᵀ of this warp's keys. With few key tiles per warp the mma chain over the head dim is
  // the critical path, so even and odd dim steps accumulate separately.
  __device__ void scores(int stage, float (&s)[kKeyTiles][4]) const {
    constexpr int kChains = kKeyTiles <= 2 ? 2 : 1;
    const Elem* sk = k_tile(stage);
    float part[kChains][kKeyTiles][4];
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j)
        part[c][j][0] = part[c][j][1] = part[c][j][2] = part[c][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kDimSteps; ++kk) {
      uint32_t qa[4];
      if constexpr (Tile::kQInRegisters) {
#pragma unroll
        for (int i = 0; i < 4; ++i) qa[i] = q_frag[kk][i];
      } else {
        query_fragment(kk, qa);
      }
#pragma unroll
      for (int j = 0; j < kKeyTiles; j += 2) {
        const int key = key_slice * kWarpKeys + j * 8 + (lane & 7) + (lane >> 4) * 8;
        uint32_t kb[4];
        ldmatrix_x4(kb, sk + swizzled<kHeadDim>(key, kk * 2 + ((lane >> 3) & 1)));
        ElemOps<Elem>::mma(part[kk % kChains][j], qa, kb[0], kb[1]);
        ElemOps<Elem>::mma(part[kk % kChains][j + 1], qa, kb[2], kb[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = kChains == 2 ? part[0][j][e] + part[kChains - 1][j][e] : part[0][j][e];
  }

  // q·k -> final score in log2 units (scale, softcap); -inf where the key is not kept. The
  // softcap and mask branches are uniform, outside the element loops.
  __device__ void finish_scores(float (&s)[kKeyTiles][4], int first, bool masked) const {
    if (a.softcap > 0.f) {
      const float cap_log2 = a.softcap * kLog2e;
      const float scale_over_cap = a.scale / a.softcap;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = cap_log2 * tanhf(s[j][e] * scale_over_cap);
    } else {
      const float scale_log2 = a.scale * kLog2e;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
    }
    if (!masked) return;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = first + key_slice * kWarpKeys + j * 8 + (lane & 3) * 2 + (e & 1);
        const KeyInterval& iv = row_keys[e >> 1];
        if (key < iv.lo || key >= iv.hi) s[j][e] = -INFINITY;
      }
    }
  }

  // Online softmax update with one tile of scores, then acc += P·V.
  __device__ void accumulate(int stage, float (&s)[kKeyTiles][4]) {
    float rescale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = row_max[h];
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) m = fmaxf(m, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      m = quad_max(m);
      const float m_used = m == -INFINITY ? 0.f : m;
      rescale[h] = fast_exp2(row_max[h] - m_used);
      row_max[h] = m;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[j][e] = fast_exp2(s[j][e] - m_used);
          sum += s[j][e];
        }
      }
      row_sum[h] = row_sum[h] * rescale[h] + sum;
    }
    // Once the running max settles most tiles move no row's max: skip the rescale then.
    if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
      for (int d = 0; d < kOutTiles; ++d) {
        acc[d][0] *= rescale[0];
        acc[d][1] *= rescale[0];
        acc[d][2] *= rescale[1];
        acc[d][3] *= rescale[1];
      }
    }
    const Elem* sv = v_tile(stage);
#pragma unroll
    for (int kp = 0; kp < kWarpKeys / 16; ++kp) {
      uint32_t pa[4];
      pa[0] = ElemOps<Elem>::pack(s[2 * kp][0], s[2 * kp][1]);
      pa[1] = ElemOps<Elem>::pack(s[2 * kp][2], s[2 * kp][3]);
      pa[2] = ElemOps<Elem>::pack(s[2 * kp + 1][0], s[2 * kp + 1][1]);
      pa[3] = ElemOps<Elem>::pack(s[2 * kp + 1][2], s[2 * kp + 1][3]);
      const int key = key_slice * kWarpKeys + kp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int d = 0; d < kOutTiles; d += 2) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sv + swizzled<kHeadDim>(key, d + (lane >> 4)));
        ElemOps<Elem>::mma(acc[d], pa, vb[0], vb[1]);
        ElemOps<Elem>::mma(acc[d + 1], pa, vb[2], vb[3]);
      }
    }
  }

  __device__ SplitKv(const DecodeArgs& args, const Sequence& s, int row_block, Elem* smem)
      : a(args),
        seq(s),
        group(args.num_heads / args.num_kv_heads),
        rows(args.q_len * (args.num_heads / args.num_kv_heads)),
        row0(row_block * kRows),
        sQ(smem),
        sPipe(smem + kRows * kHeadDim),
        tid(threadIdx.x),
        warp(threadIdx.x / 32),
        lane(threadIdx.x % 32) {
    row_tile = warp / Tile::kKeySlices;
    key_slice = warp % Tile::kKeySlices;
    for (int h = 0; h < 2; ++h) {
      int t = 0, n = 0;
      row_keys[h] = row_coords(row_tile * 16 + lane / 4 + 8 * h, t, n) ? keys_of_row(a, seq, t)
                                                                        : KeyInterval{0, 0};
      row_max[h] = -INFINITY;
      row_sum[h] = 0.f;
    }
#pragma unroll
    for (int d = 0; d < kOutTiles; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
  }

  // Keys any row of the block sees (hull), and keys every row sees (no masking needed).
  __device__ void block_key_range(KeyInterval& hull, KeyInterval& common) const {
    hull = {INT32_MAX, 0};
    common = {0, INT32_MAX};
    for (int r = 0; r < kRows; ++r) {
      int t = 0, n = 0;
      if (!row_coords(r, t, n)) break;
      const KeyInterval iv = keys_of_row(a, seq, t);
      if (iv.lo < iv.hi) {
        hull.lo = min(hull.lo, iv.lo);
        hull.hi = max(hull.hi, iv.hi);
      }
      common.lo = max(common.lo, iv.lo);
      common.hi = min(common.hi, iv.hi);
    }
    if (hull.lo >= hull.hi) hull = {0, 0};
  }

  // Streams this split's keys through the pipeline.
  __device__ void run(int split, int num_splits) {
    KeyInterval hull, common;
    block_key_range(hull, common);
    // Tiles sit at multiples of kBlockKeys (keys below hull.lo in the first one are masked).
    const int tile0 = hull.lo / kBlockKeys * kBlockKeys;
    const int tiles = (hull.hi - tile0 + kBlockKeys - 1) / kBlockKeys;
    const int per_split = (tiles + num_splits - 1) / num_splits;
    const int first_tile = min(tiles, split * per_split);
    const int num_tiles = min(tiles, first_tile + per_split) - first_tile;
    const int first_key = tile0 + first_tile * kBlockKeys;

    const RowStream stream = row_stream();
    load_query();
    cp_async_commit();
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < num_tiles) load_keys(stream, first_key + st * kBlockKeys, hull.hi, st);
      cp_async_commit();
    }
    if constexpr (Tile::kQInRegisters) {
      cp_async_wait<kStages - 1>();
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kDimSteps; ++kk) query_fragment(kk, q_frag[kk]);
    }
    for (int i = 0; i < num_tiles; ++i) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile i landed for everyone; everyone is done with tile i - 1
      const int next = i + kStages - 1;
      if (next < num_tiles)
        load_keys(stream, first_key + next * kBlockKeys, hull.hi, next % kStages);
      cp_async_commit();
      const int first = first_key + i * kBlockKeys;
      const bool masked = first < common.lo || first + kBlockKeys > common.hi;
      float s[kKeyTiles][4];
      scores(i % kStages, s);
      finish_scores(s, first, masked);
      accumulate(i % kStages, s);
    }
    cp_async_wait<0>();
    __syncthreads();  // the pipeline buffers become the merge buffer
  }

  // Merges the key slices of each row tile and writes out / lse (or this split's partials).
  __device__ void write_result(int split) const {
    float* merge = reinterpret_cast<float*>(sPipe);  // [kKeySlices][kRows][kMergeStride]
    float* slice_max = merge + Tile::kKeySlices * kRows * Tile::kMergeStride;
    float* slice_sum = slice_max + Tile::kKeySlices * kRows;
    const int base = key_slice * kRows + row_tile * 16 + lane / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(row_sum[h]);
      if ((lane & 3) == 0) {
        slice_max[base + 8 * h] = row_max[h];
        slice_sum[base + 8 * h] = sum;
      }
#pragma unroll
      for (int d = 0; d < kOutTiles; ++d) {
        float2 v = make_float2(acc[d][2 * h], acc[d][2 * h + 1]);
        *reinterpret_cast<float2*>(merge + (base + 8 * h) * Tile::kMergeStride + d * 8 +
                                   (lane & 3) * 2) = v;
      }
    }
    __syncthreads();
    // One thread per row: weight of each slice (exp2 offset / total), logsumexp of the row.
    if (tid < kRows) {
      float m = -INFINITY;
      for (int k = 0; k < Tile::kKeySlices; ++k) m = fmaxf(m, slice_max[k * kRows + tid]);
      const float m_used = m == -INFINITY ? 0.f : m;
      float total = 0.f;
      for (int k = 0; k < Tile::kKeySlices; ++k) {
        const float w = fast_exp2(slice_max[k * kRows + tid] - m_used);
        slice_max[k * kRows + tid] = w;  // now the slice's weight
        total += w * slice_sum[k * kRows + tid];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int k = 0; k < Tile::kKeySlices; ++k) slice_max[k * kRows + tid] *= inv;
      int t = 0, n = 0;
      if (row_coords(tid, t, n)) {
        const float lse = total > 0.f ? (m_used + log2f(total)) * kLn2 : -INFINITY;
        const int64_t i = (int64_t(seq.b) * a.num_heads + n) * a.q_len + t;
        if (a.num_splits > 1)
          a.partial_lse[int64_t(split) * a.batch * a.num_heads * a.q_len + i] = lse;
        else
          a.lse[i] = lse;
      }
    }
    __syncthreads();
    for (int i = tid; i < kRows * kHeadDim / 4; i += kThreads) {
      const int r = i / (kHeadDim / 4), c = (i % (kHeadDim / 4)) * 4;
      int t = 0, n = 0;
      if (!row_coords(r, t, n)) continue;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k = 0; k < Tile::kKeySlices; ++k) {
        const float w = slice_max[k * kRows + r];
        const float4 v =
            *reinterpret_cast<const float4*>(merge + (k * kRows + r) * Tile::kMergeStride + c);
        o.x += w * v.x;
        o.y += w * v.y;
        o.z += w * v.z;
        o.w += w * v.w;
      }
      const int64_t dst = ((int64_t(seq.b) * a.q_len + t) * a.num_heads + n) * kHeadDim + c;
      if (a.num_splits > 1) {
        *reinterpret_cast<float4*>(a.partial_out +
                                   int64_t(split) * a.batch * a.q_len * a.num_heads * kHeadDim +
                                   dst) = o;
      } else {
        uint2 packed = make_uint2(ElemOps<Elem>::pack(o.x, o.y), ElemOps<Elem>::pack(o.z, o.w));
        *reinterpret_cast<uint2*>(static_cast<Elem*>(a.out) + dst) = packed;
      }
    }
  }
};

// ---- merging the splits ----------------------------------------------------------------------

// One warp merges the num_splits partials of query row (b, t, n) into out / lse.
template <typename Elem, int kHeadDim>
__device__ void merge_splits_of_row(const DecodeArgs& a, int b, int t, int n, int lane) {
  constexpr int kPerLane = kHeadDim / 32;
  const int splits = a.num_splits;
  const int64_t lse_stride = int64_t(a.batch) * a.num_heads * a.q_len;
  const int64_t out_stride = lse_stride * kHeadDim;
  const int64_t lse_at = (int64_t(b) * a.num_heads + n) * a.q_len + t;
  const int64_t out_at = ((int64_t(b) * a.q_len + t) * a.num_heads + n) * kHeadDim + lane * kPerLane;
  float m = -INFINITY;
  for (int j = lane; j < splits; j += 32) m = fmaxf(m, __ldcg(a.partial_lse + j * lse_stride + lse_at));
  m = warp_max(m);
  float total = 0.f;
  if (m != -INFINITY) {
    for (int j = lane; j < splits; j += 32)
      total += expf(__ldcg(a.partial_lse + j * lse_stride + lse_at) - m);
    total = warp_sum(total);
  }
  const float lse = total > 0.f ? m + logf(total) : -INFINITY;
  // The partial rows are read in batches whose loads are all in flight at once: one L2 round
  // trip per batch, not per split (the tail of the kernel waits on this).
  constexpr int kBatch = kHeadDim <= 128 ? 16 : 8;
  float o[kPerLane] = {};
  if (total > 0.f) {
    for (int j0 = 0; j0 < splits; j0 += 32) {
      const int j = j0 + lane;
      const float w = j < splits ? expf(__ldcg(a.partial_lse + j * lse_stride + lse_at) - lse) : 0.f;
      const int count = min(32, splits - j0);
      for (int jb = 0; jb < count; jb += kBatch) {
        float2 v[kBatch][kPerLane / 2];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int jj = min(jb + u, count - 1);  // past the end: a repeat, weighted 0 below
          const float* src = a.partial_out + (j0 + jj) * out_stride + out_at;
#pragma unroll
          for (int e = 0; e < kPerLane; e += 2)
            v[u][e / 2] = __ldcg(reinterpret_cast<const float2*>(src + e));
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const float wj = __shfl_sync(0xffffffffu, w, (jb + u) & 31);
          const float weight = jb + u < count ? wj : 0.f;
#pragma unroll
          for (int e = 0; e < kPerLane; e += 2) {
            o[e] += weight * v[u][e / 2].x;
            o[e + 1] += weight * v[u][e / 2].y;
          }
        }
      }
    }
  }
  Elem* dst = static_cast<Elem*>(a.out) + out_at;
#pragma unroll
  for (int e = 0; e < kPerLane; e += 2)
    *reinterpret_cast<uint32_t*>(dst + e) = ElemOps<Elem>::pack(o[e], o[e + 1]);
  if (lane == 0) a.lse[lse_at] = lse;
}

template <typename Elem, int kHeadDim, int kRowTiles>
__global__ void __launch_bounds__(kThreads) split_kv_kernel(const __grid_constant__ DecodeArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int row_blocks = (a.q_len * (a.num_heads / a.num_kv_heads) + 16 * kRowTiles - 1) /
                         (16 * kRowTiles);
  const int kv_head = blockIdx.x / row_blocks, row_block = blockIdx.x % row_blocks;
  const int split = blockIdx.y;
  const Sequence seq = sequence_of(a, blockIdx.z, kv_head);
  SplitKv<Elem, kHeadDim, kRowTiles> work(a, seq, row_block, reinterpret_cast<Elem*>(smem));
  if (a.k_new != nullptr && split == 0 && row_block == 0) work.store_appended_rows();
  work.run(split, a.num_splits);
  work.write_result(split);
  if (a.num_splits == 1) return;

  // The last block of this (sequence, kv head, row block) to arrive merges the splits.
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  int32_t* counter = a.counters + (int64_t(blockIdx.z) * a.num_kv_heads + kv_head) * row_blocks +
                     row_block;
  if (threadIdx.x == 0) {
    is_last = atomicAdd(counter, 1) == a.num_splits - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int r = work.warp; r < 16 * kRowTiles; r += kWarps) {
    int t = 0, n = 0;
    if (work.row_coords(r, t, n)) merge_splits_of_row<Elem, kHeadDim>(a, seq.b, t, n, work.lane);
  }
}

// ---- launch ----------------------------------------------------------------------------

int row_tiles_for(const DecodeArgs& a) {
  const int rows = a.q_len * (a.num_heads / a.num_kv_heads);
  return rows <= 16 ? 1 : rows <= 32 ? 2 : 4;
}

// One compiled instantiation: its kernels and launch geometry.
template <typename Elem, int kHeadDim, int kRowTiles>
struct Variant {
  static constexpr int kRows = 16 * kRowTiles;
  static constexpr size_t kSmemBytes = Tiling<kHeadDim, kRowTiles>::kSmemBytes;
  static constexpr auto split_kv = split_kv_kernel<Elem, kHeadDim, kRowTiles>;

  static int row_blocks(const DecodeArgs& a) {
    return (a.q_len * (a.num_heads / a.num_kv_heads) + kRows - 1) / kRows;
  }
  static cudaError_t prepare() {
    return cudaFuncSetAttribute(split_kv, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(kSmemBytes));
  }
};

// Calls f(Variant<...>{}) for the instantiation that serves `a`.
template <typename Elem, int kHeadDim, typename F>
cudaError_t visit_rows(const DecodeArgs& a, F& f) {
  switch (row_tiles_for(a)) {
    case 1: return f(Variant<Elem, kHeadDim, 1>{});
    case 2: return f(Variant<Elem, kHeadDim, 2>{});
    default: return f(Variant<Elem, kHeadDim, 4>{});
  }
}

template <typename Elem, typename F>
cudaError_t visit_head_dim(const DecodeArgs& a, F& f) {
  switch (a.head_dim) {
    case 64: return visit_rows<Elem, 64>(a, f);
    case 128: return visit_rows<Elem, 128>(a, f);
    default: return visit_rows<Elem, 256>(a, f);
  }
}

bool shape_is_valid(const DecodeArgs& a) {
  return DecodeSupports(a.head_dim, a.dtype) && a.num_kv_heads > 0 && a.batch > 0 &&
         a.q_len > 0 && a.num_heads % a.num_kv_heads == 0;
}

template <typename F>
cudaError_t visit_variant(const DecodeArgs& a, F&& f) {
  if (!shape_is_valid(a)) return cudaErrorInvalidValue;
  return tile::dispatch_dtype(a.dtype,
                              [&](auto elem) { return visit_head_dim<decltype(elem)>(a, f); });
}

// Splits no shorter than this many key tiles: shorter ones spend more on the pipeline fill
// and the merge than they save.
constexpr int kMinTilesPerSplit = 4;

}  // namespace

bool DecodeSupports(int64_t head_dim, DType dtype) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
         (dtype == DType::kBF16 || dtype == DType::kF16);
}

int64_t DecodeCounterCount(const DecodeArgs& a) {
  int64_t count = 0;
  visit_variant(a, [&](auto v) {
    count = int64_t(a.batch) * a.num_kv_heads * decltype(v)::row_blocks(a);
    return cudaSuccess;
  });
  return count;
}

cudaError_t DecodeAutoSplits(const DecodeArgs& a, int64_t max_keys, int max_splits,
                             int* splits) {
  return visit_variant(a, [&](auto v) {
    using V = decltype(v);
    int sms = 0, blocks_per_sm = 0;
    cudaError_t err = current_device_attribute(cudaDevAttrMultiProcessorCount, &sms);
    if (err == cudaSuccess) err = V::prepare();
    if (err == cudaSuccess)
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, V::split_kv, kThreads,
                                                          V::kSmemBytes);
    if (err != cudaSuccess) return err;
    // Measured on the H200 (docs/perf-notes.md, decode 2026-11-30): one block per
    // multiprocessor (16 splits at B=1, 2 at B=8, K=8) is 1-10% faster than one wave that fills
    // both block slots of each (33 / 4 splits): half the partials to write and merge, and the
    // 64 KB one block keeps in flight suffice. A wave that leaves multiprocessors idle is slower
    // (3 splits at B=8: +10%), so below 90% of them busy the split count fills every slot. Pages
    // under 64 rows are loaded row by row (a table read per row), which one block per
    // multiprocessor does not hide (page 16: +35-50%): they keep the every-slot wave, where
    // they cost 2-3% over the contiguous cache.
    const int64_t heads = int64_t(a.batch) * a.num_kv_heads * V::row_blocks(a);
    const int64_t slots = int64_t(sms) * blocks_per_sm;
    const int64_t tiles = (max_keys + kBlockKeys - 1) / kBlockKeys;
    const bool rows_one_by_one =
        a.block_table != nullptr && (int64_t(1) << a.page_size_log2) < kBlockKeys;
    const int64_t per_sm = sms / heads;
    int64_t n = !rows_one_by_one && per_sm > 0 && heads * per_sm * 10 >= int64_t(sms) * 9
                    ? per_sm
                    : slots / heads;
    n = std::min<int64_t>(n, tiles / kMinTilesPerSplit);
    n = std::min<int64_t>(n, max_splits);
    *splits = int(std::max<int64_t>(n, 1));
    return cudaSuccess;
  });
}

cudaError_t LaunchDecode(const DecodeArgs& a, cudaStream_t stream) {
  if (a.num_splits < 1 || a.num_splits > 65535 || a.batch > 65535) return cudaErrorInvalidValue;
  if (a.num_splits > 1 &&
      (a.partial_out == nullptr || a.partial_lse == nullptr || a.counters == nullptr))
    return cudaErrorInvalidValue;
  return visit_variant(a, [&](auto v) {
    using V = decltype(v);
    cudaError_t err = V::prepare();
    if (err != cudaSuccess) return err;
    const int row_blocks = V::row_blocks(a);
    if (a.num_splits > 1) {
      err = cudaMemsetAsync(a.counters, 0,
                            size_t(a.batch) * a.num_kv_heads * row_blocks * sizeof(int32_t),
                            stream);
      if (err != cudaSuccess) return err;
    }
    const dim3 grid(a.num_kv_heads * row_blocks, a.num_splits, a.batch);
    V::split_kv<<<grid, kThreads, V::kSmemBytes, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace jax_flash
