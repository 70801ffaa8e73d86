// Backward of the v1 and v2 schedules (FlashAttention-2 kernels, sm_80 tensor cores).
//
//   1. preprocess: D = rowsum(dout * out) per query row (dq_accum is zeroed by a memset).
//   2. dkdv: one CTA per key block (and kv head, batch) keeps K, V in shared memory and dK, dV
//      in registers, and walks every query block of every query head that reads its kv head:
//      recompute S = Q K^T and P = exp(S - lse), dP = dO V^T, dS = P (dP - D); then
//      dV += P^T dO (warps 0-3), dK += dS^T Q (warps 4-7), and dQ (= dS K) is added into the
//      fp32 dq_accum.
//   3. convert: dq = scale * dq_accum, rounded to the element type.
// dq_accum keeps each query block (64 or 128 rows) in the order of the dQ MMA fragments
// (DqLayout): a warp's atomic add of one fragment element covers 32 consecutive floats, one
// instruction per element with an immediate offset, where a row-major layout scatters it over
// 8 rows.
// v2 runs the key blocks of a head in parallel and adds dQ with fp32 atomics; v1 runs one CTA
// per (batch, kv head) over all key blocks in turn (FlashAttention-1's order), which owns its
// rows of dq_accum and adds without atomics.
#include "device_attribute.h"
#include "tile.cuh"
#include "v1v2.h"

