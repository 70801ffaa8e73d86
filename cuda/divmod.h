// Division by a divisor that is fixed for a whole launch, as a multiply-high and a shift with
// a multiplier prepared on the host. The GPU has no integer divide: for a runtime divisor the
// compiler emits a float reciprocal (I2F.RP, MUFU.RCP, F2I) and a correction, about twenty
// instructions with a MUFU round trip. The v3 forward decodes every tile of its persistent loop
// with such divisions (cuda/v3_fwd_sm90.cu, decode_tile). Host and device code, so that a plain
// host program can check it (tests/gpu/divmod_check.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash {

// n / d for 0 <= n < 2^31 and a divisor 1 <= d < 2^31.
//
// Why it is exact: let l = ceil(log2 d), p = 31 + l and m = ceil(2^p / d), so m d = 2^p + e
// with 0 <= e < d <= 2^l. Write n = q d + r, 0 <= r < d. Then
//   n m / 2^p = q + (r + n e / 2^p) / d,
// and n e < 2^31 2^l = 2^p, so r + n e / 2^p < r + 1 <= d: floor(n m / 2^p) = q.
// m fits in 32 bits: d = 1 gives 2^31; for l >= 1, d >= 2^(l-1) + 1 gives
// 2^p / d <= 2^32 / (1 + 2^(1-l)) <= 2^32 - 2 (l <= 31), so m <= 2^32 - 1.
// floor(n m / 2^p) is umulhi(2n, m) >> l: 2n < 2^32 fits in 32 bits, and the high word of
// 2n m is floor(n m / 2^31). Doubling n instead of shifting by l - 1 keeps d = 1 (l = 0) exact
// on the same path, without a branch.
struct DivMod {
  uint32_t divisor, multiplier, shift;

  DivMod() = default;
  __host__ __device__ explicit DivMod(int d) : divisor(uint32_t(d)), shift(0) {
    while ((uint64_t(1) << shift) < divisor) ++shift;
    const uint64_t scale = uint64_t(1) << (31 + shift);
    multiplier = uint32_t((scale + divisor - 1) / divisor);
  }

  __host__ __device__ int divide(int n) const {
    return int(mul_high(2 * uint32_t(n), multiplier) >> shift);
  }
  // Returns n / divisor and stores n % divisor in remainder.
  __host__ __device__ int divmod(int n, int& remainder) const {
    const int quotient = divide(n);
    remainder = n - quotient * int(divisor);
    return quotient;
  }

 private:
  __host__ __device__ static uint32_t mul_high(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return uint32_t((uint64_t(a) * b) >> 32);
#endif
  }
};

}  // namespace jax_flash
