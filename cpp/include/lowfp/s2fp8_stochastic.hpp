// The fast form of S2FP8 with stochastic rounding, for float32 and 16-bit x (s2fp8.hpp defines
// the transform; cpp/src/s2fp8_stochastic.cpp builds the per-call constants and proves the bands).
//
// Stochastic rounding of Y to the format's grid (round_bits) steps up with probability
// floor(phi 2^R) / 2^R, phi = Y's fraction of its grid step: up exactly when rr + 1 <= phi 2^R
// (rr the R random bits). With g = |Y| in grid steps of Y's binade, that is
//   rounded |Y| in steps = floor(g + r'),   r' = (2^R - 1 - rr) / 2^R in [0, 1).
// So the result is the floor of a smooth function of |x| plus a random offset. This form computes
// t = log2|Y| and g in float32 (about 2^-20 relative error, against the float64 path's ~2^-50)
// and takes the floor, unless g + r' lies within band_w of an integer: such an element is
// "ambiguous" and the caller runs the float64 path on it. band_w is at least twice the float32
// error (bounded in s2fp8_stochastic.cpp), so every other element's floor is that of the float64
// path's own Y, and x' (a function of the rounded Y) comes from a per-call table: the result is
// the float64 path's bit for bit. (A t within its error of an integer may put g in the wrong
// binade; the grid index does not jump there, s2fp8_stochastic.cpp shows that band_w covers it.)
#pragma once
#include "config.hpp"

