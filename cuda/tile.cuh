// The small tile vocabulary the sm_80 tensor-core attention kernels are written in:
// async copies, ldmatrix / mma.sync (m16n8k16) wrappers, padded shared-memory tiles, the
// fragment layouts of a warp's operands, the score predicate (causal / window / seqlens / mask)
// and the per-row online-softmax state.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, q = lane % 4):
//   A (16x16): a0 = (g, 2q..2q+1)  a1 = (g+8, 2q..)  a2 = (g, 8+2q..)  a3 = (g+8, 8+2q..)
//   B (16x8):  b0 = (k 2q..2q+1, n g)                b1 = (k 8+2q.., n g)
//   C (16x8):  c0,c1 = (g, 2q..2q+1)                 c2,c3 = (g+8, 2q..2q+1)
// So the C fragments of n-tiles 2j and 2j+1 are, packed to 16 bits, the A fragment of k-step j:
// a probability tile never leaves registers on its way into the next product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "attention_args.h"
#include "softmax_constants.h"

namespace jax_flash::tile {

// "Unbounded" window side; lengths stay below 2^29 so sums of two never overflow an int.
constexpr int kUnbounded = 1 << 29;

// ---------------------------------------------------------------------------------------------
// Element types
// ---------------------------------------------------------------------------------------------

template <typename T>
struct Element;

template <>
struct Element<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Element<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Calls f.template operator()<T>() with the element type of `dtype` (bf16 or f16).
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBF16: return f(__nv_bfloat16{});
    case DType::kF16: return f(__half{});
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous copies and ldmatrix
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; writes zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

// 4 bytes global -> shared; zeros when !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint4 load_shared_16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

__device__ __forceinline__ void store_shared_4(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles
// ---------------------------------------------------------------------------------------------

// A kRows x kCols tile of 16-bit elements, each row padded by 16 bytes. With kCols a multiple of
// 32 a padded row is an odd number of 16-byte units, so the 8 row addresses of an ldmatrix (or 8
// rows of 16-byte stores) fall in 8 different bank groups: conflict-free without a swizzle.
template <int kRows, int kCols>
struct Tile {
  static constexpr int kStride = kCols + 8;               // elements
  static constexpr int kBytes = kRows * kStride * 2;
  static constexpr int kChunksPerRow = kCols / 8;         // 16-byte chunks
  static_assert(kCols % 32 == 0, "tile widths are multiples of 32 elements");

  uint32_t base;  // shared-space address of element (0, 0)

  __device__ uint32_t at(int row, int col) const { return base + (row * kStride + col) * 2; }

  // Asynchronously copies rows [0, kRows) x chunks [0, kChunksPerRow) from global memory, where
  // row r starts at src + r * src_stride (elements). Rows >= valid_rows and chunks >=
  // valid_chunks are zero-filled: padding rows and head-dim columns contribute nothing.
  // A thread always copies the same chunk column of every (kThreads / kChunksPerRow)-th row, so
  // it needs one source pointer and immediate shared-memory offsets.
  template <int kThreads, typename T>
  __device__ void load_async(const T* src, int64_t src_stride, int valid_rows, int valid_chunks,
                             int thread) const {
    static_assert(kThreads % kChunksPerRow == 0, "a pass covers whole rows");
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    static_assert(kRows % kRowsPerPass == 0, "whole passes cover the tile");
    const int row = thread / kChunksPerRow, chunk = thread % kChunksPerRow;
    const T* from = src + row * src_stride + chunk * 8;
    const uint32_t to = at(row, chunk * 8);
    const bool chunk_valid = chunk < valid_chunks;
#pragma unroll
    for (int i = 0; i < kRows / kRowsPerPass; ++i) {
      const bool valid = chunk_valid && row + i * kRowsPerPass < valid_rows;
      cp_async_16(to + i * kRowsPerPass * kStride * 2,
                  valid ? from + i * kRowsPerPass * src_stride : src, valid);
    }
  }

  // Copies tile rows [r0, r0 + kCount) to global memory, tile row r0 + i to dst + i * dst_stride,
  // 16 bytes per thread and step; rows i >= valid_rows and chunks >= valid_chunks are skipped.
  template <int kThreads, int kCount, typename T>
  __device__ void store_rows(T* dst, int64_t dst_stride, int r0, int valid_rows,
                             int valid_chunks, int thread) const {
    for (int c = thread; c < kCount * kChunksPerRow; c += kThreads) {
      const int i = c / kChunksPerRow, chunk = c % kChunksPerRow;
      if (i < valid_rows && chunk < valid_chunks)
        *reinterpret_cast<uint4*>(dst + i * dst_stride + chunk * 8) =
            load_shared_16(at(r0 + i, chunk * 8));
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Warp operand fragments loaded from shared memory
// ---------------------------------------------------------------------------------------------
// Two lane patterns cover all four cases: the A operand of a row-major matrix and the B operand
// of a k-major one use rows lane%16, column block lane/16; the A operand of a transposed matrix
// and the B operand of an n-major one use rows lane%8 + 8*(lane/16), column block (lane/8)%2.

__device__ __forceinline__ int lane_row_a(int lane) { return lane % 16; }
__device__ __forceinline__ int lane_col_a(int lane) { return (lane / 16) * 8; }
__device__ __forceinline__ int lane_row_b(int lane) { return lane % 8 + (lane / 16) * 8; }
__device__ __forceinline__ int lane_col_b(int lane) { return ((lane / 8) % 2) * 8; }

// A fragments of rows [r0, r0 + 16 MT), k [k0, k0 + 16) of a matrix stored row-major: (r, k).
template <int MT, typename TileT>
__device__ __forceinline__ void load_a(uint32_t (&a)[MT][4], const TileT& s, int r0, int k0,
                                       int lane) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
    ldmatrix_x4(a[m], s.at(r0 + 16 * m + lane_row_a(lane), k0 + lane_col_a(lane)));
}

// A fragments of the same block of a matrix stored transposed: element (r, k) at (k, r).
template <int MT, typename TileT>
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[MT][4], const TileT& s, int r0,
                                                  int k0, int lane) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
    ldmatrix_x4_trans(a[m], s.at(k0 + lane_row_b(lane), r0 + 16 * m + lane_col_b(lane)));
}

// B fragments of k [k0, k0 + 16) for the two n-tiles at n [n0, n0 + 16) of a matrix stored
// n-major: (k, n) at (n, k) -- K for Q K^T, V for dO V^T. b[0..1] is n-tile n0, b[2..3] n0 + 8.
template <typename TileT>
__device__ __forceinline__ void load_b_pair_nmajor(uint32_t (&b)[4], const TileT& s, int k0,
                                                   int n0, int lane) {
  ldmatrix_x4(b, s.at(n0 + lane_row_b(lane), k0 + lane_col_b(lane)));
}

// The same for a matrix stored k-major: (k, n) at (k, n) -- V for P V, Q / dO / K in backward.
template <typename TileT>
__device__ __forceinline__ void load_b_pair_kmajor(uint32_t (&b)[4], const TileT& s, int k0,
                                                   int n0, int lane) {
  ldmatrix_x4_trans(b, s.at(k0 + lane_row_a(lane), n0 + lane_col_a(lane)));
}

// acc[., n], acc[., n + 1] += A * (the pair of B fragments b).
template <typename T, int MT, int NT>
__device__ __forceinline__ void mma_pair(float (&acc)[MT][NT][4], int n, const uint32_t (&a)[MT][4],
                                         const uint32_t (&b)[4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    Element<T>::mma(acc[m][n], a[m], b[0], b[1]);
    Element<T>::mma(acc[m][n + 1], a[m], b[2], b[3]);
  }
}

// acc += A B for one k-step: A fragments in registers, B fetched a pair of n-tiles at a time
// (load_b(b, n0) for n0 = 0, 16, ...), each pair consumed at once to keep few registers live.
template <typename T, int MT, int NT, typename LoadB>
__device__ __forceinline__ void mma_k_step(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4],
                                           LoadB&& load_b) {
  static_assert(NT % 2 == 0, "B fragments load in pairs of n-tiles");
#pragma unroll
  for (int n = 0; n < NT; n += 2) {
    uint32_t b[4];
    load_b(b, 8 * n);
    mma_pair<T>(acc, n, a, b);
  }
}

// acc += A B over k [0, 16 KSTEPS): load_a(a, k0) fetches the A fragments of a k-step,
// load_b(b, k0, n0) a pair of B fragments.
template <typename T, int MT, int NT, int KSTEPS, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_gemm(float (&acc)[MT][NT][4], LoadA&& load_a_step,
                                          LoadB&& load_b) {
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k) {
    uint32_t a[MT][4];
    load_a_step(a, 16 * k);
    mma_k_step<T>(acc, a, [&](uint32_t(&b)[4], int n0) { load_b(b, 16 * k, n0); });
  }
}

