// The CPU attention kernel's work items, as always_inline templates over the vector width W and
// the storage type T. attention.cc instantiates them inside functions compiled for each ISA.
//
// Forward, one item per (batch, head, block of kQueryTile queries): stage the scaled queries,
// then for each key tile that some row of the block may attend to (sequence lengths, causal
// and window limits; other tiles are skipped) stage K^T and V, form the scores with one
// product, finish them (softcap, bias, masks -> -inf), update the running max / sum of each
// row and the output accumulator with a second product. Work memory is O(tile).
//
// Backward (FlashAttention-2 with a precomputed delta = rowsum(dout * out)), two kinds of
// items in one parallel region, neither writing memory the other writes, so no atomics and a
// deterministic result:
//   key blocks   (batch, kv head, kKeyTile keys): dK and dV, summed over the query heads of
//                the GQA group and the query rows that reach the block; computed transposed
//                (keys as rows) so every product keeps the broadcast-A, vector-B form.
//   query blocks (batch, head, kQueryTile queries): dQ and, with a bias, dbias.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>

#include "cuda/attention_args.h"
#include "xla_ffi/cpu/gemm.h"
#include "xla_ffi/cpu/simd.h"

namespace jax_flash::cpu {

constexpr int64_t kQueryTile = 64;  // rows per query block; a multiple of every Block::kCols
constexpr int64_t kKeyTile = 64;    // keys per key tile; likewise
constexpr float kInf = std::numeric_limits<float>::infinity();

inline int64_t CeilDiv(int64_t x, int64_t m) { return (x + m - 1) / m; }
inline int64_t RoundUp(int64_t x, int64_t m) { return CeilDiv(x, m) * m; }

// ---- work memory -------------------------------------------------------------------------------

struct FreeFloats {
  void operator()(float* p) const { std::free(p); }
};
using FloatBuffer = std::unique_ptr<float[], FreeFloats>;

// count zeroed floats, cache-line aligned.
inline FloatBuffer ZeroedFloats(int64_t count) {
  const size_t bytes = static_cast<size_t>(RoundUp(std::max<int64_t>(count, 1) * 4, 64));
  void* memory = std::aligned_alloc(64, bytes);
  if (memory == nullptr) std::abort();  // inside a worker thread: nothing to unwind to
  std::memset(memory, 0, bytes);
  return FloatBuffer(static_cast<float*>(memory));
}

// ---- which (query, key) pairs are kept ---------------------------------------------------------

struct Span {
  int64_t begin = 0, end = 0;  // [begin, end)
  bool empty() const { return end <= begin; }
};

inline int64_t SequenceLength(const int32_t* lengths, int64_t b, int64_t full) {
  return std::clamp<int64_t>(lengths[b], 0, full);
}

// Keys row t keeps by the sequence lengths, causal and window limits (the mask tensor aside);
// empty for a row past the query length.
inline Span KeysOfRow(const MaskSpec& spec, int64_t t, int64_t q_len, int64_t kv_len) {
  if (t >= q_len) return {};
  int64_t begin = 0, end = kv_len;
  if (spec.is_causal) end = std::min(end, t + 1);
  if (spec.window_left >= 0) begin = std::max<int64_t>(begin, t - spec.window_left);
  if (spec.window_right >= 0) end = std::min<int64_t>(end, t + spec.window_right + 1);
  // An empty row keeps end (not begin) so that both limits stay within [0, kv_len] and
  // monotone in t, which KeysOfRows relies on.
  return {std::min(begin, end), end};
}

// Rows whose KeysOfRow meets [s_begin, s_end) (both limits are monotone in t).
inline Span RowsOfKeys(const MaskSpec& spec, int64_t s_begin, int64_t s_end, int64_t q_len,
                       int64_t kv_len) {
  if (s_begin >= kv_len) return {};
  int64_t begin = 0, end = q_len;
  if (spec.is_causal) begin = std::max(begin, s_begin);
  if (spec.window_right >= 0) begin = std::max<int64_t>(begin, s_begin - spec.window_right);
  if (spec.window_left >= 0) end = std::min<int64_t>(end, s_end + spec.window_left);
  return {std::min(begin, end), end};
}

// Keys any of rows [t0, t0 + rows) keeps (a superset: rows are masked one by one later).
inline Span KeysOfRows(const MaskSpec& spec, int64_t t0, int64_t rows, int64_t q_len,
                       int64_t kv_len) {
  if (rows <= 0) return {};
  return {KeysOfRow(spec, t0, q_len, kv_len).begin,
          KeysOfRow(spec, t0 + rows - 1, q_len, kv_len).end};
}

// One (batch, head) sequence pair.
struct Sequence {
  int64_t b, n, q_len, kv_len;
};

// A tile of scores in a buffer: (query i, key j) at data[i * query_stride + j * key_stride] is
// the score of query row t0 + i and key s0 + j. Only i < queries, j < keys exist; the padding
// up to padded_queries x padded_keys is set to -inf (not kept) as well.
struct ScoreTile {
  float* data;
  int64_t query_stride, key_stride;
  int64_t t0, s0;
  int64_t queries, keys;
  int64_t padded_queries, padded_keys;
};

inline void AddBias(const Broadcast4D<float>& bias, const Sequence& seq, const ScoreTile& tile) {
  const float* base = bias.data + seq.b * bias.stride_b + seq.n * bias.stride_n +
                      tile.t0 * bias.stride_t + tile.s0 * bias.stride_s;
  for (int64_t i = 0; i < tile.queries; ++i) {
    const float* bias_row = base + i * bias.stride_t;
    float* row = tile.data + i * tile.query_stride;
    if (tile.key_stride == 1 && bias.stride_s == 1) {
      for (int64_t j = 0; j < tile.keys; ++j) row[j] += bias_row[j];
    } else {
      for (int64_t j = 0; j < tile.keys; ++j) row[j * tile.key_stride] += bias_row[j * bias.stride_s];
    }
  }
}

inline void ApplyMasks(const MaskSpec& spec, const Broadcast4D<uint8_t>& mask, const Sequence& seq,
                       const ScoreTile& tile) {
  const uint8_t* mask_base = mask.data == nullptr
                                 ? nullptr
                                 : mask.data + seq.b * mask.stride_b + seq.n * mask.stride_n +
                                       tile.t0 * mask.stride_t + tile.s0 * mask.stride_s;
  for (int64_t i = 0; i < tile.padded_queries; ++i) {
    const Span keys = i < tile.queries ? KeysOfRow(spec, tile.t0 + i, seq.q_len, seq.kv_len)
                                       : Span{};
    const int64_t begin = std::clamp<int64_t>(keys.begin - tile.s0, 0, tile.keys);
    const int64_t end = std::clamp<int64_t>(keys.end - tile.s0, begin, tile.keys);
    float* row = tile.data + i * tile.query_stride;
    const int64_t ks = tile.key_stride;
    for (int64_t j = 0; j < begin; ++j) row[j * ks] = -kInf;
    for (int64_t j = end; j < tile.padded_keys; ++j) row[j * ks] = -kInf;
    if (mask_base == nullptr) continue;
    const uint8_t* mask_row = mask_base + i * mask.stride_t;
    for (int64_t j = begin; j < end; ++j) {
      if (mask_row[j * mask.stride_s] == 0) row[j * ks] = -kInf;
    }
  }
}

// x <- softcap * tanh(x / softcap) over count floats; derivative (when not null) <- 1 - tanh^2,
// the factor the backward applies to dS.
template <int W>
JAX_FLASH_INLINE void Softcap(float* x, int64_t count, float softcap, float* derivative) {
  const float inverse = 1.f / softcap;
  for (int64_t i = 0; i < count; i += W) {
    const VecF<W> t = Tanh<W>(Load<W>(x + i) * inverse);
    Store<W>(x + i, t * softcap);
    if (derivative != nullptr) Store<W>(derivative + i, 1.f - t * t);
  }
}

// Raw scaled products q.k -> the final scores of the convention: softcap, then bias, then -inf
// where not kept. buffer_floats: the contiguous buffer region holding the tile (a multiple of W).
template <int W>
JAX_FLASH_INLINE void FinishScores(const ForwardArgs& a, const Sequence& seq,
                                   const ScoreTile& tile, int64_t buffer_floats,
                                   float* softcap_derivative) {
  if (a.spec.softcap > 0.f) Softcap<W>(tile.data, buffer_floats, a.spec.softcap, softcap_derivative);
  if (a.bias.data != nullptr) AddBias(a.bias, seq, tile);
  ApplyMasks(a.spec, a.mask, seq, tile);
}

// ---- staging: storage dtype -> f32 tiles -------------------------------------------------------

// dst[r * ld + h] = scale * src[r * src_stride + h] for r < rows, h < head_dim; the rest of the
// padded_rows x ld block is zero.
template <typename T>
JAX_FLASH_INLINE void StageRows(const T* src, int64_t src_stride, int64_t rows, int64_t head_dim,
                                float scale, float* dst, int64_t ld, int64_t padded_rows) {
  std::memset(dst, 0, sizeof(float) * padded_rows * ld);
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = src + r * src_stride;
    float* out = dst + r * ld;
    for (int64_t h = 0; h < head_dim; ++h) out[h] = scale * ToFloat(in[h]);
  }
}

