// S2FP8 (docs/design.md §4): over a tensor's finite nonzero elements, mu = mean log2|x|, m = max log2|x|,
// alpha = log_max / (m - mu), beta = -alpha mu; each element becomes
//   Y = sign(x) 2^(alpha log2|x| + beta),   x' = sign(x) 2^((log2|round(Y)| - beta) / alpha).
//
// The reduction is order-independent, so any split over threads or GPU blocks gives the same
// statistics. log2|x| = e + log2 f (x = 2^e f, f in [1, 2)): the exponents are summed as
// integers, and the significands are multiplied in groups before one log2 per product, so most
// elements cost a multiply rather than a logarithm. A group is kS2fp8Group consecutive elements
// (from index 0 of the tensor); element i of a group is factor i / kS2fp8Lanes of lane
// i % kS2fp8Lanes, and each lane's kS2fp8Factors factors are multiplied as a balanced binary tree
// (level by level, neighbours 2s and 2s+1), which a CPU vector loop and a GPU warp both follow
// bit for bit. Elements that are not finite nonzero, and the padding of a last group, are the
// factor 1. A product of 16 factors below 2 is below 2^16; its log2 is turned into a fixed-point
// integer (2^-48 steps) and summed as two int64 halves. max |x| is a max of bit patterns. All of
// it is in double precision: each product rounds 15 times, an error below 2^-48 in its log2.
#pragma once
#include <type_traits>

#include "exp_log.hpp"
#include "round.hpp"
#include "storage.hpp"

