// v1: the FlashAttention-1 forward schedule on sm_80 tensor cores.
//
// One CTA per (batch, head) walks the whole attention matrix: key blocks outermost (K and V
// stay in shared memory), query steps of 16 rows inside. The four warps split each key block
// (sliced-K): every warp scores the step's rows against its quarter of the keys, the row maxima
// and sums meet in shared memory behind a barrier, each warp multiplies its probabilities by its
// quarter of V, and the partial outputs are summed through shared memory. The step's output is
// then merged, normalized, with the running output of the earlier key blocks, which lives in
// the fp32 workspace o_accum (with the running logsumexp in lse) between visits.
#include "tile.cuh"
#include "v1v2.h"

namespace jax_flash {
namespace {

using namespace tile;

template <int kHeadDim>
struct V1Layout {
  static constexpr int kWarps = 4, kThreads = 128, kStepRows = 16;
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;  // keys per block
  static constexpr int kWarpKeys = kBlockN / kWarps;
  static constexpr int NT_S = kWarpKeys / 8;   // n-tiles of a warp's scores
  static constexpr int NT_O = kHeadDim / 8;    // n-tiles of a warp's partial output
  using KVTile = Tile<kBlockN, kHeadDim>;
  using QTile = Tile<kStepRows, kHeadDim>;
  // Partial outputs, fp32, padded by 8 floats: a half-warp's 8-byte stores hit distinct banks.
  static constexpr int kOStride = kHeadDim + 8;
  static constexpr int kPartialBytes = kWarps * kStepRows * kOStride * 4;
  static constexpr int kStatsBytes = 2 * kWarps * kStepRows * 4;  // row max and row sum
  static constexpr int kSmemBytes =
      2 * KVTile::kBytes + 2 * QTile::kBytes + kPartialBytes + kStatsBytes;
};

// log(exp(a) + exp(b)), with -inf for "nothing".
__device__ float log_add_exp(float a, float b) {
  const float hi = fmaxf(a, b);
  return hi == -INFINITY ? -INFINITY : hi + log1pf(__expf(-fabsf(a - b)));
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(128, 1) v1_forward_kernel(const __grid_constant__ ForwardArgs args,
                                                         float* o_accum) {
  using L = V1Layout<kHeadDim>;
  constexpr int NT_S = L::NT_S, NT_O = L::NT_O;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int head = blockIdx.x, b = blockIdx.y;
  const AttentionShape& shape = args.shape;
  const int q_len = static_cast<int>(shape.q_len);
  const int head_dim = static_cast<int>(shape.head_dim), chunks = head_dim / 8;
  const ForwardHead<T> operands = ForwardHead<T>::of(args, b, head);
  const HeadRows<const T> q = operands.q, k = operands.k, v = operands.v;
  const HeadRows<T> out = operands.out;
  float* lse = operands.lse;
  float* accum = o_accum + (static_cast<int64_t>(b) * shape.num_heads + head) * q_len * head_dim;

  const typename L::KVTile sK{smem_address(smem)};
  const typename L::KVTile sV{sK.base + L::KVTile::kBytes};
  const uint32_t q_tiles = sV.base + L::KVTile::kBytes;  // two steps' query rows
  float* partial = reinterpret_cast<float*>(smem + 2 * L::KVTile::kBytes + 2 * L::QTile::kBytes);
  float* step_max = partial + L::kWarps * L::kStepRows * L::kOStride;  // [warp][row]
  float* step_sum = step_max + L::kWarps * L::kStepRows;

  const Scores scores(args, b, head);
  const Band& band = scores.band;
  const int num_steps = (q_len + L::kStepRows - 1) / L::kStepRows;

  // Steps whose rows keep no key are never visited below: out = 0, lse = -inf now.
  for (int i = 0; i < num_steps; ++i) {
    const int r0 = i * L::kStepRows;
    if (band.key_begin(r0) < band.key_end(r0, r0 + L::kStepRows)) continue;
    const int rows = min(L::kStepRows, q_len - r0);
    for (int c = tid; c < L::kStepRows * chunks; c += L::kThreads)
      if (c / chunks < rows)
        *reinterpret_cast<uint4*>(out.row(r0 + c / chunks) + (c % chunks) * 8) = uint4{0, 0, 0, 0};
    if (tid < rows) lse[r0 + tid] = -INFINITY;
  }

  const int num_blocks = (band.kv_len + L::kBlockN - 1) / L::kBlockN;
  for (int j = 0; j < num_blocks; ++j) {
    const int c0 = j * L::kBlockN;
    const int row_begin = band.row_begin(c0), row_end = band.row_end(c0, c0 + L::kBlockN);
    if (row_begin >= row_end) continue;
    const int i_begin = row_begin / L::kStepRows;
    const int i_end = (row_end + L::kStepRows - 1) / L::kStepRows;

    __syncthreads();  // every warp is done with the previous block's tiles
    sK.template load_async<L::kThreads>(k.row(c0), k.stride, band.kv_len - c0, chunks, tid);
    sV.template load_async<L::kThreads>(v.row(c0), v.stride, band.kv_len - c0, chunks, tid);
    const auto load_step = [&](int i) {
      const typename L::QTile sQ{q_tiles + (i % 2) * L::QTile::kBytes};
      const int r0 = i * L::kStepRows;
      sQ.template load_async<L::kThreads>(q.row(r0), q.stride, q_len - r0, chunks, tid);
    };
    load_step(i_begin);
    cp_async_commit();

    for (int i = i_begin; i < i_end; ++i) {
      const int r0 = i * L::kStepRows;
      const typename L::QTile sQ{q_tiles + (i % 2) * L::QTile::kBytes};
      cp_async_wait<0>();
      __syncthreads();  // step i's rows landed; the previous step's shared partials are consumed
      if (i + 1 < i_end) load_step(i + 1);
      cp_async_commit();

      // This warp's quarter of the scores.
      const int wc0 = c0 + warp * L::kWarpKeys;
      float s[1][NT_S][4];
      zero(s);
      warp_gemm<T, 1, NT_S, kHeadDim / 16>(
          s, [&](uint32_t(&a)[1][4], int k0) { load_a(a, sQ, 0, k0, lane); },
          [&](uint32_t(&bf)[4], int k0, int n0) {
            load_b_pair_nmajor(bf, sK, k0, warp * L::kWarpKeys + n0, lane);
          });
      const bool check = !scores.all_kept(r0, r0 + L::kStepRows, wc0, wc0 + L::kWarpKeys);
      const float mul = Scores::general(args)
                            ? scores.apply<true>(s, r0, wc0, check, lane)
                            : scores.apply<false>(s, r0, wc0, check, lane);

      // Row maxima of the whole block, through shared memory.
      float row_max[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float x = -INFINITY;
#pragma unroll
        for (int n = 0; n < NT_S; ++n) x = fmaxf(x, fmaxf(s[0][n][2 * half], s[0][n][2 * half + 1]));
        x = quad_max(x) * mul;
        if (lane % 4 == 0) step_max[warp * L::kStepRows + c_row(0, 2 * half, lane)] = x;
      }
      __syncthreads();
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = c_row(0, 2 * half, lane);
        float x = step_max[r];
#pragma unroll
        for (int w = 1; w < L::kWarps; ++w) x = fmaxf(x, step_max[w * L::kStepRows + r]);
        row_max[half] = x == -INFINITY ? 0.f : x;
      }
      // Probabilities against the block maxima; partial row sums to shared memory.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[0][n][e] = fast_exp2(s[0][n][e] * mul - row_max[half]);
            sum += s[0][n][e];
          }
        sum = quad_sum(sum);
        if (lane % 4 == 0) step_sum[warp * L::kStepRows + c_row(0, 2 * half, lane)] = sum;
      }
      // This warp's partial output: its probabilities times its quarter of V.
      float o[1][NT_O][4];
      zero(o);
#pragma unroll
      for (int kk = 0; kk < L::kWarpKeys / 16; ++kk) {
        uint32_t a[1][4];
        c_to_a<T>(a, s, kk);
        mma_k_step<T>(o, a, [&](uint32_t(&bv)[4], int n0) {
          load_b_pair_kmajor(bv, sV, warp * L::kWarpKeys + 16 * kk, n0, lane);
        });
      }
      float* my_partial = partial + warp * L::kStepRows * L::kOStride;
#pragma unroll
      for (int n = 0; n < NT_O; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          *reinterpret_cast<float2*>(my_partial + c_row(0, 2 * half, lane) * L::kOStride +
                                     c_col(n, 0, lane)) =
              make_float2(o[0][n][2 * half], o[0][n][2 * half + 1]);
      __syncthreads();

      // Merge: thread (row r, lanes of 8) sums the four partials and folds them, normalized,
      // into the running output of the row.
      const int r = tid / 8, t = r0 + r;
      float block_max = -INFINITY, block_sum = 0.f;
#pragma unroll
      for (int w = 0; w < L::kWarps; ++w) {
        block_max = fmaxf(block_max, step_max[w * L::kStepRows + r]);
        block_sum += step_sum[w * L::kStepRows + r];
      }
      const float block_lse =
          block_sum > 0.f ? (block_max + __log2f(block_sum)) * kLn2 : -INFINITY;
      const int step_key_begin = band.key_begin(r0);
      const int step_key_end = band.key_end(r0, r0 + L::kStepRows);
      const bool first = j == step_key_begin / L::kBlockN;
      const bool last = j == (step_key_end - 1) / L::kBlockN;
      const bool row_valid = t < q_len;
      const float old_lse = first || !row_valid ? -INFINITY : lse[t];
      const float new_lse = log_add_exp(old_lse, block_lse);
      const float old_weight = old_lse == -INFINITY ? 0.f : __expf(old_lse - new_lse);
      const float block_weight =
          block_lse == -INFINITY ? 0.f : __expf(block_lse - new_lse) / block_sum;
      if (row_valid) {
#pragma unroll
        for (int u = 0; u < kHeadDim / 32; ++u) {
          const int c = (tid % 8) * 4 + 32 * u;
          if (c >= head_dim) break;
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int w = 0; w < L::kWarps; ++w) {
            const float4 p =
                *reinterpret_cast<const float4*>(partial + (w * L::kStepRows + r) * L::kOStride + c);
            acc.x += p.x, acc.y += p.y, acc.z += p.z, acc.w += p.w;
          }
          float4* running = reinterpret_cast<float4*>(accum + static_cast<int64_t>(t) * head_dim + c);
          const float4 prev = first ? make_float4(0.f, 0.f, 0.f, 0.f) : *running;
          const float4 merged = make_float4(old_weight * prev.x + block_weight * acc.x,
                                            old_weight * prev.y + block_weight * acc.y,
                                            old_weight * prev.z + block_weight * acc.z,
                                            old_weight * prev.w + block_weight * acc.w);
          if (last) {
            uint2 packed{Element<T>::pack(merged.x, merged.y), Element<T>::pack(merged.z, merged.w)};
            *reinterpret_cast<uint2*>(out.row(t) + c) = packed;
          } else {
            *running = merged;
          }
        }
      }
      __syncwarp();  // the row's 8 lanes have read the old lse
      if (row_valid && tid % 8 == 0) lse[t] = new_lse;
    }
  }
}

template <typename T, int kHeadDim>
cudaError_t launch_v1_forward_typed(const ForwardArgs& args, float* o_accum,
                                    cudaStream_t stream) {
  using L = V1Layout<kHeadDim>;
  auto kernel = v1_forward_kernel<T, kHeadDim>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         L::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(args.shape.num_heads, args.shape.batch);
  kernel<<<grid, L::kThreads, L::kSmemBytes, stream>>>(args, o_accum);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_v1_forward(const ForwardArgs& args, float* o_accum, cudaStream_t stream) {
  const AttentionShape& s = args.shape;
  if (s.batch * s.q_len * s.num_heads == 0) return cudaSuccess;
  if (s.q_len >= tile::kUnbounded || s.kv_len >= tile::kUnbounded || s.batch > 65535 ||
      s.num_heads > 65535 || o_accum == nullptr)
    return cudaErrorInvalidValue;
  return tile::dispatch_dtype(args.dtype, [&](auto element) {
    using T = decltype(element);
    return dispatch_head_dim_capacity(s.head_dim, [&](auto cap) {
      return launch_v1_forward_typed<T, decltype(cap)::value>(args, o_accum, stream);
    });
  });
}

}  // namespace jax_flash
