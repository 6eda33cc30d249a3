// log2 and exp2 in double precision from IEEE additions, multiplications and one division only,
// so the CPU and CUDA builds (both without fused multiply-adds) return the same bits, which
// libm and CUDA's math library do not promise. Accurate to a few ulp; branch-free, so the CPU
// loops that call them vectorise.
#pragma once
#include "config.hpp"

namespace lowfp {

constexpr uint64_t kF64SignBit = 0x8000000000000000ull;
constexpr uint64_t kF64ExpMask = 0x7FF0000000000000ull;   // also the bits of +inf
constexpr uint64_t kF64MantMask = 0x000FFFFFFFFFFFFFull;
constexpr uint64_t kF64Sqrt2Mant = 0x6A09E667F3BCDull;     // significand bits of sqrt(2)

// log2 of 2^(b's exponent field - exp_bias) times b's significand, from the bits b of a finite
// positive double; exp_bias is 1023 for a normal double.
LOWFP_HD double log2_det_bits(uint64_t b, int32_t exp_bias) {
  // x = 2^e * f with f in [sqrt(1/2), sqrt(2)): a significand above sqrt(2) is halved.
  const bool upper = (b & kF64MantMask) >= kF64Sqrt2Mant;
  // (int32: AVX2 converts 32-bit integers to double in vectors, 64-bit ones only one by one)
  const int32_t e = int32_t(b >> 52) - exp_bias + int32_t(upper);
  const uint64_t f_exp = select(upper, uint64_t(1022) << 52, uint64_t(1023) << 52);
  const double f = bit_cast<double>((b & kF64MantMask) | f_exp);
  // ln f = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (f-1)/(f+1), |s| <= 0.1716: the terms
  // through s^21 leave a truncation error below 1e-18.
  const double s = (f - 1.0) / (f + 1.0);
  const double z = s * s;
  // The series is 1 + z q, q = 1/3 + z/5 + ... + z^9/21 by Estrin's scheme (pairs, then the
  // powers z^2, z^4, z^8): a chain of 5 multiply-adds instead of Horner's 10, which had bound
  // the loops that call this by latency. The 1 comes last, so q's roundings are scaled by
  // z <= 0.0295 and the result is as accurate as Horner's.
  const double z2 = z * z, z4 = z2 * z2, z8 = z4 * z4;
  const double q0 = (1.0 / 3 + z * (1.0 / 5)) + z2 * (1.0 / 7 + z * (1.0 / 9));
  const double q1 = (1.0 / 11 + z * (1.0 / 13)) + z2 * (1.0 / 15 + z * (1.0 / 17));
  const double q2 = 1.0 / 19 + z * (1.0 / 21);
  const double p = 1.0 + z * ((q0 + z4 * q1) + z8 * q2);
  constexpr double kTwoLog2E = 2.8853900817779268;  // 2 / ln 2
  return double(e) + (s * kTwoLog2E) * p;
}

// log2(x) for finite normal x > 0.
LOWFP_HD double log2_det_normal(double x) { return log2_det_bits(bit_cast<uint64_t>(x), 1023); }

// log2(x) for finite x > 0 (normal or subnormal).
LOWFP_HD double log2_det(double x) {
  // Subnormals are scaled into the normal range first. The product is formed for every x and
  // selected by bits: gcc keeps a conditional floating-point operation as control flow (it may
  // trap), which stops the loop vectorising without AVX-512's masks.
  const uint64_t xb = bit_cast<uint64_t>(x);
  const bool subnormal = xb < (uint64_t(1) << 52);
  return log2_det_bits(select(subnormal, bit_cast<uint64_t>(x * 0x1p64), xb),
                       select(subnormal, 1023 + 64, 1023));
}

// 2^t for finite t (overflow gives +inf, underflow 0 or a correctly scaled subnormal).
LOWFP_HD double exp2_det(double t) {
  // Beyond +-1100 the result is 0 or inf anyway. min_of(max_of(t, -1100), 1100), selected by
  // bits: gcc keeps a conditional on a double followed by arithmetic as control flow, which had
  // stopped every loop calling this from vectorising.
  const uint64_t raised = select(t < -1100.0, bit_cast<uint64_t>(-1100.0), bit_cast<uint64_t>(t));
  t = bit_cast<double>(select(bit_cast<double>(raised) < 1100.0, raised, bit_cast<uint64_t>(1100.0)));
  constexpr double kRound = 0x1.8p52;      // adding it rounds |t| < 2^51 to an integer
  const double k = (t + kRound) - kRound;
  const double r = t - k;                  // exact, |r| <= 1/2
  // e^u, u = r ln 2, |u| <= 0.347: Taylor terms through u^13 leave an error below 1e-17.
  constexpr double kLn2 = 0.69314718055994531;
  const double u = r * kLn2;
  double p = 1.0 / 6227020800;             // 1/13!
  p = p * u + 1.0 / 479001600;
  p = p * u + 1.0 / 39916800;
  p = p * u + 1.0 / 3628800;
  p = p * u + 1.0 / 362880;
  p = p * u + 1.0 / 40320;
  p = p * u + 1.0 / 5040;
  p = p * u + 1.0 / 720;
  p = p * u + 1.0 / 120;
  p = p * u + 1.0 / 24;
  p = p * u + 1.0 / 6;
  p = p * u + 0.5;
  p = p * u + 1.0;
  p = p * u + 1.0;
  // Scale by 2^k in two exact power-of-two factors (each within the normal range), so a
  // subnormal result is rounded once, by the second product.
  const int32_t ki = int32_t(k);  // (int32 for AVX2, as in log2_det)
  const int32_t k1 = ki / 2, k2 = ki - k1;
  const double s1 = bit_cast<double>(uint64_t(k1 + 1023) << 52);
  const double s2 = bit_cast<double>(uint64_t(k2 + 1023) << 52);
  return (p * s1) * s2;
}

}  // namespace lowfp