// dst[h * ld + r] = scale * src[r * src_stride + h]: the transpose, padded_head_dim x ld, zero
// outside r < rows, h < head_dim.
template <typename T>
JAX_FLASH_INLINE void StageColumns(const T* src, int64_t src_stride, int64_t rows,
                                   int64_t head_dim, float scale, float* dst, int64_t ld,
                                   int64_t padded_head_dim) {
  std::memset(dst, 0, sizeof(float) * padded_head_dim * ld);
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = src + r * src_stride;
    for (int64_t h = 0; h < head_dim; ++h) dst[h * ld + r] = scale * ToFloat(in[h]);
  }
}

template <typename T>
JAX_FLASH_INLINE void WriteRows(const float* src, int64_t ld, int64_t rows, int64_t head_dim,
                                float scale, T* dst, int64_t dst_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < head_dim; ++h) {
      dst[r * dst_stride + h] = FromFloat<T>(scale * src[r * ld + h]);
    }
  }
}

template <typename T>
JAX_FLASH_INLINE void ZeroRows(int64_t rows, int64_t head_dim, T* dst, int64_t dst_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < head_dim; ++h) dst[r * dst_stride + h] = FromFloat<T>(0.f);
  }
}

// ---- geometry of one call ----------------------------------------------------------------------