// The A fragment of k-step j from fp32 C fragments of n-tiles 2j, 2j+1 (rounded to T).
template <typename T, int MT, int NT>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[MT][4], const float (&c)[MT][NT][4], int j) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    a[m][0] = Element<T>::pack(c[m][2 * j][0], c[m][2 * j][1]);
    a[m][1] = Element<T>::pack(c[m][2 * j][2], c[m][2 * j][3]);
    a[m][2] = Element<T>::pack(c[m][2 * j + 1][0], c[m][2 * j + 1][1]);
    a[m][3] = Element<T>::pack(c[m][2 * j + 1][2], c[m][2 * j + 1][3]);
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
}

// Position of element e of C fragment (m, n) relative to the warp tile's origin.
__device__ __forceinline__ int c_row(int m, int e, int lane) { return 16 * m + lane / 4 + 8 * (e / 2); }
__device__ __forceinline__ int c_col(int n, int e, int lane) { return 8 * n + 2 * (lane % 4) + (e % 2); }

// Stores fp32 C fragments, rounded to T, into a shared tile at (r0, c0) (4-byte stores).
template <typename T, int MT, int NT, typename TileT>
__device__ __forceinline__ void store_c(const TileT& s, const float (&c)[MT][NT][4], int r0,
                                        int c0, int lane) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        store_shared_4(s.at(r0 + c_row(m, 2 * half, lane), c0 + c_col(n, 0, lane)),
                       Element<T>::pack(c[m][n][2 * half], c[m][n][2 * half + 1]));
      }
}