namespace lowfp {

constexpr int kS2fp8Lanes = 8;
constexpr int kS2fp8Factors = 16;
constexpr int kS2fp8Group = kS2fp8Lanes * kS2fp8Factors;

// The reduction's accumulators, one int64 each (a device buffer on the GPU).
enum S2fp8Sum : int {
  kSumLogHigh = 0,   // sum of (fixed log2 of a lane product) >> 32
  kSumLogLow = 1,    // sum of (fixed log2 of a lane product) & 0xffffffff (an unsigned sum)
  kSumCount = 2,     // finite nonzero elements
  kSumMaxAbs = 3,    // bits of max |x| as a double (0 when there is none)
  kSumExp = 4,       // sum of the binary exponents e of the finite nonzero elements
  kSumSize = 5
};

constexpr double kS2fp8LogScale = 0x1p48;  // fixed-point steps per unit of log2

// Statistics as stored in the params buffer (doubles).
enum S2fp8Param : int { kAlpha = 0, kBeta = 1, kMu = 2, kMax = 3, kParamSize = 4 };

struct S2fp8Stats {
  double alpha, beta, mu, m;
};

constexpr uint64_t kOneBits = 0x3FF0000000000000ull;  // 1.0: a harmless stand-in operand

LOWFP_HD bool finite_nonzero_abs(uint64_t abs_bits) { return (abs_bits - 1) < (kF64ExpMask - 1); }

// One element's part of the reduction, from |x| as float64 bits: its exponent e (0 when it does
// not count) and its significand f in [1, 2) (1 when it does not count). kSubnormal: the input
// type has float64 subnormals (only float64 itself), which are scaled into the normal range.
struct S2fp8Factor {
  int64_t e;
  double f;
};

template <bool kSubnormal>
LOWFP_HD S2fp8Factor s2fp8_factor(uint64_t abs_bits) {
  const bool use = finite_nonzero_abs(abs_bits);
  uint64_t a = abs_bits;
  int64_t e_adjust = 1023;
  if constexpr (kSubnormal) {
    const bool sub = abs_bits < (uint64_t(1) << 52);
    a = select(sub, bit_cast<uint64_t>(bit_cast<double>(abs_bits) * 0x1p64), abs_bits);
    e_adjust = select(sub, int64_t(1023 + 64), int64_t(1023));
  }
  const int64_t e = int64_t(a >> 52) - e_adjust;
  const uint64_t f = (a & kF64MantMask) | kOneBits;
  return {select(use, e, int64_t(0)), bit_cast<double>(select(use, f, kOneBits))};
}

// s2fp8_factor from the float32 bits of x (float32 or a widened 16-bit type), in 32-bit lanes:
// a float32 subnormal is scaled by 2^64 into the normal range, as its float64 value is normal.
struct S2fp8Factor32 {
  int32_t e;
  float f;
};

LOWFP_HD S2fp8Factor32 s2fp8_factor_f32(uint32_t abs_bits) {
  const bool use = abs_bits - 1 < 0x7F7FFFFFu;  // finite nonzero
  const bool sub = abs_bits < 0x00800000u;
  const uint32_t a = select(sub, bit_cast<uint32_t>(bit_cast<float>(abs_bits) * 0x1p64f), abs_bits);
  const int32_t e = int32_t(a >> 23) - select(sub, 127 + 64, 127);
  const uint32_t f = select(use, (a & 0x007FFFFFu) | 0x3F800000u, 0x3F800000u);
  return {select(use, e, 0), bit_cast<float>(f)};
}

// s2fp8_factor_f32 for a zero or a float32 normal, with the exponent still biased: (a >> 23,
// 0 for a zero; the caller subtracts 127 per finite nonzero element) and f (1 for a zero).
LOWFP_HD S2fp8Factor32 s2fp8_factor_f32_plain(uint32_t abs_bits) {
  return {int32_t(abs_bits >> 23), bit_cast<float>((abs_bits & 0x007FFFFFu) | 0x3F800000u)};
}

// A lane product (in [1, 2^16)) as a fixed-point log2, rounded to the nearest step (ties up):
// the floor of v = log2 * 2^48 + 0.5 (exact, v < 2^52). Written with additions rather than a
// conversion to an integer, which AVX2 lacks for 64-bit lanes (the loop went scalar): adding
// 2^52 rounds v to the nearest integer in the low significand bits, one less where that
// rounded up.
LOWFP_HD uint64_t s2fp8_fixed_log(double product) {
  constexpr double kShift = 0x1p52;
  const double v = log2_det_normal(product) * kS2fp8LogScale + 0.5;  // product >= 1
  const double shifted = v + kShift;
  const uint64_t nearest = bit_cast<uint64_t>(shifted) - bit_cast<uint64_t>(kShift);
  return nearest - uint64_t((shifted - kShift) > v);
}

// A thread's share of the reduction; low must be summed without overflow by the caller, e.g. by
// carrying (low >> 32) into high before it nears 2^64.
struct S2fp8Partial {
  int64_t high = 0;
  uint64_t low = 0;
  int64_t count = 0;
  uint64_t max_abs = 0;
  int64_t exp_sum = 0;
  LOWFP_HD void carry() {  // keeps low below 2^32 without changing high * 2^32 + low
    high += int64_t(low >> 32);
    low &= 0xFFFFFFFFull;
  }
  LOWFP_HD void add(const S2fp8Partial& o) {  // o carried
    high += o.high;
    low += o.low;
    carry();
    count += o.count;
    max_abs = max_of(max_abs, o.max_abs);
    exp_sum += o.exp_sum;
  }
};

// alpha, beta, mu, m from the accumulated sums. No finite nonzero element: alpha = 1, beta = 0.
// One magnitude (m - mu within 2^-32 of a binade, well above the sums' rounding): alpha = 1,
// beta = -mu.
LOWFP_HD S2fp8Stats s2fp8_stats(const int64_t* sums, double log_max) {
  const int64_t count = sums[kSumCount];
  if (count == 0) return {1.0, 0.0, 0.0, 0.0};
  const double fixed = double(sums[kSumLogHigh]) * 0x1p32 + double(uint64_t(sums[kSumLogLow]));
  const double mu = (double(sums[kSumExp]) + fixed / kS2fp8LogScale) / double(count);
  const double m = log2_det(bit_cast<double>(uint64_t(sums[kSumMaxAbs])));
  if (!(m - mu > 0x1p-32)) return {1.0, -mu, mu, m};
  const double alpha = log_max / (m - mu);
  return {alpha, -alpha * mu, mu, m};
}

// The element transform in three steps, so a CPU loop can run the two transcendental steps
// vectorised and the rounding (whose 64-bit per-lane shifts gcc does not vectorise) on its own,
// and the CPU's threshold form (cpp/src/s2fp8_thresholds.cpp) can call each step alone. Zeros, infinities and NaN pass through: s2fp8_squeeze gives them to the rounding unchanged
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

// What the float64 path makes of an x (raw bits of T) that is zero, infinite or NaN, for the fast
// forms to store: zeros and infinities come back unchanged; a NaN comes back quiet, float32 and
// bfloat16 keeping its sign and payload (the float <-> double conversions set the quiet bit),
// float16 as the canonical NaN with x's sign (float_bits_to_half).
template <class T>
LOWFP_HD RawOf<T> s2fp8_pass_through(RawOf<T> xb) {
  static_assert(!std::is_same_v<T, double>, "float64 x takes the float64 path");
  using Raw = RawOf<T>;
  constexpr Raw kSign = Raw(Raw(1) << (8 * sizeof(Raw) - 1));
  constexpr Raw kInf = std::is_same_v<T, float> ? Raw(0x7F800000u) : Raw(std::is_same_v<T, Half> ? 0x7C00 : 0x7F80);
  constexpr Raw kQuiet = Raw((kInf & (0u - kInf)) >> 1);  // the significand's top bit
  const Raw nan_out = std::is_same_v<T, Half> ? Raw((xb & kSign) | kInf | kQuiet) : Raw(xb | kQuiet);
  return select(Raw(xb & ~kSign) > kInf, nan_out, xb);
}

}  // namespace lowfp