// Element offsets of the [B, T, N, H] / [B, S, K, H] / [B, N, T] tensors of the convention.
struct Layout {
  int64_t T, S, N, K, H, group;
  explicit Layout(const AttentionShape& s)
      : T(s.q_len), S(s.kv_len), N(s.num_heads), K(s.num_kv_heads), H(s.head_dim),
        group(s.num_heads / s.num_kv_heads) {}
  int64_t q_row(int64_t b, int64_t t, int64_t n) const { return ((b * T + t) * N + n) * H; }
  int64_t kv_row(int64_t b, int64_t s, int64_t kvh) const { return ((b * S + s) * K + kvh) * H; }
  int64_t q_stride() const { return N * H; }   // between consecutive t
  int64_t kv_stride() const { return K * H; }  // between consecutive s
  int64_t stat(int64_t b, int64_t n, int64_t t) const { return (b * N + n) * T + t; }
};

// Query block of a (batch, head, query block) item, numbered with the block fastest.
struct QueryBlock {
  Sequence seq;
  int64_t t0, rows, live;  // rows in the block; live: those before the query length
};

inline QueryBlock DecodeQueryBlock(const ForwardArgs& a, int64_t item) {
  const AttentionShape& s = a.shape;
  const int64_t blocks = CeilDiv(s.q_len, kQueryTile);
  const int64_t n = (item / blocks) % s.num_heads, b = item / blocks / s.num_heads;
  QueryBlock qb;
  qb.seq = {b, n, SequenceLength(a.q_seqlens, b, s.q_len),
            SequenceLength(a.kv_seqlens, b, s.kv_len)};
  qb.t0 = (item % blocks) * kQueryTile;
  qb.rows = std::min(kQueryTile, s.q_len - qb.t0);
  qb.live = std::clamp<int64_t>(qb.seq.q_len - qb.t0, 0, qb.rows);
  return qb;
}

inline int64_t QueryBlockCount(const AttentionShape& s) {
  return s.batch * s.num_heads * CeilDiv(s.q_len, kQueryTile);
}

inline int64_t KeyBlockCount(const AttentionShape& s) {
  return s.batch * s.num_kv_heads * CeilDiv(s.kv_len, kKeyTile);
}

