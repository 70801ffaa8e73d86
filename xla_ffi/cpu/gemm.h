// The one matrix-product shape of the CPU kernel: C (+)= A * B with A read by broadcast and
// B, C read as rows of vectors. Every tile product of the forward and backward passes is
// arranged (by transposing tiles when they are staged) to fit it.
#pragma once

#include <cstdint>

#include "xla_ffi/cpu/simd.h"

namespace jax_flash::cpu {

// Register block of the micro-kernel: kRows rows of C by two vectors of columns. Sized so the
// accumulators plus the two B vectors and one broadcast fit the ISA's vector registers.
template <int W>
struct Block {
  static constexpr int kRows = W == 16 ? 8 : 6;
  static constexpr int kCols = 2 * W;
};

template <int W>
JAX_FLASH_INLINE void MicroKernel(int64_t k, const float* a, int64_t lda, const float* b,
                                  int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  using F = VecF<W>;
  constexpr int R = Block<W>::kRows;
  F acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc[r][0] = accumulate ? Load<W>(c + r * ldc) : F{};
    acc[r][1] = accumulate ? Load<W>(c + r * ldc + W) : F{};
  }
  for (int64_t p = 0; p < k; ++p) {
    const F b0 = Load<W>(b + p * ldb), b1 = Load<W>(b + p * ldb + W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const F ar = Splat<W>(a[r * lda + p]);
      acc[r][0] += ar * b0;
      acc[r][1] += ar * b1;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    Store<W>(c + r * ldc, acc[r][0]);
    Store<W>(c + r * ldc + W, acc[r][1]);
  }
}

// C[m x n] = A[m x k] * B[k x n] (+ C when accumulate), all row-major with the given leading
// dimensions. m must be a multiple of Block<W>::kRows and n of Block<W>::kCols: callers keep
// their tiles padded (with zeros where the padding enters a product).
template <int W>
JAX_FLASH_INLINE void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                           const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < n; j += Block<W>::kCols) {
    for (int64_t i = 0; i < m; i += Block<W>::kRows) {
      MicroKernel<W>(k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    }
  }
}

}  // namespace jax_flash::cpu
