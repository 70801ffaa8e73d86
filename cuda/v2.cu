// v2: the FlashAttention-2 forward schedule on sm_80 tensor cores.
//
// One CTA per (query block, head, batch). Each warp owns whole query rows (sliced-Q), so the
// softmax statistics never leave the warp; the output accumulates unnormalized in registers and
// is divided by the row sums once, at the end. K and V tiles stream through shared memory: V of
// tile j loads during Q K^T of tile j, K of tile j + 1 during the softmax and P V of tile j (two
// barriers per tile), into a second K buffer up to head dim 128 (kRunningMax), else into K's.
// Measured on the H200 (session 13) against two stages of K and V (one barrier per tile):
// -2..+5.5% at the same tile, and the smaller footprint lets head dim 256 run two 64-row CTAs
// per SM (+11-14% over one 128-row CTA of 8 warps) and head dim 64 take 128-key steps (+7-10%).
#include <type_traits>

#include "tile.cuh"
#include "v1v2.h"

namespace jax_flash {
namespace {

using namespace tile;

// Tile shape of a forward CTA: query rows, keys per step, warps (each owns kBlockM / kWarps
// whole rows).
template <int kBlockM_, int kBlockN_, int kWarps_>
struct V2Shape {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kWarps = kWarps_;
};

// Shapes per head-dim capacity, two CTAs of 4 warps per SM. Up to 128 a warp owns 32 rows (two
// m-tiles: each K / V fragment read from shared memory feeds two MMAs), with 128-key steps at
// head dim 64; at 256 the accumulator of 32 rows would not fit in registers, so a warp owns 16.
template <int kHeadDim>
using V2DefaultShape = std::conditional_t<
    kHeadDim <= 64, V2Shape<128, 128, 4>,
    std::conditional_t<kHeadDim <= 128, V2Shape<128, 64, 4>, V2Shape<64, 64, 4>>>;

template <int kHeadDim, typename Shape>
struct V2Layout {
  static constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kWarps = Shape::kWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpRows = kBlockM / kWarps;
  static constexpr int MT = kWarpRows / 16;  // m-tiles per warp
  static constexpr int NT_S = kBlockN / 8;   // n-tiles of the score tile
  static constexpr int NT_O = kHeadDim / 8;  // n-tiles of the output
  using QTile = Tile<kBlockM, kHeadDim>;
  using KVTile = Tile<kBlockN, kHeadDim>;
  // Up to head dim 128 a key tile after the first exponentiates at the running row maxima
  // (RowSoftmax::exponentiate_at_running_max) and recomputes its scores in the rare tile where
  // that does not fit, so K of tile j must outlive the load of tile j + 1: two K buffers. At 256
  // they would not leave room for two CTAs per SM; it keeps conditional rescaling of the max.
  static constexpr bool kRunningMax = kHeadDim <= 128;
  static constexpr int kKBuffers = kRunningMax ? 2 : 1;
  static constexpr int kSmemBytes = QTile::kBytes + (kKBuffers + 1) * KVTile::kBytes;
  // Two CTAs of 4 warps share an SM (registers allow 2 x 128 threads x 255).
  static constexpr int kMinBlocksPerSm = kWarps == 4 ? 2 : 1;
};

// Rows of a query block that keep no key: out = 0, lse = -inf.
template <typename T, int kThreads, int kRows>
__device__ void write_empty_rows(HeadRows<T> out, float* lse, int row0, int valid_rows,
                                 int head_dim) {
  const int chunks = head_dim / 8;
  for (int c = threadIdx.x; c < kRows * chunks; c += kThreads) {
    const int r = c / chunks, chunk = c % chunks;
    if (r < valid_rows) *reinterpret_cast<uint4*>(out.row(row0 + r) + chunk * 8) = uint4{0, 0, 0, 0};
  }
  for (int r = threadIdx.x; r < valid_rows; r += kThreads) lse[row0 + r] = -INFINITY;
}

template <typename T, int kHeadDim, typename Shape, bool kGeneral>
__global__ void __launch_bounds__(V2Layout<kHeadDim, Shape>::kThreads,
                                  V2Layout<kHeadDim, Shape>::kMinBlocksPerSm)
    v2_forward_kernel(const __grid_constant__ ForwardArgs args) {
  using L = V2Layout<kHeadDim, Shape>;
  constexpr int MT = L::MT, NT_S = L::NT_S, NT_O = L::NT_O;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  // Under causal masking the last query blocks see the most keys: start them first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y, b = blockIdx.z;
  const AttentionShape& shape = args.shape;
  const int q_len = static_cast<int>(shape.q_len), kv_len = static_cast<int>(shape.kv_len);
  const int head_dim = static_cast<int>(shape.head_dim), chunks = head_dim / 8;
  const ForwardHead<T> operands = ForwardHead<T>::of(args, b, head);
  const HeadRows<const T> q = operands.q, k = operands.k, v = operands.v;
  const HeadRows<T> out = operands.out;
  float* lse = operands.lse;

  const Scores scores(args, b, head);
  const int row0 = m_block * L::kBlockM;
  const int valid_rows = min(L::kBlockM, q_len - row0);
  const int key_begin = scores.band.key_begin(row0);
  const int key_end = scores.band.key_end(row0, row0 + L::kBlockM);
  if (key_begin >= key_end) {
    write_empty_rows<T, L::kThreads, L::kBlockM>(out, lse, row0, valid_rows, head_dim);
    return;
  }
  const int j_begin = key_begin / L::kBlockN;
  const int j_end = (key_end + L::kBlockN - 1) / L::kBlockN;

  const typename L::QTile sQ{smem_address(smem)};
  const typename L::KVTile sV{sQ.base + L::QTile::kBytes};
  // K of tile j in buffer j % kKBuffers.
  const auto k_buffer = [&](int j) {
    return typename L::KVTile{sV.base + (1 + j % L::kKBuffers) * L::KVTile::kBytes};
  };
  const auto load = [&](const HeadRows<const T>& from, typename L::KVTile to, int j) {
    const int col0 = j * L::kBlockN;
    to.template load_async<L::kThreads>(from.row(col0), from.stride, kv_len - col0, chunks, tid);
  };
  sQ.template load_async<L::kThreads>(q.row(row0), q.stride, valid_rows, chunks, tid);
  load(k, k_buffer(j_begin), j_begin);
  cp_async_commit();

  const int warp_row0 = warp * L::kWarpRows;  // within the block
  const int rows_begin = row0 + warp_row0, rows_end = rows_begin + L::kWarpRows;
  float o[MT][NT_O][4];
  zero(o);
  // Conditional rescaling of the max (harness A/B, session 13): +0.6..+2.0% at 256; at head
  // dims 64 / 128, tiles at the running max (kRunningMax) instead, whose fallback takes the
  // tile's max.
  RowSoftmax<MT, !L::kRunningMax> softmax;
  softmax.init();

  for (int j = j_begin; j < j_end; ++j) {
    const int col0 = j * L::kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K of tile j landed; every warp is done with V of tile j - 1
    load(v, sV, j);
    cp_async_commit();

    float s[MT][NT_S][4];
    const typename L::KVTile sK = k_buffer(j);
    const bool check = !scores.all_kept(rows_begin, rows_end, col0, col0 + L::kBlockN);
    const auto scores_of_tile = [&] {  // s = the tile's scores, masked; returns their factor
      zero(s);
      warp_gemm<T, MT, NT_S, kHeadDim / 16>(
          s, [&](uint32_t(&a)[MT][4], int k0) { load_a(a, sQ, warp_row0, k0, lane); },
          [&](uint32_t(&bf)[4], int k0, int n0) { load_b_pair_nmajor(bf, sK, k0, n0, lane); });
      return scores.apply<kGeneral>(s, rows_begin, col0, check, lane);
    };
    float mul = scores_of_tile();
    // K of tile j + 1 loads during the softmax and P V of tile j.
    cp_async_wait<0>();
    __syncthreads();  // V of tile j landed; every warp is done with the K buffer tile j + 1
                      // loads into (tile j - 1's; with one buffer, tile j's)
    if (j + 1 < j_end) load(k, k_buffer(j + 1), j + 1);
    cp_async_commit();
    // The first tile sets the maxima; the later ones try the running maxima first.
    const bool tried = L::kRunningMax && j > j_begin;
    if (!(tried && softmax.exponentiate_at_running_max(s, mul, rows_begin, scores.band.q_len,
                                                       lane))) {
      if (tried) mul = scores_of_tile();  // s holds the failed attempt's terms
      float rescale[2 * MT];
      if (softmax.update(s, mul, rescale)) scale_rows(o, rescale);
    }

#pragma unroll
    for (int kk = 0; kk < L::kBlockN / 16; ++kk) {
      uint32_t a[MT][4];
      c_to_a<T>(a, s, kk);
      mma_k_step<T>(o, a, [&](uint32_t(&bv)[4], int n0) { load_b_pair_kmajor(bv, sV, 16 * kk, n0, lane); });
    }
  }

  float inv_sum[2 * MT], row_lse[2 * MT];
  softmax.finish(inv_sum, row_lse);
  scale_rows(o, inv_sum);
  // Stage the warp's rows (as T) in its own rows of the Q tile, which only it reads, and write
  // them out 16 bytes per lane.
  __syncwarp();  // the warp's last reads of its Q rows precede the lanes' writes
  store_c<T>(sQ, o, warp_row0, 0, lane);
  __syncwarp();
  sQ.template store_rows<32, L::kWarpRows>(out.row(rows_begin), out.stride, warp_row0,
                                           q_len - rows_begin, chunks, lane);
  if (lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
      const int t = rows_begin + c_row(r / 2, 2 * (r % 2), lane);
      if (t < q_len) lse[t] = row_lse[r];
    }
  }
}

template <typename T, int kHeadDim, typename Shape = V2DefaultShape<kHeadDim>>
cudaError_t launch_v2_forward_typed(const ForwardArgs& args, cudaStream_t stream) {
  using L = V2Layout<kHeadDim, Shape>;
  auto kernel = Scores::general(args) ? v2_forward_kernel<T, kHeadDim, Shape, true>
                                      : v2_forward_kernel<T, kHeadDim, Shape, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         L::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((args.shape.q_len + L::kBlockM - 1) / L::kBlockM, args.shape.num_heads,
                  args.shape.batch);
  kernel<<<grid, L::kThreads, L::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_v2_forward(const ForwardArgs& args, cudaStream_t stream) {
  const AttentionShape& s = args.shape;
  if (s.batch * s.q_len * s.num_heads == 0) return cudaSuccess;
  if (s.q_len >= tile::kUnbounded || s.kv_len >= tile::kUnbounded || s.batch > 65535 ||
      s.num_heads > 65535)
    return cudaErrorInvalidValue;
  return tile::dispatch_dtype(args.dtype, [&](auto element) {
    using T = decltype(element);
    return dispatch_head_dim_capacity(s.head_dim, [&](auto cap) {
      return launch_v2_forward_typed<T, decltype(cap)::value>(args, stream);
    });
  });
}

}  // namespace jax_flash