// P = exp(x - lse) along n floats; lse = -inf (a row with no kept key) must come as +inf.
template <int W>
JAX_FLASH_INLINE void ExpMinus(float* x, int64_t n, VecF<W> lse) {
  for (int64_t c = 0; c < n; c += W) Store<W>(x + c, Exp<W>(Load<W>(x + c) - lse));
}

inline float LseForExp(float lse) { return lse == -kInf ? kInf : lse; }

// ---- forward -----------------------------------------------------------------------------------

// One online-softmax step of a row: x (n floats of final scores) becomes p = exp(x - new max),
// the running max / sum are updated and the output accumulator row rescaled.
template <int W>
JAX_FLASH_INLINE void SoftmaxStep(float* x, int64_t n, float* row_max, float* row_sum, float* acc,
                                  int64_t acc_len) {
  VecF<W> vmax = Splat<W>(-kInf);
  for (int64_t c = 0; c < n; c += W) vmax = Max<W>(vmax, Load<W>(x + c));
  const float new_max = std::max(*row_max, ReduceMax<W>(vmax));
  if (new_max == -kInf) {  // nothing kept in this row yet
    std::memset(x, 0, sizeof(float) * n);
    return;
  }
  const VecF<W> shift = Splat<W>(new_max);
  VecF<W> vsum{};
  for (int64_t c = 0; c < n; c += W) {
    const VecF<W> p = Exp<W>(Load<W>(x + c) - shift);
    Store<W>(x + c, p);
    vsum += p;
  }
  const float alpha = std::exp(*row_max - new_max);
  *row_sum = *row_sum * alpha + ReduceSum<W>(vsum);
  *row_max = new_max;
  if (alpha != 1.f) {
    for (int64_t h = 0; h < acc_len; h += W) Store<W>(acc + h, Load<W>(acc + h) * alpha);
  }
}