namespace jax_flash {
namespace {

using namespace tile;

// dQ of a kRows-row query block: kRows / 32 x kColumnWarps warps of 32 rows x
// kHeadDim / kColumnWarps columns. Element i = (m * NT + n) * 4 + e of a thread's fragments
// lives at dq_accum offset (warp * kPerThread + i) * 32 + lane of the block.
template <int kHeadDim, int kRows_>
struct DqLayout {
  static constexpr int kRows = kRows_, kThreads = 256;
  static constexpr int kColumnWarps = 8 / (kRows / 32);
  static constexpr int MT = 2, NT = kHeadDim / 8 / kColumnWarps;
  static constexpr int kPerThread = MT * NT * 4;
  static constexpr int kBlockFloats = kRows * kHeadDim;
  static_assert(kBackwardQueryBlockMultiple % kRows == 0, "dq_accum's rows hold whole blocks");
  __device__ static int row0(int warp) { return (warp / kColumnWarps) * 32; }
  __device__ static int col0(int warp) { return (warp % kColumnWarps) * (kHeadDim / kColumnWarps); }
  __device__ static int row(int warp, int i, int lane) {
    return row0(warp) + c_row(i / (4 * NT), i % 4, lane);
  }
  __device__ static int col(int warp, int i, int lane) {
    return col0(warp) + c_col(i / 4 % NT, i % 4, lane);
  }
  // This thread's first element of query block `block` of (b, head).
  __device__ static float* thread_base(float* dq_accum, const AttentionShape& shape, int b,
                                       int head, int block, int warp, int lane) {
    const int64_t blocks = (shape.q_len + kRows - 1) / kRows;
    return dq_accum + ((b * shape.num_heads + head) * blocks + block) * kBlockFloats +
           warp * kPerThread * 32 + lane;
  }
};

// Tile shape of a dK / dV CTA: query rows per iteration, keys per CTA, query-side buffers (two
// overlap the next query block's loads with this one's products), column chunks of the dQ
// product (see dkdv_kernel), and how many of the four warps of the dV (and of the dK) product
// split its keys (the others split its columns).
template <int kBlockM_, int kBlockN_, int kStages_, int kDqChunks_ = 1,
          int kKvKeyWarps_ = kBlockN_ / 32>
struct BwdShape {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kDqChunks = kDqChunks_, kKvKeyWarps = kKvKeyWarps_;
};

// Head dim 64 takes 128 query rows per iteration, as FlashAttention-2 does: +4.6..+8.0% over
// 64 rows on the H200 (harness --tune, session 14); the general variant (bias, mask, softcap)
// keeps 64, where 128 spills 608 bytes. At 128, 128 x 64 loses 16-20% to 64 x 128. At 256 the
// shared memory holds 64 keys. Its two query-side buffers take 217 KB, which sm_90 offers a CTA
// and sm_80 (163 KB) does not: there it keeps one (launch_backward). On the H200 two are 4-14%
// faster (harness --tune, session 13), and the plain kernel's dQ in two column chunks
// +1.4..+3.8% more (two interleaved rounds, session 14; at 128 and 64 chunks lose 0.4-1.9%).
// The dV / dK warps split a 128-key block 4 x 1 (keys x columns) at head dim 64 and 2 x 2 at 128
// (BwdLayout), a 64-key block 2 x 2.
template <int kHeadDim, bool kGeneral>
using BwdDefaultShape = BwdShape<kHeadDim <= 64 && !kGeneral ? 128 : 64, kHeadDim <= 128 ? 128 : 64,
                                 2, (kHeadDim > 128 && !kGeneral) ? 2 : 1, kHeadDim <= 64 ? 4 : 2>;
using BwdOneStageShape256 = BwdShape<64, 64, 1>;

template <int kHeadDim, typename Shape>
struct BwdLayout {
  static constexpr int kThreads = 256;                 // 8 warps
  static constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kStages = Shape::kStages;
  using Dq = DqLayout<kHeadDim, kBlockM>;
  // S and dP: kBlockM / 32 x kSKeyWarps warps of 32 rows x kBlockN / kSKeyWarps keys, the
  // same 32-row warp rows as the dQ product.
  static constexpr int kSKeyWarps = Dq::kColumnWarps;
  static constexpr int MT_S = 2, NT_S = kBlockN / 8 / kSKeyWarps;
  static_assert(2 * kBlockM <= kThreads, "one thread per lse / D element of a query block");
  // dV on warps 0-3, dK on warps 4-7, each kBlockN / kKvKeyWarps keys x kHeadDim /
  // kKvColumnWarps columns, so every fragment of dO / Q read from shared memory feeds MT_KV MMAs
  // and every fragment of P / dS NT_KV (spreading both products over all 8 warps, 4 x 2, would
  // read 6 fragments per 16 MMAs). Per k-step at head dim 128, 2 x 2 (64 keys x 64 columns)
  // reads 8 fragments per 32 MMAs where 4 x 1 (32 keys x 128) reads 10, and ptxas spills none
  // of the 40 bytes 4 x 1 does: 0.0-0.7% faster (harness --tune, session 31); at head dim 64
  // both read 6 per 16. A 64-key block (head dim 256) splits 2 x 2 rather than 16 keys x the
  // whole head dim, which reads 17 fragments per 32 MMAs.
  static constexpr int kKvKeyWarps = Shape::kKvKeyWarps, kKvColumnWarps = 4 / kKvKeyWarps;
  static_assert(kKvKeyWarps * kKvColumnWarps == 4, "four warps per product");
  static constexpr int kKvWarpKeys = kBlockN / kKvKeyWarps;
  static constexpr int MT_KV = kKvWarpKeys / 16, NT_KV = kHeadDim / 8 / kKvColumnWarps;
  using KVTile = Tile<kBlockN, kHeadDim>;
  using QTile = Tile<kBlockM, kHeadDim>;
  using PTile = Tile<kBlockM, kBlockN>;
  static constexpr int kRowStatsBytes = 2 * kBlockM * 4;  // lse and D of one query block
  static constexpr int kSmemBytes = 2 * KVTile::kBytes + kStages * 2 * QTile::kBytes +
                                    2 * PTile::kBytes + kStages * kRowStatsBytes;
};

// D = rowsum(dout * out) for every (b, t, n) row: kLanes = (head-dim capacity) / 8 lanes per
// row, one 16-byte chunk of out and dout each, so every lane has loads in flight.
template <typename T, int kLanes>
__global__ void __launch_bounds__(256) preprocess_kernel(const __grid_constant__ BackwardArgs args,
                                                         const BackwardWorkspace ws) {
  constexpr int kRowsPerBlock = 256 / kLanes;
  const AttentionShape& shape = args.fwd.shape;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const int chunk = threadIdx.x % kLanes;
  const int head_dim = static_cast<int>(shape.head_dim);
  const bool valid = row < shape.batch * shape.q_len * shape.num_heads;  // (b, t, n)
  float sum = 0.f;
  if (valid && chunk < head_dim / 8) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(args.fwd.out) +
                                                    row * head_dim + chunk * 8);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const T*>(args.dout) +
                                                    row * head_dim + chunk * 8);
    const T* oe = reinterpret_cast<const T*>(&o);
    const T* de = reinterpret_cast<const T*>(&d);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += Element<T>::to_float(oe[i]) * Element<T>::to_float(de[i]);
  }
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (valid && chunk == 0) {
    const int64_t n = row % shape.num_heads, t = row / shape.num_heads % shape.q_len,
                  b = row / (shape.num_heads * shape.q_len);
    ws.dsum[(b * shape.num_heads + n) * shape.q_len + t] = sum;
  }
}