// Reductions over the 4 lanes (a quad) that share a row of a C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The rows of one (batch, head) of a [B, L, heads, head_dim] tensor (q, k, v, out and grads).
template <typename T>
struct HeadRows {
  T* base;         // row 0
  int64_t stride;  // elements between consecutive rows: heads * head_dim

  __device__ static HeadRows of(const void* data, int64_t b, int64_t len, int64_t heads,
                                int64_t head, int64_t head_dim) {
    return {static_cast<T*>(const_cast<void*>(data)) + ((b * len) * heads + head) * head_dim,
            heads * head_dim};
  }
  __device__ T* row(int r) const { return base + r * stride; }
};

// The operands of one (batch, query head) of a forward call: its rows of q and out, its kv
// head's rows of k and v (query head n reads kv head n / (N / K)), and its row of lse.
template <typename T>
struct ForwardHead {
  HeadRows<const T> q, k, v;
  HeadRows<T> out;
  float* lse;

  __device__ static ForwardHead of(const ForwardArgs& args, int b, int head) {
    const AttentionShape& s = args.shape;
    const int64_t kv_head = head / (s.num_heads / s.num_kv_heads);
    return {HeadRows<const T>::of(args.q, b, s.q_len, s.num_heads, head, s.head_dim),
            HeadRows<const T>::of(args.k, b, s.kv_len, s.num_kv_heads, kv_head, s.head_dim),
            HeadRows<const T>::of(args.v, b, s.kv_len, s.num_kv_heads, kv_head, s.head_dim),
            HeadRows<T>::of(args.out, b, s.q_len, s.num_heads, head, s.head_dim),
            args.lse + (b * s.num_heads + head) * s.q_len};
  }
};

// ---------------------------------------------------------------------------------------------
// Which scores are kept, and how raw q.k products become scores
// ---------------------------------------------------------------------------------------------

// The kept region of one (batch, head): t < q_len, s < kv_len, t - left <= s <= t + right, and
// mask[t, s] when a mask is given (docs/architecture.md). Causal is right = 0.
struct Band {
  int q_len, kv_len, left, right;

  __device__ static Band of(const ForwardArgs& args, int b) {
    Band band;
    // Absent per-sequence lengths (nullptr, as the C++ harnesses pass) mean full length.
    const int q_len = static_cast<int>(args.shape.q_len), kv_len = static_cast<int>(args.shape.kv_len);
    band.q_len = args.q_seqlens ? min(max(args.q_seqlens[b], 0), q_len) : q_len;
    band.kv_len = args.kv_seqlens ? min(max(args.kv_seqlens[b], 0), kv_len) : kv_len;
    band.left = args.spec.window_left < 0 ? kUnbounded : args.spec.window_left;
    band.right = args.spec.is_causal ? 0
                 : args.spec.window_right < 0 ? kUnbounded
                                              : args.spec.window_right;
    return band;
  }
  __device__ bool keeps(int t, int s) const {
    return t < q_len && s < kv_len && s >= t - left && s <= t + right;
  }
  // Keys kept by some row of [r0, r1) lie in [key_begin, key_end); empty when begin >= end.
  __device__ int key_begin(int r0) const { return max(0, r0 - left); }
  __device__ int key_end(int r0, int r1) const {
    r1 = min(r1, q_len);
    return r1 <= r0 ? 0 : min(kv_len, r1 - 1 + right + 1);
  }
  // Rows that keep some key of [c0, c1) lie in [row_begin, row_end).
  __device__ int row_begin(int c0) const { return max(0, c0 - right); }
  __device__ int row_end(int c0, int c1) const {
    c1 = min(c1, kv_len);
    return c1 <= c0 ? 0 : min(q_len, c1 - 1 + left + 1);
  }
  // Whether every (t, s) of rows [r0, r1) x keys [c0, c1) is kept by the band.
  __device__ bool covers(int r0, int r1, int c0, int c1) const {
    return r1 <= q_len && c1 <= kv_len && c0 >= r1 - 1 - left && c1 - 1 <= r0 + right;
  }
};

