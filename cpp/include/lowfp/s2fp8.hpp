// S2FP8 (DESIGN §4): over a tensor's finite nonzero elements, mu = mean log2|x|, m = max log2|x|,
// alpha = log_max / (m - mu), beta = -alpha mu; each element becomes
//   Y = sign(x) 2^(alpha log2|x| + beta),   x' = sign(x) 2^((log2|round(Y)| - beta) / alpha).
//
// The reduction is order-independent, so any split over threads or GPU blocks gives the same
// statistics: log2|x| is converted to a fixed-point integer (2^-48 steps) and summed as two int64
// halves, and max |x| is a max of bit patterns. All of it is in double precision.
#pragma once
#include <type_traits>

#include "exp_log.hpp"
#include "round.hpp"
#include "storage.hpp"

namespace lowfp {

// The reduction's accumulators, one int64 each (a device buffer on the GPU).
enum S2fp8Sum : int {
  kSumLogHigh = 0,   // sum of (fixed log2|x|) >> 32
  kSumLogLow = 1,    // sum of (fixed log2|x|) & 0xffffffff (an unsigned sum)
  kSumCount = 2,     // finite nonzero elements
  kSumMaxAbs = 3,    // bits of max |x| as a double (0 when there is none)
  kSumSize = 4
};

constexpr double kS2fp8LogScale = 0x1p48;  // fixed-point steps per unit of log2

// Statistics as stored in the params buffer (doubles).
enum S2fp8Param : int { kAlpha = 0, kBeta = 1, kMu = 2, kMax = 3, kParamSize = 4 };

struct S2fp8Stats {
  double alpha, beta, mu, m;
};

constexpr uint64_t kOneBits = 0x3FF0000000000000ull;  // 1.0: a harmless stand-in operand

LOWFP_HD bool finite_nonzero_abs(uint64_t abs_bits) { return (abs_bits - 1) < (kF64ExpMask - 1); }

// log2|x| in fixed point, rounded to the nearest step, ties away from zero (|log2 x| < 1075, so
// it fits 59 bits).
LOWFP_HD int64_t s2fp8_fixed_log(double abs_x) {
  const double v = log2_det(abs_x) * kS2fp8LogScale;
  return int64_t(v + (v < 0 ? -0.5 : 0.5));
}

// One element's contribution to the reduction; low must be summed without overflow by the
// caller, e.g. by carrying (low >> 32) into high before it nears 2^63.
struct S2fp8Partial {
  int64_t high = 0;
  uint64_t low = 0;
  int64_t count = 0;
  uint64_t max_abs = 0;
  LOWFP_HD void add(uint64_t abs_bits) {  // branch-free: the CPU loop over it vectorises
    const bool use = finite_nonzero_abs(abs_bits);
    const uint64_t mask = uint64_t(0) - uint64_t(use);
    const int64_t q = s2fp8_fixed_log(bit_cast<double>(select(use, abs_bits, kOneBits)));
    high += int64_t(uint64_t(q >> 32) & mask);
    low += uint64_t(q) & 0xFFFFFFFFull & mask;
    count += int64_t(use);
    max_abs = max_of(max_abs, abs_bits & mask);
  }
  LOWFP_HD void carry() {  // keeps low below 2^32 without changing high * 2^32 + low
    high += int64_t(low >> 32);
    low &= 0xFFFFFFFFull;
  }
};

// alpha, beta, mu, m from the accumulated sums. No finite nonzero element: alpha = 1, beta = 0.
// One magnitude (m - mu within 2^-32 of a binade, the fixed-point sum's reach): alpha = 1,
// beta = -mu.
LOWFP_HD S2fp8Stats s2fp8_stats(const int64_t* sums, double log_max) {
  const int64_t count = sums[kSumCount];
  if (count == 0) return {1.0, 0.0, 0.0, 0.0};
  const double total = double(sums[kSumLogHigh]) * 0x1p32 + double(uint64_t(sums[kSumLogLow]));
  const double mu = total / double(count) / kS2fp8LogScale;
  const double m = log2_det(bit_cast<double>(uint64_t(sums[kSumMaxAbs])));
  if (!(m - mu > 0x1p-32)) return {1.0, -mu, mu, m};
  const double alpha = log_max / (m - mu);
  return {alpha, -alpha * mu, mu, m};
}

// The element transform in three steps, so a CPU loop can run the two transcendental steps
// vectorised and the rounding (whose 64-bit per-lane shifts gcc does not vectorise) on its own.
// Zeros, infinities and NaN pass through: s2fp8_squeeze gives them to the rounding unchanged
// (so an infinite or NaN x reports its events as quantize would) and s2fp8_unsqueeze returns x.

// Y = sign(x) 2^(alpha log2|x| + beta) as float64 bits.
LOWFP_HD uint64_t s2fp8_squeeze(uint64_t x, const S2fp8Stats& s) {
  const uint64_t abs_x = x & ~kF64SignBit;
  const bool use = finite_nonzero_abs(abs_x);
  const double log_x = log2_det(bit_cast<double>(select(use, abs_x, kOneBits)));
  const double y = exp2_det(s.alpha * log_x + s.beta);
  return select(use, bit_cast<uint64_t>(y) | (x & kF64SignBit), x);
}

// x' = sign(Y_r) 2^((log2|Y_r| - beta) / alpha), Y_r the rounded Y; a Y_r of +-0 (underflow),
// +-inf or NaN is kept.
LOWFP_HD uint64_t s2fp8_unsqueeze(uint64_t x, uint64_t y_rounded, const S2fp8Stats& s,
                                  double inv_alpha) {
  const uint64_t abs_r = y_rounded & ~kF64SignBit;
  const bool back = finite_nonzero_abs(abs_r);
  const double log_r = log2_det(bit_cast<double>(select(back, abs_r, kOneBits)));
  const double x_new = exp2_det((log_r - s.beta) * inv_alpha);
  const uint64_t out = select(back, bit_cast<uint64_t>(x_new) | (y_rounded & kF64SignBit), y_rounded);
  return select(finite_nonzero_abs(x & ~kF64SignBit), out, x);
}

// Y (float64 bits) rounded to odd into float32 bits: truncated, with the last bit set when bits
// were lost. Rounding that to a format of m <= 21 bits in the float32 carrier, in any mode but
// stochastic, gives exactly the rounding of Y itself (rounding to odd with two or more spare bits
// never crosses or lands on a value, midpoint or boundary of the coarser grid), with the same
// events, provided the format's smallest positive value is at least 2^-124: a nonzero |Y| below
// float32's normal range becomes 2^-126, below half that value, and one above float32's range
// becomes its largest finite value, above the format's overflow threshold. CPU drivers use it
// because float32 lanes vectorise where float64 rounding does not.
LOWFP_HD uint32_t s2fp8_to_odd_f32(uint64_t y) {
  const uint64_t a = y & ~kF64SignBit;
  const uint32_t sign = uint32_t(y >> 32) & 0x80000000u;
  const uint64_t mant = a & kF64MantMask;
  const uint32_t normal = uint32_t((((a >> 52) - (1023 - 127)) << 23) | (mant >> 29)) |
                          uint32_t((mant & 0x1FFFFFFFull) != 0);
  constexpr uint64_t kF32MinNormal = 0x3810000000000000ull;  // 2^-126 as a double
  constexpr uint64_t kF32Max = 0x47EFFFFFE0000000ull;        // float32's largest finite value
  uint32_t r = select(a >= kF32Max, 0x7F7FFFFFu, normal);
  r = select(a < kF32MinNormal, select(a != 0, 0x00800000u, 0u), r);
  r = select(a >= kF64ExpMask, select(a == kF64ExpMask, 0x7F800000u, 0x7FC00000u), r);
  return sign | r;
}

// All three steps for one element (x as float64 bits); the rounding reports its events.
template <RoundKind Kind, bool kSubExp>
LOWFP_HD uint64_t s2fp8_element(uint64_t x, const S2fp8Stats& s, double inv_alpha,
                                const RoundParams<uint64_t>& p, uint32_t rand, RoundEvents& ev) {
  const uint64_t y = round_bits<Kind, uint64_t, kSubExp>(s2fp8_squeeze(x, s), p, rand, ev);
  return s2fp8_unsqueeze(x, y, s, inv_alpha);
}

// x' in the storage type: float16/bfloat16 take one rounding to nearest from float64 (p_store),
// not two through float32; float32 takes the conversion's own rounding to nearest.
template <class Out>
LOWFP_HD Out s2fp8_store(uint64_t x, const RoundParams<uint64_t>& p_store) {
  if constexpr (std::is_same_v<Out, Half> || std::is_same_v<Out, BFloat>) {
    RoundEvents ignored;
    x = round_bits<RoundKind::Nearest, uint64_t, true>(x, p_store, 0u, ignored);
  }
  return Store<Out>::from(x);
}

}  // namespace lowfp