// dq = scale * dq_accum for one query block (Dq::kRows) of one (b, head): each thread reads its
// fragment elements (coalesced), the block is reassembled in shared memory and written out in
// 16-byte rows.
template <typename T, int kHeadDim, typename Dq>
__global__ void __launch_bounds__(256) convert_dq_kernel(const __grid_constant__ BackwardArgs args,
                                                         const BackwardWorkspace ws) {
  using BlockTile = Tile<Dq::kRows, kHeadDim>;
  __shared__ __align__(16) unsigned char smem[BlockTile::kBytes];
  const AttentionShape& shape = args.fwd.shape;
  const int block = blockIdx.x, head = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* src = Dq::thread_base(ws.dq_accum, shape, b, head, block, warp, lane);
  const float scale = args.fwd.spec.scale;
  const BlockTile tile{smem_address(smem)};
#pragma unroll
  for (int i = 0; i < Dq::kPerThread; i += 2)  // elements i, i + 1: adjacent columns
    store_shared_4(tile.at(Dq::row(warp, i, lane), Dq::col(warp, i, lane)),
                   Element<T>::pack(src[i * 32] * scale, src[(i + 1) * 32] * scale));
  __syncthreads();
  const int q_len = static_cast<int>(shape.q_len), head_dim = static_cast<int>(shape.head_dim);
  const auto dq = HeadRows<T>::of(args.dq, b, q_len, shape.num_heads, head, head_dim);
  const int r0 = block * Dq::kRows;
  tile.template store_rows<Dq::kThreads, Dq::kRows>(dq.row(r0), dq.stride, 0, q_len - r0,
                                                    head_dim / 8, threadIdx.x);
}