// Everything that turns q.k of one (batch, head) into a score: scale, softcap, bias, and the
// kept region (band and mask). Scores are produced in log2 units (natural score * log2 e).
// `args` is the kernel's __grid_constant__ parameter: its fields are read from the constant
// bank where used and hold no registers through the kernel's loops.
//
// Kernels come in two variants. A plain call (no softcap, bias or mask tensor, positive scale)
// keeps raw q.k products, masks by the band alone, and folds scale * log2 e into the exponent's
// FMA; a general call forms every score explicitly. The general path's per-element loads and
// tanh would cost the plain path registers it does not have, hence two instantiations.
struct Scores {
  const ForwardArgs& args;
  int b, n;
  Band band;

  __device__ Scores(const ForwardArgs& a, int batch, int head)
      : Scores(a, batch, head, Band::of(a, batch)) {}
  __device__ Scores(const ForwardArgs& a, int batch, int head, const Band& batch_band)
      : args(a), b(batch), n(head), band(batch_band) {}

  __device__ float scale() const { return args.spec.scale; }
  __device__ float softcap() const { return args.spec.softcap; }
  __device__ bool has_bias() const { return args.bias.data != nullptr; }
  __device__ bool has_mask() const { return args.mask.data != nullptr; }
  __device__ float log2_scale() const { return scale() * kLog2e; }

  __device__ float bias(int t, int s) const {
    const Broadcast4D<float>& x = args.bias;
    return x.data[b * x.stride_b + n * x.stride_n + t * x.stride_t + s * x.stride_s];
  }
  __device__ bool mask(int t, int s) const {
    const Broadcast4D<uint8_t>& x = args.mask;
    return x.data[b * x.stride_b + n * x.stride_n + t * x.stride_t + s * x.stride_s] != 0;
  }
  // tanh(raw * scale / softcap): the softcap's saturation, needed again by the backward.
  __device__ float softcap_tanh(float raw) const {
    return tanhf(raw * (scale() / softcap()));
  }
  // Full score in log2 units of a kept (t, s). `saturation` receives the softcap's tanh (0 when
  // off): the backward's chain factor is 1 - saturation^2.
  __device__ float log2_score(float raw, int t, int s, float& saturation) const {
    saturation = softcap() > 0.f ? softcap_tanh(raw) : 0.f;
    float x = softcap() > 0.f ? softcap() * saturation : raw * scale();
    if (has_bias()) x += bias(t, s);
    return x * kLog2e;
  }
  __device__ bool keeps(int t, int s) const {
    return band.keeps(t, s) && (!has_mask() || mask(t, s));
  }
  // Whether the tile rows [r0, r1) x keys [c0, c1) needs no per-element predicate.
  __device__ bool all_kept(int r0, int r1, int c0, int c1) const {
    return !has_mask() && band.covers(r0, r1, c0, c1);
  }

  // Turns a warp's raw q.k fragments at (r0, c0) into exponent arguments, -inf where not kept:
  // in a plain call raw products (to be multiplied by log2_scale()), else log2-unit scores.
  // The multiplier of the exponent is returned.
  template <bool kGeneral, int MT, int NT>
  __device__ float apply(float (&s)[MT][NT][4], int r0, int c0, bool check_each, int lane) const {
    if (!kGeneral && !check_each) return log2_scale();
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = r0 + c_row(m, e, lane), k = c0 + c_col(n, e, lane);
          if (kGeneral) {
            const bool kept = !check_each || keeps(t, k);
            float saturation;
            s[m][n][e] = kept ? log2_score(s[m][n][e], t, k, saturation) : -INFINITY;
          } else if (!band.keeps(t, k)) {
            s[m][n][e] = -INFINITY;
          }
        }
    return kGeneral ? 1.f : log2_scale();
  }

  // Whether a call needs the general kernel variant.
  __host__ __device__ static bool general(const ForwardArgs& a) {
    return a.spec.softcap != 0.f || a.bias.data != nullptr || a.mask.data != nullptr ||
           !(a.spec.scale > 0.f);
  }
};