namespace lowfp {

// Per-call constants. The grid is indexed from 0 (zero) upward: the binade of 2^E (E >= emin)
// holds indices (E - emin) 2^m + [2^m, 2^(m+1)), one per step 2^(E - m); below 2^emin, index
// N << low_shift is N steps of 2^(emin - m + low_shift) (low_shift = m without subnormals).
struct S2fp8FastStochastic {
  float alpha;          // float(alpha)
  int32_t c_int;        // c = -beta / alpha = c_int + c_frac, so that t = alpha (log2|x| - c)
  float c_frac;         // |c_frac| <= 1/2
  float t_min, t_max;   // t is clamped to these: below t_min x' is certainly 0 (unless r' is
                        // within band_w of 1), above t_max certainly above max
  float t_deep;         // below it Y leaves float64's normal range: ambiguous
  float band_w;
  int32_t emin, m, low_shift;
  // r' is taken to its top min(R, 24) bits, exact in a float32: (~rand >> r_shift) r_scale.
  uint32_t r_shift;     // max(32 - R, 8)
  float r_scale;        // 2^(r_shift - 32)
  uint32_t over;        // index of the first grid value above max; larger indices clamp to it
  uint32_t per_sign;    // table entries per sign: over + 1
  // Where negative x has entries of its own, sign_offset = per_sign (negative x: index +
  // per_sign) and mirror_sign = 0. Mirrored (x' of -x is -(x' of x)): sign_offset = 0 and
  // mirror_sign is the sign bit of x's dtype, set in x' for negative x (s2fp8_fast_signed_value).
  uint32_t sign_offset;
  uint32_t mirror_sign;
  // The common case, for which the CPU compiles its loop without two terms (kPlain below): the
  // format has subnormals (low_shift = 0) and the table is mirrored (sign_offset = 0).
  bool plain;
  // Finite x with magnitude bits below this (at least 1) may reach t_deep; no others. The CPU's
  // plain loop tests for t_deep only in tiles that hold such an x.
  uint32_t deep_abs;
};

// Set in the index of an ambiguous element (whose other bits are still a valid index).
constexpr uint32_t kS2fp8Ambiguous = 0x80000000u;

// The two polynomials are evaluated in Estrin's scheme rather than Horner's: the CPU loop is
// bound by the latency of its dependency chain, not by its instruction count.

// log2 f for f in [sqrt(1/2), sqrt(2)) in float32: 2 atanh(s) / ln 2, s = (f-1)/(f+1), through
// s^7 (the s^9 term is below 2^-24.5). Absolute error below 2^-22.4 over every float32 f, with
// fast_mul_add fused or not (measured); the bound used is 2^-21.
LOWFP_HD float s2fp8_log2_f32(float f) {
  const float s = (f - 1.0f) / (f + 1.0f);
  const float z = s * s, z2 = z * z;
  const float low = fast_mul_add(z, 1.0f / 3, 1.0f);
  const float high = fast_mul_add(z, 1.0f / 7, 1.0f / 5);
  return (s * 2.8853900817779268f) * fast_mul_add(z2, high, low);
}

// 2^r for |r| <= 1/2 in float32: the Taylor series of e^(r ln 2) through r^7, coefficients
// (ln 2)^k / k!. Relative error below 2^-22.4 over every float32 r, with fast_mul_add fused or
// not (measured); the bound used is 2^-21.
LOWFP_HD float s2fp8_exp2_f32(float r) {
  const float r2 = r * r, r4 = r2 * r2;
  const float p01 = fast_mul_add(r, 0.6931471805599453f, 1.0f);
  const float p23 = fast_mul_add(r, 0.055504108664821576f, 0.2402265069591007f);
  const float p45 = fast_mul_add(r, 0.0013333558146428441f, 0.009618129107628477f);
  const float p67 = fast_mul_add(r, 1.5252733804059838e-05f, 0.00015403530393381606f);
  return fast_mul_add(r4, fast_mul_add(r2, p67, p45), fast_mul_add(r2, p23, p01));
}

// The element transform in two steps, so that the CPU runs each as a loop of its own (two
// shorter dependency chains overlap better across elements than one long one).

// t = log2|Y| = alpha (log2|x| - c), at most t_max; x given as its float32 bits (16-bit types
// widened). Meaningful for finite nonzero x only.
LOWFP_HD float s2fp8_fast_log_y(uint32_t xb, const S2fp8FastStochastic& k) {
  // log2|x| = e + log2 f, f in [sqrt(1/2), sqrt(2)); a float32 subnormal is scaled by 2^64.
  const uint32_t a = xb & 0x7FFFFFFFu;
  const bool sub = a < 0x00800000u;
  const uint32_t an = select(sub, bit_cast<uint32_t>(bit_cast<float>(a) * 0x1p64f), a);
  // Less the bits of sqrt(1/2), the exponent field holds e: the unbiased exponent, plus one where
  // the significand is at least sqrt(2) (its low bits borrow otherwise). Taking e from an's
  // exponent leaves f. (Four integer operations; the same e and f as testing the significand,
  // checked over every finite nonzero float32.)
  const int32_t from_half = int32_t(an - 0x3F3504F3u);
  const int32_t e = (from_half >> 23) - select(sub, 64, 0);
  const float f = bit_cast<float>(an - (uint32_t(from_half) & 0xFF800000u));
  const float d = float(e - k.c_int) + (s2fp8_log2_f32(f) - k.c_frac);
  return min_of(k.alpha * d, k.t_max);
}

// The grid index of the rounded |Y| (0 to over), with kS2fp8Ambiguous set when the float64 path
// must decide; t from s2fp8_fast_log_y, rand the element's Philox word. kPlain: k.plain holds,
// and the caller flags the elements below t_deep itself.
template <bool kPlain = false>
LOWFP_HD uint32_t s2fp8_fast_grid_index(float log_y, uint32_t rand, const S2fp8FastStochastic& k) {
  const float t = max_of(log_y, k.t_min);
  // t = n + r with n an integer and |r| <= 1/2; the binade is floor(t).
  constexpr float kRound = 0x1.8p23f;  // adding it rounds |t| < 2^22 to an integer
  const float n = (t + kRound) - kRound;
  const float r = t - n;  // exact
  const int32_t ni = int32_t(n);
  const int32_t binade = ni - int32_t(r < 0.0f);
  const bool below = !kPlain && binade < k.emin;
  const int32_t e_grid = max_of(binade, k.emin);
  // g = |Y| / (the step of Y's binade) = 2^r 2^(n - e_grid + m), or below 2^emin
  // 2^r 2^(n - emin + m - low_shift); t >= t_min keeps the power of two a normal float32.
  const int32_t scale = ni - e_grid + select(below, k.m - k.low_shift, k.m);
  const float g = s2fp8_exp2_f32(r) * bit_cast<float>(uint32_t(scale + 127) << 23);
  // r' = (2^R - 1 - rr) 2^-R, and 2^R - 1 - rr = ~rand >> (32 - R): its top bits, below 2^24,
  // convert as a signed integer (AVX2 converts no unsigned ones); the truncation is in band_w.
  const float w = fast_mul_add(float(int32_t(~rand >> k.r_shift)), k.r_scale, g);
  const int32_t steps = int32_t(w);  // w >= 0: the floor
  const float frac = w - float(steps);
  const bool ambiguous = (frac < k.band_w) | (frac > 1.0f - k.band_w) |
                         (!kPlain && log_y < k.t_deep);
  const uint32_t grid = uint32_t((e_grid - k.emin) << k.m) +
                        (uint32_t(steps) << select(below, uint32_t(k.low_shift), 0u));
  return min_of(grid, k.over) | select(ambiguous, kS2fp8Ambiguous, 0u);
}

// The table's index for a grid index and x (float32 bits xb): plus sign_offset for negative x.
template <bool kPlain = false>
LOWFP_HD uint32_t s2fp8_fast_table_index(uint32_t grid, uint32_t xb, const S2fp8FastStochastic& k) {
  return kPlain ? grid : grid + select(xb >> 31 != 0, k.sign_offset, 0u);
}

// The events of a finite nonzero x from its grid index: Y rounded to 0, or above max (false for
// an ambiguous index, whose events the float64 path reports).
LOWFP_HD bool s2fp8_fast_underflow(uint32_t grid) { return grid == 0; }
LOWFP_HD bool s2fp8_fast_above_max(uint32_t grid, const S2fp8FastStochastic& k) {
  return grid == k.over;
}

// x' from the table's entry for x's index (raw bits of x's dtype); xb: x as float32 bits.
LOWFP_HD uint32_t s2fp8_fast_signed_value(uint32_t value, uint32_t xb,
                                          const S2fp8FastStochastic& k) {
  return value | ((uint32_t(0) - (xb >> 31)) & k.mirror_sign);
}

}  // namespace lowfp