template <typename T, int kHeadDim, typename Shape, bool kGeneral>
__global__ void __launch_bounds__(256, 1)
    dkdv_kernel(const __grid_constant__ BackwardArgs args, const BackwardWorkspace ws,
                bool sequential) {
  using L = BwdLayout<kHeadDim, Shape>;
  constexpr int MT_S = L::MT_S, NT_S = L::NT_S, MT_KV = L::MT_KV, NT_KV = L::NT_KV;
  constexpr int MT_Q = L::Dq::MT, NT_Q = L::Dq::NT;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const ForwardArgs& fwd = args.fwd;
  const AttentionShape& shape = fwd.shape;
  const int kv_head = blockIdx.y, b = blockIdx.z;
  const int group = static_cast<int>(shape.num_heads / shape.num_kv_heads);
  const int q_len = static_cast<int>(shape.q_len), kv_len = static_cast<int>(shape.kv_len);
  const int head_dim = static_cast<int>(shape.head_dim), chunks = head_dim / 8;
  const auto k = HeadRows<const T>::of(fwd.k, b, kv_len, shape.num_kv_heads, kv_head, head_dim);
  const auto v = HeadRows<const T>::of(fwd.v, b, kv_len, shape.num_kv_heads, kv_head, head_dim);
  const auto dk = HeadRows<T>::of(args.dk, b, kv_len, shape.num_kv_heads, kv_head, head_dim);
  const auto dv = HeadRows<T>::of(args.dv, b, kv_len, shape.num_kv_heads, kv_head, head_dim);
  const Band band = Band::of(fwd, b);

  const typename L::KVTile sK{smem_address(smem)};
  const typename L::KVTile sV{sK.base + L::KVTile::kBytes};
  const uint32_t q_side = sV.base + L::KVTile::kBytes;  // per stage: Q tile, dO tile
  const typename L::PTile sP{q_side + L::kStages * 2 * L::QTile::kBytes};
  const typename L::PTile sdS{sP.base + L::PTile::kBytes};
  float* row_stats = reinterpret_cast<float*>(smem + (sdS.base + L::PTile::kBytes - sK.base));
  const auto q_tile = [&](int stage) { return typename L::QTile{q_side + stage * 2 * L::QTile::kBytes}; };
  const auto do_tile = [&](int stage) {
    return typename L::QTile{q_side + (stage * 2 + 1) * L::QTile::kBytes};
  };
  const auto stage_lse = [&](int stage) { return row_stats + stage * 2 * L::kBlockM; };
  const auto stage_dsum = [&](int stage) { return row_stats + (stage * 2 + 1) * L::kBlockM; };

  // Warp tiles of the three products.
  const int s_r0 = (warp / L::kSKeyWarps) * 32;
  const int s_c0 = (warp % L::kSKeyWarps) * (L::kBlockN / L::kSKeyWarps);
  const int kv_r0 = (warp % L::kKvKeyWarps) * L::kKvWarpKeys;
  const int kv_c0 = (warp % 4 / L::kKvKeyWarps) * (kHeadDim / L::kKvColumnWarps);
  const bool dk_warp = warp >= 4;  // this warp accumulates dK, else dV
  const int q_r0 = L::Dq::row0(warp), q_c0 = L::Dq::col0(warp);

  const int num_blocks = sequential ? (kv_len + L::kBlockN - 1) / L::kBlockN : 1;
  for (int jj = 0; jj < num_blocks; ++jj) {
    const int c0 = (sequential ? jj : static_cast<int>(blockIdx.x)) * L::kBlockN;
    const int row_begin = band.row_begin(c0), row_end = band.row_end(c0, c0 + L::kBlockN);
    const int i_begin = row_begin / L::kBlockM;
    const int per_head = row_begin < row_end ? (row_end + L::kBlockM - 1) / L::kBlockM - i_begin : 0;
    const int total = group * per_head;  // iterations: (query head, query block)
    const auto head_of = [&](int it) { return kv_head * group + it / per_head; };
    const auto row0_of = [&](int it) { return (i_begin + it % per_head) * L::kBlockM; };
    // Queues the query-side tiles of iteration `it` into its stage.
    const auto issue = [&](int it) {
      const int head = head_of(it), r0 = row0_of(it), stage = it % L::kStages;
      const auto q = HeadRows<const T>::of(fwd.q, b, q_len, shape.num_heads, head, head_dim);
      const auto dout = HeadRows<const T>::of(args.dout, b, q_len, shape.num_heads, head, head_dim);
      q_tile(stage).template load_async<L::kThreads>(q.row(r0), q.stride, q_len - r0, chunks, tid);
      do_tile(stage).template load_async<L::kThreads>(dout.row(r0), dout.stride, q_len - r0,
                                                      chunks, tid);
      const int64_t stats = (static_cast<int64_t>(b) * shape.num_heads + head) * q_len + r0;
      if (tid < 2 * L::kBlockM) {
        const int r = tid % L::kBlockM;
        const float* src = tid < L::kBlockM ? fwd.lse + stats : ws.dsum + stats;
        float* dst = tid < L::kBlockM ? stage_lse(stage) : stage_dsum(stage);
        cp_async_4(smem_address(dst + r), src + (r0 + r < q_len ? r : 0), r0 + r < q_len);
      }
    };

    if (jj > 0) __syncthreads();  // the previous key block's tiles are consumed
    float kv_acc[MT_KV][NT_KV][4];  // dK or dV (dk_warp) of this warp's keys from kv_r0
    zero(kv_acc);
    if (total > 0) {
      sK.template load_async<L::kThreads>(k.row(c0), k.stride, band.kv_len - c0, chunks, tid);
      sV.template load_async<L::kThreads>(v.row(c0), v.stride, band.kv_len - c0, chunks, tid);
      issue(0);
      cp_async_commit();
    }
    for (int it = 0; it < total; ++it) {
      const int head = head_of(it), r0 = row0_of(it), stage = it % L::kStages;
      const typename L::QTile sQ = q_tile(stage), sdO = do_tile(stage);
      cp_async_wait<0>();
      __syncthreads();  // this stage landed; the previous iteration's P and dS are consumed
      if (L::kStages > 1 && it + 1 < total) issue(it + 1);
      cp_async_commit();

      float s[MT_S][NT_S][4], dp[MT_S][NT_S][4];
      zero(s);
      warp_gemm<T, MT_S, NT_S, kHeadDim / 16>(
          s, [&](uint32_t(&a)[MT_S][4], int k0) { load_a(a, sQ, s_r0, k0, lane); },
          [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_nmajor(bf, sK, k0, s_c0 + n0, lane); });
      zero(dp);
      warp_gemm<T, MT_S, NT_S, kHeadDim / 16>(
          dp, [&](uint32_t(&a)[MT_S][4], int k0) { load_a(a, sdO, s_r0, k0, lane); },
          [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_nmajor(bf, sV, k0, s_c0 + n0, lane); });

      // P = exp(score - lse) in place.
      const Scores scores(fwd, b, head, band);
      const int t0 = r0 + s_r0, key0 = c0 + s_c0;
      const bool check = !scores.all_kept(t0, t0 + 32, key0, key0 + L::kBlockN / L::kSKeyWarps);
      // The softcap's chain factor 1 - tanh^2 of each score (general variant only).
      float chain[kGeneral ? MT_S : 1][kGeneral ? NT_S : 1][4];
      // A plain call masks by setting dropped scores to -inf (only on tiles the band cuts), so
      // every element takes the same FFMA + exp2: exp2(-inf) = 0, and lse2 = +inf (rows with no
      // kept key) gives exp2(-inf) = 0 as well. (A keep test per element, run on every tile
      // while all warps wait at the next barrier, cost 7-9% of the backward on the H200.)
      const float mul = kGeneral ? 1.f : scores.apply<false>(s, t0, key0, check, lane);
#pragma unroll
      for (int m = 0; m < MT_S; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = s_r0 + c_row(m, 2 * half, lane);
          const float lse = stage_lse(stage)[r];
          const float lse2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
#pragma unroll
          for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 2 * half; e < 2 * half + 2; ++e) {
              if constexpr (kGeneral) {
                const int t = r0 + r, key = key0 + c_col(n, e, lane);
                float saturation = 0.f;
                const bool kept = !check || scores.keeps(t, key);
                const float x2 = kept ? scores.log2_score(s[m][n][e], t, key, saturation) : 0.f;
                s[m][n][e] = kept ? fast_exp2(x2 - lse2) : 0.f;
                chain[m][n][e] = 1.f - saturation * saturation;
              } else {
                s[m][n][e] = fast_exp2(s[m][n][e] * mul - lse2);
              }
            }
        }
      // dS = P (dP - D) in place (its bias gradient before the softcap's chain factor).
      float* dbias = kGeneral && args.dbias != nullptr
                         ? args.dbias + (static_cast<int64_t>(b) * shape.num_heads + head) *
                                            static_cast<int64_t>(q_len) * kv_len
                         : nullptr;
#pragma unroll
      for (int m = 0; m < MT_S; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = s_r0 + c_row(m, 2 * half, lane);
          const float dsum = stage_dsum(stage)[r];
#pragma unroll
          for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 2 * half; e < 2 * half + 2; ++e) {
              const float ds = s[m][n][e] * (dp[m][n][e] - dsum);
              if constexpr (kGeneral) {
                const int t = r0 + r, key = key0 + c_col(n, e, lane);
                if (dbias != nullptr && t < q_len && key < kv_len)
                  dbias[static_cast<int64_t>(t) * kv_len + key] = ds;
                dp[m][n][e] = ds * chain[m][n][e];
              } else {
                dp[m][n][e] = ds;
              }
            }
        }
      store_c<T>(sP, s, s_r0, s_c0, lane);
      store_c<T>(sdS, dp, s_r0, s_c0, lane);
      __syncthreads();

      // dK += dS^T Q on dK warps, dV += P^T dO on dV warps.
      const typename L::PTile sA{dk_warp ? sdS.base : sP.base};
      const typename L::QTile sB{dk_warp ? sQ.base : sdO.base};
      warp_gemm<T, MT_KV, NT_KV, L::kBlockM / 16>(
          kv_acc, [&](uint32_t(&a)[MT_KV][4], int k0) { load_a_transposed(a, sA, kv_r0, k0, lane); },
          [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_kmajor(bf, sB, k0, kv_c0 + n0, lane); });

      // dQ = dS K in column chunks: a chunk's fp32 reductions are issued before the next
      // chunk's products, which run while they drain.
      constexpr int kChunks = Shape::kDqChunks, NT_C = NT_Q / kChunks;
      static_assert(NT_Q % (2 * kChunks) == 0, "B fragments load in pairs of n-tiles");
#pragma unroll
      for (int chunk = 0; chunk < kChunks; ++chunk) {
        float dq[MT_Q][NT_C][4];
        zero(dq);
        warp_gemm<T, MT_Q, NT_C, L::kBlockN / 16>(
            dq, [&](uint32_t(&a)[MT_Q][4], int k0) { load_a(a, sdS, q_r0, k0, lane); },
            [&](uint32_t(&bf)[4], int k0, int n0) {
              load_b_pair_kmajor(bf, sK, k0, q_c0 + 8 * NT_C * chunk + n0, lane);
            });
        // Padding rows and columns of the block add zeros: no bounds checks.
        float* accum = L::Dq::thread_base(ws.dq_accum, shape, b, head, r0 / L::kBlockM, warp, lane);
        const auto at = [&](int m, int n, int e) {
          return accum + ((m * NT_Q + NT_C * chunk + n) * 4 + e) * 32;
        };
        if (sequential) {  // this CTA owns the rows: plain read-modify-write
#pragma unroll
          for (int m = 0; m < MT_Q; ++m)
#pragma unroll
            for (int n = 0; n < NT_C; ++n)
#pragma unroll
              for (int e = 0; e < 4; ++e) *at(m, n, e) += dq[m][n][e];
        } else {
#pragma unroll
          for (int m = 0; m < MT_Q; ++m)
#pragma unroll
            for (int n = 0; n < NT_C; ++n)
#pragma unroll
              for (int e = 0; e < 4; ++e) atomicAdd(at(m, n, e), dq[m][n][e]);
        }
      }

      if (L::kStages == 1 && it + 1 < total) {
        __syncthreads();  // every warp is done with the only stage
        issue(it + 1);
        cp_async_commit();
      }
    }

    // dK = scale * dS^T Q; dK and dV staged through the K and V tiles for 16-byte stores.
    const float scale = dk_warp ? fwd.spec.scale : 1.f;
