// Portable SIMD for the CPU kernel: GCC/Clang vector extensions of W floats. The same source is
// compiled inside functions carrying different `target` attributes (attention.cc), so one
// template yields SSE2/NEON (W=4), AVX2+FMA (W=8) and AVX-512 (W=16) code.
// Every helper is always_inline: it must take on the ISA of the function it lands in.
#pragma once

#include <cstdint>
#include <cstring>

#define JAX_FLASH_INLINE inline __attribute__((always_inline))

namespace jax_flash::cpu {

template <int W>
struct VecTypes {
  typedef float F __attribute__((vector_size(4 * W)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
};
template <int W> using VecF = typename VecTypes<W>::F;
template <int W> using VecI = typename VecTypes<W>::I;

template <int W>
JAX_FLASH_INLINE VecF<W> Load(const float* p) {
  VecF<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int W>
JAX_FLASH_INLINE void Store(float* p, VecF<W> v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int W>
JAX_FLASH_INLINE VecF<W> Splat(float x) {
  return VecF<W>{} + x;
}

template <int W>
JAX_FLASH_INLINE VecF<W> Max(VecF<W> a, VecF<W> b) {
  return a > b ? a : b;
}

template <int W>
JAX_FLASH_INLINE float ReduceMax(VecF<W> v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

template <int W>
JAX_FLASH_INLINE float ReduceSum(VecF<W> v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

template <typename To, typename From>
JAX_FLASH_INLINE To BitCast(From x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}

// e^x, max error ~1 ulp on the normal range; exact 0 below ln(FLT_MIN) and for -inf; NaN stays
// NaN. Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 minimax polynomial
// for e^r (the Cephes expf coefficients) and 2^n built in the exponent bits.
template <int W>
JAX_FLASH_INLINE VecF<W> Exp(VecF<W> x) {
  using F = VecF<W>;
  using I = VecI<W>;
  const F lowest = Splat<W>(-87.33654475f);  // ln(FLT_MIN): below, the result is flushed to 0
  const F highest = Splat<W>(88.0f);         // keeps n <= 127; the kernel only needs x <= 0
  const I underflow = x < lowest;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  const float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer in the mantissa
  const F shifted = x * 1.44269504088896341f + kRound;
  const F n = shifted - kRound;
  const I n_int = BitCast<I>(shifted) - BitCast<int32_t>(kRound);
  const F r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  F p = Splat<W>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const F pow2n = BitCast<F>((n_int + 127) << 23);
  const F result = p * pow2n;
  return underflow ? F{} : result;
}

// tanh(x): an odd polynomial below |x| = 0.625 (no cancellation near 0), 1 - 2 / (e^{2|x|} + 1)
// above (Cephes tanhf scheme), sign restored from x.
template <int W>
JAX_FLASH_INLINE VecF<W> Tanh(VecF<W> x) {
  using F = VecF<W>;
  const F ax = x < 0.f ? -x : x;
  const F z = x * x;
  F small = Splat<W>(-5.70498872745e-3f);
  small = small * z + 2.06390887954e-2f;
  small = small * z - 5.37397155531e-2f;
  small = small * z + 1.33314422036e-1f;
  small = small * z - 3.33332819422e-1f;
  small = small * z * x + x;
  const F e = Exp<W>(ax + ax > 80.f ? Splat<W>(80.f) : ax + ax);
  F large = 1.f - 2.f / (e + 1.f);
  large = x < 0.f ? -large : large;
  return ax < 0.625f ? small : large;
}

// ---- scalar conversions of the storage dtypes ------------------------------------------------

struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

JAX_FLASH_INLINE float ToFloat(float x) { return x; }
JAX_FLASH_INLINE float ToFloat(BF16 x) { return BitCast<float>(uint32_t(x.bits) << 16); }

// binary16 -> binary32. Subnormal halves go through an exact integer-to-float product, so the
// result does not depend on the denormals-are-zero mode of the calling thread.
JAX_FLASH_INLINE float ToFloat(F16 x) {
  const uint32_t exponent = (x.bits >> 10) & 0x1fu, mantissa = x.bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = float(mantissa) * 5.9604644775390625e-8f;  // mantissa * 2^-24
  } else if (exponent == 31) {
    magnitude = BitCast<float>(0x7f800000u | (mantissa << 13));
  } else {
    magnitude = BitCast<float>(((exponent + 112u) << 23) | (mantissa << 13));
  }
  return (x.bits & 0x8000u) ? -magnitude : magnitude;
}

template <typename T> JAX_FLASH_INLINE T FromFloat(float x);

template <> JAX_FLASH_INLINE float FromFloat<float>(float x) { return x; }

// Round to nearest even; NaN stays a (quiet) NaN.
template <> JAX_FLASH_INLINE BF16 FromFloat<BF16>(float x) {
  const uint32_t bits = BitCast<uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BF16{uint16_t((bits >> 16) | 0x40u)};
  return BF16{uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
}

// Round to nearest even, with overflow to inf, subnormals, and NaN kept.
template <> JAX_FLASH_INLINE F16 FromFloat<F16>(float x) {
  const uint32_t bits = BitCast<uint32_t>(x);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return F16{uint16_t(sign | 0x7e00u)};
  if (abs_bits >= 0x477ff000u) return F16{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520
  if (abs_bits < 0x38800000u) {  // below 2^-14: subnormal half, rounded by float addition
    const float magic = BitCast<float>(0x3f000000u);  // 0.5: its ulp is the half subnormal step
    const float shifted = BitCast<float>(abs_bits) + magic;
    return F16{uint16_t(sign | (BitCast<uint32_t>(shifted) - 0x3f000000u))};
  }
  const uint32_t rebias = abs_bits - 0x38000000u;  // exponent 127 -> 15
  const uint32_t rounded = rebias + 0xfffu + ((rebias >> 13) & 1u);
  return F16{uint16_t(sign | (rounded >> 13))};
}

}  // namespace jax_flash::cpu