// ---------------------------------------------------------------------------------------------
// Online softmax over the rows a thread holds in C fragments
// ---------------------------------------------------------------------------------------------

// A thread holds rows 2m + half (half 0: lane/4, half 1: lane/4 + 8 of m-tile m). `sum` is this
// thread's partial: the quad's four partials are added once, at the end.
template <int MT, bool kConditionalRescale>
struct RowSoftmax {
  static constexpr int kRows = 2 * MT;
  // Running max of exponent arguments (log2 units; with conditional rescaling up to
  // kRescaleThreshold below the true one), -inf before any kept key.
  float max[kRows];
  float sum[kRows];

  __device__ void init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) max[r] = -INFINITY, sum[r] = 0.f;
  }

  // Exponentiates a tile of scores (times `mul`) in place against the updated row maxima and
  // returns in `rescale` the factor the rows' earlier accumulations must be multiplied by.
  // Returns whether any row of the warp moved its maximum (else every factor is exactly 1).
  template <int NT>
  __device__ bool update(float (&s)[MT][NT][4], float mul, float (&rescale)[kRows]) {
    bool changed = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int m = r / 2, half = r % 2;
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < NT; ++n)
        tile_max = fmaxf(tile_max, fmaxf(s[m][n][2 * half], s[m][n][2 * half + 1]));
      const float tile_arg = quad_max(tile_max) * mul;
      float new_max = fmaxf(max[r], tile_arg);
      // NaN (nothing kept yet, nor in this tile) compares false: the max stays -inf.
      if (kConditionalRescale) new_max = tile_arg - max[r] > kRescaleThreshold ? tile_arg : max[r];
      // A row with no kept key so far exponentiates against 0: every term is exp2(-inf) = 0.
      const float base = new_max == -INFINITY ? 0.f : new_max;
      rescale[r] = fast_exp2(max[r] - base);
      changed |= new_max != max[r];
      max[r] = new_max;
      float row_sum = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[m][n][e] = fast_exp2(s[m][n][e] * mul - base);
          row_sum += s[m][n][e];
        }
      sum[r] = sum[r] * rescale[r] + row_sum;
    }
    return __any_sync(0xffffffffu, changed);
  }

  // Exponentiates a tile of scores (times `mul`) in place against the rows' running maxima,
  // without the tile's own max, and adds the rows' sums: the max's FMNMX chain and shuffles, the
  // rescale factors and the accumulator rescale are update's work on every tile (v3's forward
  // measured the same idea, docs/perf-notes-v3.md, session 20). Valid while every probability
  // stays below kProbabilitySumBound; each thread's partial sum of a row bounds its elements, so
  // the check needs no shuffle. Returns false, warp-uniformly, when a partial sum reaches the
  // bound, is NaN, or a row has no max yet (its terms are inf or NaN): `s` then holds no scores
  // and the statistics are unchanged; the caller recomputes the scores and runs update. The
  // warp's rows start at r0; rows from q_len on, masked in every tile, take the reference +inf
  // (terms 0, as update gives them) instead of failing every tile.
  template <int NT>
  __device__ bool exponentiate_at_running_max(float (&s)[MT][NT][4], float mul, int r0,
                                              int q_len, int lane) {
    float row_sum[kRows];
    bool fits = true;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int m = r / 2, half = r % 2;
      const float base = r0 + c_row(m, 2 * half, lane) < q_len ? max[r] : INFINITY;
      row_sum[r] = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[m][n][e] = fast_exp2(s[m][n][e] * mul - base);
          row_sum[r] += s[m][n][e];
        }
      fits &= row_sum[r] < kProbabilitySumBound;
    }
    if (!__all_sync(0xffffffffu, fits)) return false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) sum[r] += row_sum[r];
    return true;
  }

  // Final 1/rowsum (0 for rows with no kept key) and natural-log logsumexp (-inf for those).
  __device__ void finish(float (&inv_sum)[kRows], float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float total = quad_sum(sum[r]);
      const bool any = total > 0.f;
      inv_sum[r] = any ? 1.f / total : 0.f;
      lse[r] = any ? (max[r] + __log2f(total)) * kLn2 : -INFINITY;
    }
  }
};

// Multiplies the rows of C fragments by per-row factors (row 2m + e/2 of the thread).
template <int MT, int NT>
__device__ __forceinline__ void scale_rows(float (&acc)[MT][NT][4], const float (&f)[2 * MT]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] *= f[2 * m + e / 2];
}

}  // namespace jax_flash::tile