#pragma unroll
    for (int m = 0; m < MT_KV; ++m)
#pragma unroll
      for (int n = 0; n < NT_KV; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) kv_acc[m][n][e] *= scale;
    __syncthreads();  // every warp is done reading K and V
    store_c<T>(dk_warp ? sK : sV, kv_acc, kv_r0, kv_c0, lane);
    __syncthreads();
    sK.template store_rows<L::kThreads, L::kBlockN>(dk.row(c0), dk.stride, 0, kv_len - c0, chunks, tid);
    sV.template store_rows<L::kThreads, L::kBlockN>(dv.row(c0), dv.stride, 0, kv_len - c0, chunks, tid);
  }
}

template <typename T, int kHeadDim, typename Shape, bool kGeneral>
cudaError_t launch_backward_kernels(const BackwardArgs& args, const BackwardWorkspace& ws,
                                    bool sequential, cudaStream_t stream) {
  using L = BwdLayout<kHeadDim, Shape>;
  const AttentionShape& shape = args.fwd.shape;
  cudaError_t err;
  if (args.dbias != nullptr) {
    err = cudaMemsetAsync(args.dbias, 0,
                          sizeof(float) * shape.batch * shape.num_heads * shape.q_len * shape.kv_len,
                          stream);
    if (err != cudaSuccess) return err;
  }
  err = cudaMemsetAsync(ws.dq_accum, 0, sizeof(float) * backward_dq_accum_elements(shape), stream);
  if (err != cudaSuccess) return err;
  const int64_t rows = shape.batch * shape.q_len * shape.num_heads;
  if (rows > 0) {
    constexpr int kLanes = kHeadDim / 8, kRowsPerBlock = 256 / kLanes;
    preprocess_kernel<T, kLanes>
        <<<(rows + kRowsPerBlock - 1) / kRowsPerBlock, 256, 0, stream>>>(args, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  const int64_t key_blocks = (shape.kv_len + L::kBlockN - 1) / L::kBlockN;
  if (key_blocks > 0) {
    auto kernel = dkdv_kernel<T, kHeadDim, Shape, kGeneral>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmemBytes);
    if (err != cudaSuccess) return err;
    const dim3 grid(sequential ? 1 : key_blocks, shape.num_kv_heads, shape.batch);
    kernel<<<grid, L::kThreads, L::kSmemBytes, stream>>>(args, ws, sequential);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (rows > 0) {
    const dim3 grid((shape.q_len + L::kBlockM - 1) / L::kBlockM, shape.num_heads, shape.batch);
    convert_dq_kernel<T, kHeadDim, typename L::Dq><<<grid, L::Dq::kThreads, 0, stream>>>(args, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The plain kernel (scale only, no bias, mask or softcap) or the general one, each in its shape.
template <typename T, int kHeadDim, typename PlainShape = BwdDefaultShape<kHeadDim, false>,
          typename GeneralShape = BwdDefaultShape<kHeadDim, true>>
cudaError_t launch_backward_typed(const BackwardArgs& args, const BackwardWorkspace& ws,
                                  bool sequential, cudaStream_t stream) {
  if (Scores::general(args.fwd))
    return launch_backward_kernels<T, kHeadDim, GeneralShape, true>(args, ws, sequential, stream);
  return launch_backward_kernels<T, kHeadDim, PlainShape, false>(args, ws, sequential, stream);
}

cudaError_t launch_backward(const BackwardArgs& args, const BackwardWorkspace& ws,
                            bool sequential, cudaStream_t stream) {
  const AttentionShape& s = args.fwd.shape;
  if (s.q_len >= tile::kUnbounded || s.kv_len >= tile::kUnbounded || s.batch > 65535 ||
      s.num_heads > 65535 || ws.dq_accum == nullptr || ws.dsum == nullptr)
    return cudaErrorInvalidValue;
  if (s.batch * s.num_kv_heads == 0) return cudaSuccess;
  return tile::dispatch_dtype(args.fwd.dtype, [&](auto element) {
    using T = decltype(element);
    return dispatch_head_dim_capacity(s.head_dim, [&](auto cap) {
      constexpr int kCapacity = decltype(cap)::value;
      if constexpr (kCapacity == 256) {
        int optin = 0;
        const cudaError_t err =
            current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin);
        if (err != cudaSuccess) return err;
        if (optin < BwdLayout<256, BwdDefaultShape<256, false>>::kSmemBytes)
          return launch_backward_typed<T, 256, BwdOneStageShape256, BwdOneStageShape256>(
              args, ws, sequential, stream);
      }
      return launch_backward_typed<T, kCapacity>(args, ws, sequential, stream);
    });
  });
}

}  // namespace

cudaError_t launch_v1_backward(const BackwardArgs& args, const BackwardWorkspace& workspace,
                               cudaStream_t stream) {
  return launch_backward(args, workspace, /*sequential=*/true, stream);
}

cudaError_t launch_v2_backward(const BackwardArgs& args, const BackwardWorkspace& workspace,
                               cudaStream_t stream) {
  return launch_backward(args, workspace, /*sequential=*/false, stream);
}

}  // namespace jax_flash