template <int W, typename T>
JAX_FLASH_INLINE void ForwardItem(const ForwardArgs& a, int64_t item) {
  constexpr int64_t kRows = Block<W>::kRows, kCols = Block<W>::kCols;
  const Layout L(a.shape);
  const QueryBlock qb = DecodeQueryBlock(a, item);
  const Sequence& seq = qb.seq;
  const int64_t kvh = seq.n / L.group, Hp = RoundUp(L.H, kCols);
  const int64_t m = RoundUp(std::max<int64_t>(qb.live, 1), kRows);  // product rows

  FloatBuffer q_tile = ZeroedFloats(m * Hp), kt = ZeroedFloats(Hp * kKeyTile),
              v_tile = ZeroedFloats(kKeyTile * Hp), scores = ZeroedFloats(m * kKeyTile),
              acc = ZeroedFloats(m * Hp), row_max = ZeroedFloats(kQueryTile),
              row_sum = ZeroedFloats(kQueryTile);
  std::fill_n(row_max.get(), kQueryTile, -kInf);

  const T* q = static_cast<const T*>(a.q) + L.q_row(seq.b, qb.t0, seq.n);
  const T* k = static_cast<const T*>(a.k) + L.kv_row(seq.b, 0, kvh);
  const T* v = static_cast<const T*>(a.v) + L.kv_row(seq.b, 0, kvh);
  StageRows(q, L.q_stride(), qb.live, L.H, a.spec.scale, q_tile.get(), Hp, m);
  const Span keys = KeysOfRows(a.spec, qb.t0, qb.live, seq.q_len, seq.kv_len);
  for (int64_t s0 = keys.begin; s0 < keys.end; s0 += kKeyTile) {
    const int64_t cols = std::min(kKeyTile, keys.end - s0);
    StageColumns(k + s0 * L.kv_stride(), L.kv_stride(), cols, L.H, 1.f, kt.get(), kKeyTile, Hp);
    StageRows(v + s0 * L.kv_stride(), L.kv_stride(), cols, L.H, 1.f, v_tile.get(), Hp, kKeyTile);
    Gemm<W>(m, kKeyTile, Hp, q_tile.get(), Hp, kt.get(), kKeyTile, scores.get(), kKeyTile, false);
    const ScoreTile tile{scores.get(), kKeyTile, 1, qb.t0, s0, qb.live, cols, qb.live, kKeyTile};
    FinishScores<W>(a, seq, tile, m * kKeyTile, nullptr);
    for (int64_t r = 0; r < qb.live; ++r) {
      SoftmaxStep<W>(scores.get() + r * kKeyTile, kKeyTile, &row_max[r], &row_sum[r],
                     acc.get() + r * Hp, Hp);
    }
    Gemm<W>(m, Hp, kKeyTile, scores.get(), kKeyTile, v_tile.get(), Hp, acc.get(), Hp, true);
  }

  T* out = static_cast<T*>(a.out) + L.q_row(seq.b, qb.t0, seq.n);
  float* lse = a.lse + L.stat(seq.b, seq.n, qb.t0);
  for (int64_t r = 0; r < qb.rows; ++r) {
    if (r < qb.live && row_max[r] > -kInf) {
      WriteRows(acc.get() + r * Hp, Hp, 1, L.H, 1.f / row_sum[r], out + r * L.q_stride(), 0);
      lse[r] = row_max[r] + std::log(row_sum[r]);
    } else {
      ZeroRows(1, L.H, out + r * L.q_stride(), 0);
      lse[r] = -kInf;
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------

// delta[b, n, t] = sum_h dout * out for the rows of one (batch, query block) item, all heads.
template <typename T>
JAX_FLASH_INLINE void DeltaItem(const BackwardArgs& g, float* delta, int64_t item) {
  const Layout L(g.fwd.shape);
  const int64_t blocks = CeilDiv(L.T, kQueryTile);
  const int64_t b = item / blocks, t0 = (item % blocks) * kQueryTile;
  const int64_t t1 = std::min(L.T, t0 + kQueryTile);
  const T* out = static_cast<const T*>(g.fwd.out);
  const T* dout = static_cast<const T*>(g.dout);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t n = 0; n < L.N; ++n) {
      const int64_t row = L.q_row(b, t, n);
      float sum = 0.f;
      for (int64_t h = 0; h < L.H; ++h) sum += ToFloat(out[row + h]) * ToFloat(dout[row + h]);
      delta[L.stat(b, n, t)] = sum;
    }
  }
}

// dK and dV of kKeyTile keys of one (batch, kv head).
template <int W, typename T>
JAX_FLASH_INLINE void KeyBlockItem(const BackwardArgs& g, const float* delta, int64_t item) {
  constexpr int64_t kRows = Block<W>::kRows, kCols = Block<W>::kCols;
  const ForwardArgs& a = g.fwd;
  const Layout L(a.shape);
  const int64_t blocks = CeilDiv(L.S, kKeyTile);
  const int64_t kvh = (item / blocks) % L.K, b = item / blocks / L.K;
  const int64_t s0 = (item % blocks) * kKeyTile, cols = std::min(kKeyTile, L.S - s0);
  const int64_t q_len = SequenceLength(a.q_seqlens, b, L.T);
  const int64_t kv_len = SequenceLength(a.kv_seqlens, b, L.S);
  const int64_t Hp = RoundUp(L.H, kCols), m = RoundUp(cols, kRows);
  constexpr int64_t Q = kQueryTile;  // leading dimension of the query-indexed tiles

  FloatBuffer k_tile = ZeroedFloats(m * Hp), v_tile = ZeroedFloats(m * Hp),
              dk = ZeroedFloats(m * Hp), dv = ZeroedFloats(m * Hp);
  const Span rows_range = RowsOfKeys(a.spec, s0, s0 + cols, q_len, kv_len);
  if (!rows_range.empty()) {
    FloatBuffer qs = ZeroedFloats(Q * Hp), qt = ZeroedFloats(Hp * Q), dos = ZeroedFloats(Q * Hp),
                dot = ZeroedFloats(Hp * Q), pt = ZeroedFloats(m * Q), dst = ZeroedFloats(m * Q),
                cap_grad = ZeroedFloats(a.spec.softcap > 0.f ? m * Q : 0),
                lse_col = ZeroedFloats(Q), delta_col = ZeroedFloats(Q);
    float* softcap_derivative = a.spec.softcap > 0.f ? cap_grad.get() : nullptr;
    const T* k = static_cast<const T*>(a.k) + L.kv_row(b, s0, kvh);
    const T* v = static_cast<const T*>(a.v) + L.kv_row(b, s0, kvh);
    StageRows(k, L.kv_stride(), cols, L.H, 1.f, k_tile.get(), Hp, m);
    StageRows(v, L.kv_stride(), cols, L.H, 1.f, v_tile.get(), Hp, m);
    for (int64_t n = kvh * L.group; n < (kvh + 1) * L.group; ++n) {
      const Sequence seq{b, n, q_len, kv_len};
      for (int64_t t0 = rows_range.begin; t0 < rows_range.end; t0 += Q) {
        const int64_t rows = std::min(Q, rows_range.end - t0), width = RoundUp(rows, kCols);
        const T* q = static_cast<const T*>(a.q) + L.q_row(b, t0, n);
        const T* dout = static_cast<const T*>(g.dout) + L.q_row(b, t0, n);
        StageRows(q, L.q_stride(), rows, L.H, a.spec.scale, qs.get(), Hp, Q);
        StageColumns(q, L.q_stride(), rows, L.H, a.spec.scale, qt.get(), Q, Hp);
        StageRows(dout, L.q_stride(), rows, L.H, 1.f, dos.get(), Hp, Q);
        StageColumns(dout, L.q_stride(), rows, L.H, 1.f, dot.get(), Q, Hp);
        for (int64_t r = 0; r < Q; ++r) {
          lse_col[r] = r < rows ? LseForExp(a.lse[L.stat(b, n, t0 + r)]) : kInf;
          delta_col[r] = r < rows ? delta[L.stat(b, n, t0 + r)] : 0.f;
        }
        // Scores transposed: keys are rows, queries columns.
        Gemm<W>(m, width, Hp, k_tile.get(), Hp, qt.get(), Q, pt.get(), Q, false);
        const ScoreTile tile{pt.get(), 1, Q, t0, s0, rows, cols, width, m};
        FinishScores<W>(a, seq, tile, m * Q, softcap_derivative);
        for (int64_t c = 0; c < m; ++c) {
          for (int64_t r = 0; r < width; r += W) {
            Store<W>(pt.get() + c * Q + r,
                     Exp<W>(Load<W>(pt.get() + c * Q + r) - Load<W>(lse_col.get() + r)));
          }
        }
        Gemm<W>(m, Hp, width, pt.get(), Q, dos.get(), Hp, dv.get(), Hp, true);
        Gemm<W>(m, width, Hp, v_tile.get(), Hp, dot.get(), Q, dst.get(), Q, false);
        for (int64_t c = 0; c < m; ++c) {
          for (int64_t r = 0; r < width; r += W) {
            float* ds = dst.get() + c * Q + r;
            VecF<W> value = Load<W>(pt.get() + c * Q + r) *
                            (Load<W>(ds) - Load<W>(delta_col.get() + r));
            if (softcap_derivative) value *= Load<W>(softcap_derivative + c * Q + r);
            Store<W>(ds, value);
          }
        }
        Gemm<W>(m, Hp, width, dst.get(), Q, qs.get(), Hp, dk.get(), Hp, true);
      }
    }
  }
  WriteRows(dk.get(), Hp, cols, L.H, 1.f, static_cast<T*>(g.dk) + L.kv_row(b, s0, kvh),
            L.kv_stride());
  WriteRows(dv.get(), Hp, cols, L.H, 1.f, static_cast<T*>(g.dv) + L.kv_row(b, s0, kvh),
            L.kv_stride());
}

// dQ (and dbias) of one (batch, head, query block).
template <int W, typename T>
JAX_FLASH_INLINE void QueryBlockItem(const BackwardArgs& g, const float* delta, int64_t item) {
  constexpr int64_t kRows = Block<W>::kRows, kCols = Block<W>::kCols;
  const ForwardArgs& a = g.fwd;
  const Layout L(a.shape);
  const QueryBlock qb = DecodeQueryBlock(a, item);
  const Sequence& seq = qb.seq;
  const int64_t kvh = seq.n / L.group, Hp = RoundUp(L.H, kCols);
  const int64_t m = RoundUp(std::max<int64_t>(qb.live, 1), kRows);
  constexpr int64_t C = kKeyTile;

  float* dbias = g.dbias == nullptr ? nullptr : g.dbias + L.stat(seq.b, seq.n, qb.t0) * L.S;
  if (dbias != nullptr) std::memset(dbias, 0, sizeof(float) * qb.rows * L.S);
  FloatBuffer dq = ZeroedFloats(m * Hp);
  const Span keys = KeysOfRows(a.spec, qb.t0, qb.live, seq.q_len, seq.kv_len);
  if (!keys.empty()) {
    FloatBuffer qs = ZeroedFloats(m * Hp), dos = ZeroedFloats(m * Hp),
                kt = ZeroedFloats(Hp * C), k_tile = ZeroedFloats(C * Hp),
                vt = ZeroedFloats(Hp * C), p = ZeroedFloats(m * C), ds = ZeroedFloats(m * C),
                cap_grad = ZeroedFloats(a.spec.softcap > 0.f ? m * C : 0);
    float* softcap_derivative = a.spec.softcap > 0.f ? cap_grad.get() : nullptr;
    const T* q = static_cast<const T*>(a.q) + L.q_row(seq.b, qb.t0, seq.n);
    const T* dout = static_cast<const T*>(g.dout) + L.q_row(seq.b, qb.t0, seq.n);
    const T* k = static_cast<const T*>(a.k) + L.kv_row(seq.b, 0, kvh);
    const T* v = static_cast<const T*>(a.v) + L.kv_row(seq.b, 0, kvh);
    const float* lse = a.lse + L.stat(seq.b, seq.n, qb.t0);
    const float* row_delta = delta + L.stat(seq.b, seq.n, qb.t0);
    StageRows(q, L.q_stride(), qb.live, L.H, a.spec.scale, qs.get(), Hp, m);
    StageRows(dout, L.q_stride(), qb.live, L.H, 1.f, dos.get(), Hp, m);
    for (int64_t s0 = keys.begin; s0 < keys.end; s0 += C) {
      const int64_t cols = std::min(C, keys.end - s0);
      StageColumns(k + s0 * L.kv_stride(), L.kv_stride(), cols, L.H, 1.f, kt.get(), C, Hp);
      StageRows(k + s0 * L.kv_stride(), L.kv_stride(), cols, L.H, 1.f, k_tile.get(), Hp, C);
      StageColumns(v + s0 * L.kv_stride(), L.kv_stride(), cols, L.H, 1.f, vt.get(), C, Hp);
      Gemm<W>(m, C, Hp, qs.get(), Hp, kt.get(), C, p.get(), C, false);
      const ScoreTile tile{p.get(), C, 1, qb.t0, s0, qb.live, cols, qb.live, C};
      FinishScores<W>(a, seq, tile, m * C, softcap_derivative);
      Gemm<W>(m, C, Hp, dos.get(), Hp, vt.get(), C, ds.get(), C, false);
      for (int64_t r = 0; r < qb.live; ++r) {
        float* p_row = p.get() + r * C;
        float* ds_row = ds.get() + r * C;
        ExpMinus<W>(p_row, C, Splat<W>(LseForExp(lse[r])));
        const VecF<W> row_d = Splat<W>(row_delta[r]);
        for (int64_t c = 0; c < C; c += W) {
          Store<W>(ds_row + c, Load<W>(p_row + c) * (Load<W>(ds_row + c) - row_d));
        }
        if (dbias != nullptr) std::memcpy(dbias + r * L.S + s0, ds_row, sizeof(float) * cols);
        if (softcap_derivative != nullptr) {
          for (int64_t c = 0; c < C; c += W) {
            Store<W>(ds_row + c, Load<W>(ds_row + c) * Load<W>(softcap_derivative + r * C + c));
          }
        }
      }
      Gemm<W>(m, Hp, C, ds.get(), C, k_tile.get(), Hp, dq.get(), Hp, true);
    }
  }
  T* dq_out = static_cast<T*>(g.dq) + L.q_row(seq.b, qb.t0, seq.n);
  WriteRows(dq.get(), Hp, qb.live, L.H, a.spec.scale, dq_out, L.q_stride());
  ZeroRows(qb.rows - qb.live, L.H, dq_out + qb.live * L.q_stride(), L.q_stride());
}

// Items [0, KeyBlockCount) are key blocks, the rest query blocks.
template <int W, typename T>
JAX_FLASH_INLINE void BackwardItem(const BackwardArgs& g, const float* delta, int64_t item) {
  const int64_t key_items = KeyBlockCount(g.fwd.shape);
  if (item < key_items) {
    KeyBlockItem<W, T>(g, delta, item);
  } else {
    QueryBlockItem<W, T>(g, delta, item - key_items);
  }
}

}  // namespace jax_flash::cpu
