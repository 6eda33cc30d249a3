// Scaled formats (docs/design.md §9): x ≈ s · q with q on an element format E's grid and one scale
// s > 0 per block. Shared by the CPU and CUDA drivers: the scale of a block from its largest finite
// magnitude a, and one element's rounding given its block's scale.
//
// All of it runs in float64: an input (float32, bfloat16, float16 or float64) divided by a scale
// is exact or carries its remainder's sign (see divide_nudged), E's grid (at most 20 significand
// bits, scaled_spec_error) lies far above float64's, and s · q is exact in float64 (s has at most
// 28 significand bits, q at most 20).
#pragma once
#include <cmath>

#include "round.hpp"

namespace lowfp {

// How a block's scale is found from a (finite, > 0) and E's largest value max_E = 2^emax_E · M.
enum class ScaleRule : int32_t {
  // Power-of-two (E8M0) scales 2^k, k clamped to [-127, 127]:
  Floor = 0,  // OCP MX v1.0: k = floor(log2 a) - emax_E (the largest element may exceed max_E
              //   and saturate when M < a / 2^floor(log2 a))
  Ceil = 1,   // k = ceil(log2(a / max_E)): the smallest power of two with a / 2^k <= max_E
  RCeil = 2,  // cuBLAS (cvt.rp.satfinite.ue8m0): d = a / max_E rounded to float32 (nearest),
              //   k = the exponent of d rounded up (d's exponent, plus 1 unless d is a power of two)
  Even = 3,   // torchao's EVEN: a rounded to E's m bits (ties away from zero), then Floor
  // Scales in a lowfp format S (E4M3 for NVFP4) or float32: s = round_S(a / max_E), nearest,
  // saturating at S's largest value and held at its smallest positive one (never 0).
  Format = 4,
};

struct ScaleSpec {
  ScaleRule rule;
  int32_t emax_e;                 // E's largest exponent ...
  double max_e;                   // ... and largest value
  int32_t m_e;                    // E's mantissa bits (Even)
  RoundParams<uint64_t> s;        // Format: nearest, saturating, to S
  double s_smallest;              // Format: S's smallest positive value
  double s_max;                   // Format: S's largest value
};

// floor(log2 a) and 2^k by the bits (both run once per block, so they matter for small blocks).
LOWFP_HD int32_t floor_log2(double a) {  // a > 0 and finite
  const uint64_t b = bit_cast<uint64_t>(a);
  const int32_t field = int32_t(b >> 52);
  return field != 0 ? field - 1023 : int32_t(std::ilogb(a));  // (float64 subnormals: rare)
}
LOWFP_HD double pow2(int32_t k) {  // -1022 <= k <= 1023
  return bit_cast<double>(uint64_t(k + 1023) << 52);
}

// The scale of a block with largest finite magnitude a (a > 0 and finite) under a tensor scale t
// (1 without one: stored block scales are then round_S(a / (max_E · t)) and the block's scale is
// their product with t). saturated: the ideal scale lay outside the scale format's range.
LOWFP_HD double block_scale(const ScaleSpec& sp, double a, double t, bool& saturated) {
  if (sp.rule == ScaleRule::Format) {
    RoundEvents ev;  // (true: carrier subnormals need their true exponent for any S)
    const double want = a / (sp.max_e * t);  // max_E · t is exact: 3 + 24 significand bits
    double s = bit_cast<double>(
        round_bits<RoundKind::Nearest, uint64_t, true>(bit_cast<uint64_t>(want), sp.s, 0u, ev));
    saturated = ev.above_max || s == 0.0;
    s = s == 0.0 ? sp.s_smallest : s;
    return s * t;
  }
  int32_t k;
  if (sp.rule == ScaleRule::RCeil) {
    const float d = float(a / sp.max_e);  // the float32 quotient cuBLAS rounds up
    int e2 = 0;
    const double f = std::frexp(double(d), &e2);  // d = f · 2^e2, f in [0.5, 1)
    k = f == 0.5 ? e2 - 1 : e2;
    if (d == 0.0f) k = -150;                      // below float32's range: clamped below
    if (!(d <= 3.4028234663852886e38f)) k = 128;  // above it (float64 inputs): clamped above
  } else {
    double v = a;
    if (sp.rule == ScaleRule::Even) v = a + std::ldexp(1.0, floor_log2(a) - sp.m_e - 1);
    k = floor_log2(v) - sp.emax_e;
    if (sp.rule == ScaleRule::Ceil && std::ldexp(a, -k) > sp.max_e) k += 1;
  }
  saturated = k > 127 || k < -127;
  k = k > 127 ? 127 : (k < -127 ? -127 : k);
  return pow2(k);
}

// x / s, exact or moved one float64 unit toward the exact quotient's side (r: the remainder
// x - qd · s, exact by the division remainder theorem), so that every rounding of it to a grid
// coarser than float64's sees the exact quotient's neighbours and side. Bit patterns in uint64.
LOWFP_HD uint64_t divide_nudged(double x, double s) {
  const double qd = x / s;
  const double r = std::fma(-qd, s, x);  // NaN for infinite or NaN x: nothing to nudge
  const uint64_t b = bit_cast<uint64_t>(qd);
  // |exact| > |qd| when r has qd's sign; qd is finite and nonzero whenever r is nonzero.
  const bool away = (r > 0.0) == (qd > 0.0);
  const bool nudge = (r != 0.0) & (std::fabs(r) <= 1.7976931348623157e308);  // (no branches:
  return b + select(nudge, select(away, uint64_t(1), ~uint64_t(0)), uint64_t(0));  // vectorises)
}

}  // namespace lowfp
