// Scaled formats (docs/design.md §9): x ≈ s · q with q on an element format E's grid and one scale
// s > 0 per block. Shared by the CPU and CUDA drivers: the scale of a block from its largest finite
// magnitude a, and one element's rounding given its block's scale.
//
// All of it runs in float64: an input (float32, bfloat16, float16 or float64) divided by a scale
// is rounded to odd (divide_nudged), which E's rounding cannot tell from the exact quotient (E has
// at most 20 significand bits: kScaledMaxElementMantissa), or, for nearest rounding where that
// provably decides alike, to nearest (nearest_divides_once); s · q is exact in float64 (s has at
// most 28 significand bits, q at most 20).
#pragma once
#include <cmath>

#include "round.hpp"
#include "storage.hpp"


namespace lowfp {

// Element formats of at most this many mantissa bits: with 32 random bits their stochastic
// rounding of a float64 quotient is exact (docs/design.md §9).
constexpr int32_t kScaledMaxElementMantissa = 19;

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

// Which of a block's candidate scales it keeps (scales in a format with a tensor scale).
enum class BlockChoice : int32_t {
  Fixed = 0,  // the one scale of the rule
  // 4over6 (NVFP4, FP4 E2M1 elements and E4M3 scales): the scale that maps the block's largest
  // magnitude to 6 (the rule's) or the one that maps it to 4, whichever leaves the smaller error
  // over the block's finite elements, a tie keeping 6's. The tensor scale divides by 256 in
  // place of max_S = 448, so that 4's scale (up to 1.5 · 256) stays within E4M3's range.
  FourOverSixMAE = 1,  // the error: the sum of |x - s·q|
  FourOverSixMSE = 2,  // the error: the sum of (x - s·q)^2
};

struct ScaleSpec {
  ScaleRule rule;
  int32_t emax_e;                 // E's largest exponent ...
  double max_e;                   // ... and largest value
  int32_t m_e;                    // E's mantissa bits (Even)
  RoundParams<uint64_t> s;        // Format: nearest, saturating, to S
  double s_smallest;              // Format: S's smallest positive value
  double s_max;                   // Format: S's largest value
  double t_s_max;                 // Format: max_S as the tensor scale divides by it (4over6: 256)
  BlockChoice choice;
  // Format, the CPU's faster forms where they give the same scales: a / (max_E · t) rounded
  // once (nearest_divides_once), S's rounding by addition (nearest_by_addition(s, s_cap))
  bool divide_once, by_addition;
  int32_t s_cap;                  // S's largest exponent + 1
};

// floor(log2 a) and 2^k by the bits (no math library: the same on host and device, and cheap,
// as they run once per block; branch-free, so that a loop over blocks vectorises).
LOWFP_HD int32_t floor_log2(double a) {  // a > 0 and finite
  const bool sub = a < 0x1p-1022;  // a float64 subnormal: 2^52 a is normal (and exact)
  const uint64_t b = bit_cast<uint64_t>(sub ? a * 0x1p52 : a);
  return int32_t(b >> 52) - 1023 - (sub ? 52 : 0);
}
LOWFP_HD double pow2(int32_t k) {  // k clamped to [-1022, 1023]
  k = k < -1022 ? -1022 : (k > 1023 ? 1023 : k);
  return bit_cast<double>(uint64_t(k + 1023) << 52);
}
LOWFP_HD bool is_pow2(double a) {  // a > 0, normal
  return (bit_cast<uint64_t>(a) & 0x000fffffffffffffull) == 0;
}
// 1 / s, exactly, for s = 2^k with |k| <= 1022 (every power-of-two block scale, and the empty
// scale 2^-127): 2^-k, the exponent field reflected about the bias, where 1 / s is a division.
LOWFP_HD double pow2_inverse(double s) {
  return bit_cast<double>((uint64_t(2046) << 52) - bit_cast<uint64_t>(s));
}
LOWFP_HD double fma_rn(double a, double b, double c) {
#ifdef __CUDA_ARCH__
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// x / s rounded to odd: exact, or else whichever of the two float64 values around the exact
// quotient has an odd last bit. Every point where a rounding of it to E (at most 20 significand
// bits, and 32 random bits for stochastic rounding: at most 52 in all) decides differently is a
// float64 with an even last bit, so the odd neighbour lies on the exact quotient's side of each
// (the classic cure for double rounding). r = x - qd · s is exact (the division remainder
// theorem) and says which side of qd = RN(x / s) the quotient lies on: the exact quotient is
// farther from zero than qd when r has qd's sign (qd keeps x's sign when it underflows to 0).
// Integer masks only: a bool mixing float and integer compares stops GCC vectorising the loop.
LOWFP_HD uint64_t divide_nudged(double x, double s) {
  const double qd = x / s;
  const uint64_t b = bit_cast<uint64_t>(qd);
  const uint64_t r = bit_cast<uint64_t>(fma_rn(-qd, s, x));  // NaN for infinite or NaN x
  using C = CarrierTraits<uint64_t>;
  const uint64_t r_magnitude = r & ~C::kSign;
  const uint64_t inexact =  // 0 < |r| < inf
      r_magnitude - 1u < C::kInf - 1u ? ~uint64_t(0) : uint64_t(0);
  const uint64_t even = (b & 1u) - 1u;                        // all ones when b's last bit is 0
  const uint64_t step = uint64_t(1) - (((r ^ b) >> 63) << 1);  // +1 away from zero, else -1
  return b + (step & inexact & even);
}

// A quotient q = x · (1 / s) (s a power of two) as E's rounding needs it: the product is exact
// unless it falls below the carrier's normal range, where it may round, even to 0 (a tiny element
// in a block of large ones; for float64 inputs, below 2^-1022). Every point where E's rounding
// decides lies above that range (E's smallest step is at least 2^-149, times 2^-32 for stochastic
// rounding, and the float32 carrier is only taken for steps of at least 2^-22), so there only q's
// sign and its being nonzero matter: a product that lost a nonzero x keeps x's sign and the
// smallest magnitude.
template <class Bits>
LOWFP_HD Bits nonzero_quotient(Bits q, Bits x) {
  using C = CarrierTraits<Bits>;
  const bool lost = ((q & ~C::kSign) == 0) & ((x & ~C::kSign) != 0);
  return select(lost, (x & C::kSign) | Bits(1), q);
}

// Whether RN(x / s), the float64 quotient rounded once, decides E's nearest rounding as the exact
// quotient does, so that nearest rounding can skip divide_nudged: x of at most 24 significand
// bits (float32 and narrower), s of at most scale_bits, E of m mantissa bits. Each point where
// that rounding decides (a midpoint of E's grid, or its overflow threshold) is mu = M · 2^c with
// M below 2^(m + 2), and x = X · 2^a, s = S · 2^b. If x / s != mu, x - s · mu is a nonzero multiple
// of 2^a or of 2^(b + c), so |x / s - mu| exceeds mu · 2^-max(25, scale_bits + m + 2) (beyond
// mu / 2 when |x| < s · mu / 2). RN moves the quotient by at most 2^-53 of it and is monotone,
// and mu is a float64, so RN(x / s) lies strictly on the exact quotient's side of mu while
// scale_bits + m + 2 <= 51 (NVFP4: 28 + 3). (The float64 quotient of such operands is normal.)
inline bool nearest_divides_once(int32_t m, int32_t scale_bits, DType input) {
  return input != DType::Float64 && scale_bits + m + 2 <= 51;
}

// ScaleRule::Format: the stored scale S = round_S(a / (max_E · t)) (nearest, saturating; the
// quotient rounded to odd first, so rounding it to S is rounding the exact quotient), held at S's
// smallest value; the block's scale is S · t (format_block_scale). kOnce, kAdd: sp.divide_once
// and sp.by_addition, which must hold.
template <bool kOnce = false, bool kAdd = false>
LOWFP_HD double format_stored_scale(const ScaleSpec& sp, double a, double t, bool& saturated) {
  RoundEvents ev;  // (true: carrier subnormals need their true exponent for any S)
  const double d = sp.max_e * t;  // exact: 3 + 24 bits
  const uint64_t want = kOnce ? bit_cast<uint64_t>(a / d) : divide_nudged(a, d);
  const double s = bit_cast<double>(
      kAdd ? round_nearest_by_addition(want, sp.s, sp.s_cap, ev)
           : round_bits<RoundKind::Nearest, uint64_t, true>(want, sp.s, 0u, ev));
  saturated = ev.above_max | (s == 0.0);
  return s == 0.0 ? sp.s_smallest : s;
}
template <bool kOnce = false, bool kAdd = false>
LOWFP_HD double format_block_scale(const ScaleSpec& sp, double a, double t, bool& saturated) {
  return format_stored_scale<kOnce, kAdd>(sp, a, t, saturated) * t;
}

// format_stored_scale in the faster forms sp allows (sp.divide_once, sp.by_addition): one call's
// choice, the same for all its blocks.
LOWFP_HD double stored_scale(const ScaleSpec& sp, double a, double t, bool& saturated) {
  if (sp.divide_once)
    return sp.by_addition ? format_stored_scale<true, true>(sp, a, t, saturated)
                          : format_stored_scale<true, false>(sp, a, t, saturated);
  return sp.by_addition ? format_stored_scale<false, true>(sp, a, t, saturated)
                        : format_stored_scale<false, false>(sp, a, t, saturated);
}

// The tensor scale of a tensor whose largest finite magnitude is a: t = a / (max_S · max_E)
// (max_S: t_s_max)
// rounded to float32 (the float64 quotient rounds to the same float32 as the exact one), held
// within float32's positive range [2^-149, max] so that s · t and x / (s · t) stay finite (a
// block whose scale then lies outside S's range saturates, and is counted); 1 for a tensor
// without a finite nonzero value.
LOWFP_HD double tensor_scale(const ScaleSpec& sp, double a) {
  constexpr double kFloat32Max = 3.4028234663852886e38;
  if (!(a > 0.0)) return 1.0;
  const double d = a / (sp.t_s_max * sp.max_e);
  return d >= kFloat32Max ? kFloat32Max : max_of(double(float(d)), 0x1p-149);
}

// The scale of a block without a finite nonzero element: the smallest scale (S's smallest
// positive value times t; 2^-127 for E8M0). Its elements are zeros, infinities and NaNs, which
// any scale leaves as they are.
LOWFP_HD double empty_block_scale(const ScaleSpec& sp, double t) {
  return sp.rule == ScaleRule::Format ? sp.s_smallest * t : 0x1p-127;
}

// A power-of-two (E8M0) block scale by rule R (not Format), for a block with largest finite
// magnitude a > 0; saturated: k lay outside [-127, 127]. Branch-free for a loop over blocks.
template <ScaleRule R>
LOWFP_HD double pow2_block_scale(const ScaleSpec& sp, double a, bool& saturated) {
  static_assert(R != ScaleRule::Format, "scales in a format: format_block_scale");
  int32_t k;
  if constexpr (R == ScaleRule::RCeil) {
    const double d = double(float(a / sp.max_e));  // the float32 quotient cuBLAS rounds up
    const double dn = d == 0.0 || !(d <= 3.4028234663852886e38) ? 1.0 : d;  // (a valid operand)
    k = d == 0.0 ? -150                                   // below float32's range: clamped below
        : !(d <= 3.4028234663852886e38) ? 128             // above it (float64 inputs): clamped above
        : floor_log2(dn) + (is_pow2(dn) ? 0 : 1);
  } else {
    double v = a;
    if constexpr (R == ScaleRule::Even) v = a + pow2(floor_log2(a) - sp.m_e - 1);
    k = floor_log2(v) - sp.emax_e;
    if constexpr (R == ScaleRule::Ceil) k += int32_t(k > -1000 && a > sp.max_e * pow2(k));
  }
  saturated = k > 127 || k < -127;
  k = k > 127 ? 127 : (k < -127 ? -127 : k);
  return pow2(k);
}

// The scale of a block with largest finite magnitude a (a > 0 and finite) under a tensor scale t
// (1 without one: stored block scales are then round_S(a / (max_E · t)) and the block's scale is
// their product with t). saturated: the ideal scale lay outside the scale format's range.
LOWFP_HD double block_scale(const ScaleSpec& sp, double a, double t, bool& saturated) {
  switch (sp.rule) {
    case ScaleRule::Format: return stored_scale(sp, a, t, saturated) * t;
    case ScaleRule::Floor: return pow2_block_scale<ScaleRule::Floor>(sp, a, saturated);
    case ScaleRule::Ceil: return pow2_block_scale<ScaleRule::Ceil>(sp, a, saturated);
    case ScaleRule::RCeil: return pow2_block_scale<ScaleRule::RCeil>(sp, a, saturated);
    default: return pow2_block_scale<ScaleRule::Even>(sp, a, saturated);
  }
}

// One element in the float64 carrier: q = round_E(x / s) (kPow2: s is a power of two, whose
// inverse multiplies exactly), its events in ev. kFaster: E's faster form of the rounding, the
// same results: nearest by addition (round_nearest_by_addition, where nearest_by_addition(p,
// e_cap) holds), stochastic by steps (round_stochastic_by_steps, where stochastic_by_steps(p)
// holds). kOnce: x / s rounded to nearest, not to odd (where nearest_divides_once holds).
template <RoundKind Kind, bool kPow2, bool kSubExp, bool kFaster = false, bool kOnce = false>
LOWFP_HD double scaled_element(double x, double s, double inv, const RoundParams<uint64_t>& p,
                               uint32_t rand, RoundEvents& ev, int32_t e_cap = 0) {
  static_assert(!kOnce || Kind == RoundKind::Nearest, "only nearest rounding divides once");
  static_assert(!kFaster || Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic, "no faster form");
  const uint64_t quotient = kPow2    ? nonzero_quotient(bit_cast<uint64_t>(x * inv), bit_cast<uint64_t>(x))
                            : kOnce ? bit_cast<uint64_t>(x / s)
                                    : divide_nudged(x, s);
  if constexpr (kFaster && Kind == RoundKind::Nearest)
    return bit_cast<double>(round_nearest_by_addition(quotient, p, e_cap, ev));
  else if constexpr (kFaster)
    return bit_cast<double>(round_stochastic_by_steps<false>(quotient, p, rand, ev));
  else return bit_cast<double>(round_bits<Kind, uint64_t, kSubExp>(quotient, p, rand, ev));
}

// One element in the float32 carrier, where a call allows it (ScaledCall::narrow: power-of-two
// scales s = 2^k, inputs of at most 32 bits, E's finest step at least 2^-22): q = round_E(x · inv)
// for inv = 2^-k as a float32 (x · inv exact, or below float32's normal range, where only its sign
// and being nonzero decide), its events in ev. kKeep: a quotient that underflowed to 0 stays
// nonzero (nonzero_quotient), which only nearest rounding that does not count may skip. kFaster:
// E's faster form of the rounding, as scaled_element's (nearest by addition where
// nearest_by_addition(p32, e_cap) holds, stochastic by steps where stochastic_by_steps(p32) does).
template <RoundKind Kind, bool kKeep, bool kFaster = false>
LOWFP_HD float narrow_element(uint32_t x, float inv, const RoundParams<uint32_t>& p32, uint32_t rand,
                              RoundEvents& ev, int32_t e_cap = 0) {
  static_assert(!kFaster || Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic, "no faster form");
  const uint32_t qb = bit_cast<uint32_t>(bit_cast<float>(x) * inv);
  const uint32_t quotient = kKeep ? nonzero_quotient(qb, x) : qb;
  if constexpr (kFaster && Kind == RoundKind::Nearest)
    return bit_cast<float>(round_nearest_by_addition(quotient, p32, e_cap, ev));
  else if constexpr (kFaster)
    return bit_cast<float>(round_stochastic_by_steps<false>(quotient, p32, rand, ev));
  else return bit_cast<float>(round_bits<Kind, uint32_t, false>(quotient, p32, rand, ev));
}

LOWFP_HD float abs32(float v) {
#ifdef __CUDA_ARCH__
  return fabsf(v);
#else
  return std::fabs(v);
#endif
}

// One float32 element x of the checked carrier (scales s = S · t in a format, ScaledCall::checked):
// the quotient approximated as a = x · inv, inv = fl(1 / s) a normal float32 (two roundings:
// within 2^-22.9 of x / s), rounded to E in its faster form, q returned and its events in ev.
// near: a may lie on the other side than the exact quotient of a point where the rounding
// decides, and the element must be rounded again exactly (scaled_element); else q and ev are the
// exact quotient's. Such elements are rare on real data.
// - Nearest (by addition, ScaledCall::add32): a within 2^-21 of one of E's decision points (a
//   midpoint of its grid; past E's range, of the grid continued, which may flag overflowing
//   elements needlessly).
// - Stochastic (by steps, stochastic_by_steps(p32)): the decision for word r' (its low sr_shift
//   bits set) changes where a's steps_position X passes r' + 1, and at a grid point, where X wraps
//   from 2^32 to 0. a lies below 2^(m + 1) of its steps (one step: E's smallest below 2^emin), so
//   the exact quotient's position differs from a's by less than 2^(m + 10.1) of the 2^32, and by
//   less than three times that measured circularly across a grid point into a binade of half or
//   twice the step: an element is rounded again where X - (r' + 1), circularly, lies within
//   `margin` (ScaledCall::checked_margin, 2^(m + 13)).
// kKeep: as narrow_element's.
template <RoundKind Kind, bool kKeep>
LOWFP_HD float checked_element(uint32_t x, float inv, const RoundParams<uint32_t>& p, int32_t e_cap, uint32_t rand,
                               uint32_t margin, RoundEvents& ev, uint32_t& near) {
  static_assert(Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic, "no checked form");
  const uint32_t qb = bit_cast<uint32_t>(bit_cast<float>(x) * inv);
  const uint32_t quotient = kKeep ? nonzero_quotient(qb, x) : qb;
  const uint32_t ab = quotient & 0x7fffffffu;
  if constexpr (Kind == RoundKind::Nearest) {
    const float a = bit_cast<float>(ab);
    float step_c;  // 2^23 times E's step at a
    const float mag = magnitude_by_addition(ab, p, e_cap, step_c);
    // distance to the nearer decision point: |a - mag| is exact and at most half a step
    const float off = abs32(abs32(a - mag) - step_c * 0x1p-24f);
    near = uint32_t(off <= a * 0x1p-21f);
    return bit_cast<float>(rounded_result(quotient, bit_cast<uint32_t>(mag), p, ev));
  } else {
    const uint32_t low_bits = (1u << p.sr_shift) - 1u;
    const uint32_t from_change = steps_position(ab, p) - ((rand | low_bits) + 1u);  // (mod 2^32)
    near = uint32_t(from_change + margin <= 2u * margin) & uint32_t(ab < 0x7f800000u);
    return bit_cast<float>(round_stochastic_by_steps<false>(quotient, p, rand, ev));
  }
}

// A float32 value on a 16-bit storage type's grid: lowfp's nearest rounding to it (out32).
LOWFP_HD float onto_storage_grid(float v, const RoundParams<uint32_t>& out32) {
  RoundEvents ev;
  return bit_cast<float>(round_bits<RoundKind::Nearest, uint32_t, false>(bit_cast<uint32_t>(v), out32, 0u, ev));
}

// s · q of the float32 carrier (exact there) in the storage type: float32 as it is, 16-bit types
// rounded to their grid (onto_storage_grid) and converted.
template <class Out>
LOWFP_HD Out store_narrow(float v, const RoundParams<uint32_t>& out32) {
  if constexpr (std::is_same_v<Out, float>) return v;
  else return Store<Out>::from(bit_cast<uint32_t>(onto_storage_grid(v, out32)));
}

// Element formats with few magnitudes (FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6): nearest rounding of
// x / s, saturating, is a step function of |x| with a step at mu · s for each decision point mu
// (a midpoint of E's grid; past max_E, where overflow begins). Where every mu · s is exact in
// float64, a float32 |x| compared with strict_threshold(mu · s, up) gives E's rounding of the exact
// quotient with no division, and s · g (g a magnitude, rounded once to float32) its result.
constexpr int32_t kFewMagnitudes = 8;
struct FewMagnitudes {
  int32_t n;                       // E's magnitudes g[0] = 0 < ... < g[n - 1] = max_E (0: too many)
  double g[kFewMagnitudes];
  double mu[kFewMagnitudes - 1];   // between g[k] and g[k + 1]; past n - 2, +inf (never passed)
  bool up[kFewMagnitudes - 1];     // a tie at mu[k] rounds to g[k + 1]
  double mu_over;                  // between max_E and the next value of E's grid continued ...
  bool up_over;                    // ... and whether a tie there overflows
};

// The float32 c with a > c exactly when a > T (up: a >= T), for every float32 a >= 0 and an exact
// T > 0: T itself when it is a float32 and a tie stays below, else the float32 just below T (with
// no float32 strictly between c and T, a > c is a >= T). Branch-free, so that loops vectorise.
LOWFP_HD float strict_threshold(double T, bool up) {
  const float f = float(T);  // nearest; inf above float32's range
  const double back = double(f);
  // (As a select: GCC 12 at -O3 for AVX-512, vectorising few_thresholds, dropped the first
  // term of the equivalent (back > T) | ((back == T) & up).)
  const uint32_t lower = up ? uint32_t(back >= T) : uint32_t(back > T);
  return bit_cast<float>(bit_cast<uint32_t>(f) - lower);  // (f > 0 whenever lower is 1)
}

// Where E's nearest rounding of x / s leaves zero (mu_zero: between 0 and E's smallest positive
// value) and where it overflows (mu_over: past max_E), each with whether a tie there goes up.
// The rounding events of nearest rounding are then comparisons of |x| with mu · s: overflow past
// mu_over · s (infinite x too), underflow a nonzero x not past mu_zero · s, NaN.
struct EventPoints {
  double mu_zero, mu_over;
  bool up_zero, up_over;
};

// One block scale's comparisons for a float32 |x| (FewMagnitudes, scale s, every mu · s exact):
// |x| > above[k] passes E's decision point k (k < n - 1; past those, +inf), above[kFewMagnitudes
// - 1] the overflow point, and value[k] = float(s · g[k + 1]), the float64 path's result float(q · s)
// for q = g[k + 1] (value[kFewMagnitudes - 1] unused).
struct alignas(64) FewThresholds {
  float above[kFewMagnitudes];
  float value[kFewMagnitudes];
};
inline FewThresholds few_thresholds(const FewMagnitudes& f, double s) {
  FewThresholds t{};
  for (int32_t k = 0; k + 1 < kFewMagnitudes; ++k) {
    t.above[k] = strict_threshold(f.mu[k] * s, f.up[k]);
    t.value[k] = float(f.g[k + 1] * s);
  }
  t.above[kFewMagnitudes - 1] = strict_threshold(f.mu_over * s, f.up_over);
  return t;
}

// 4over6's second candidate: the block scale that maps a to 4 (E2M1's largest value 6 times 2/3),
// round_S(a / (4 · t)) as format_block_scale rounds a / (max_E · t).
constexpr double kFourOverSixTarget = 4.0;
constexpr double kFourOverSixTensorMax = 256.0;  // the tensor scale's max_S under 4over6
LOWFP_HD double map_to_four_scale(const ScaleSpec& sp, double a, double t, bool& saturated) {
  ScaleSpec four = sp;
  four.max_e = kFourOverSixTarget;
  return format_block_scale(four, a, t, saturated);
}

// One finite element's share of a 4over6 candidate's error: x - v rounded to float64 (v = s · q,
// exact), its magnitude (MAE) or its square rounded to float64 (MSE). A block's error is the sum
// of its elements' shares, rounded to float64 in row-major order.
LOWFP_HD double choice_error(BlockChoice choice, double x, double v) {
  const double d = x - v;
  return choice == BlockChoice::FourOverSixMSE ? d * d : (d < 0.0 ? -d : d);
}

// s · q (exact in float64) in the storage type: float32 and float64 by conversion (nearest
// even), 16-bit types rounded to their grid by lowfp's nearest rounding (`out`) first.
template <class Out>
LOWFP_HD Out store_scaled(double v, const RoundParams<uint64_t>& out) {
  if constexpr (std::is_same_v<Out, double>) {
    return v;
  } else if constexpr (std::is_same_v<Out, float>) {
    return float(v);
  } else {
    RoundEvents ev;
    return Store<Out>::from(
        round_bits<RoundKind::Nearest, uint64_t, true>(bit_cast<uint64_t>(v), out, 0u, ev));
  }
}

}  // namespace lowfp
