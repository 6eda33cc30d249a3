// Rounding one carrier value to fp(e, m, b) (DESIGN §3), branch-free on the carrier's integer
// representation so that CPU compilers vectorise it and GPU threads do not diverge.
//
// For |x| with carrier significand sig (implicit bit made explicit) and effective exponent E, the
// target's grid step at x is 2^(E - MB + d): d carrier bits are dropped, d = MB - m at or above
// 2^emin, more below. The kept part is trunc = sig >> d, the dropped part rem = sig mod 2^d, and each
// mode only decides whether to step the magnitude up by one grid step. While d <= MB the step is
// an integer add on the carrier bits (a carry into the exponent field is the next binade); for
// d > MB, |x| is below one grid step and the result is 0 or that step.
#pragma once
#include <type_traits>

#include "format.hpp"

namespace lowfp {

enum class RoundKind { Nearest, Directed, Stochastic };

LOWFP_HD RoundKind round_kind(Rounding mode) {
  return mode == Rounding::Stochastic ? RoundKind::Stochastic
         : (mode == Rounding::Nearest || mode == Rounding::NearestAway) ? RoundKind::Nearest
                                                                         : RoundKind::Directed;
}

struct RoundEvents {
  bool overflow, underflow, nan;
};

// rand: one 32-bit Philox word (ignored unless Kind is Stochastic).
template <RoundKind Kind, class Bits>
LOWFP_HD Bits round_bits(Bits x, const RoundParams<Bits>& p, uint32_t rand, RoundEvents& ev) {
  using C = CarrierTraits<Bits>;
  const Bits sign = x & C::kSign;
  const Bits a = x & ~C::kSign;
  const int32_t ex = int32_t(a >> C::kMantBits);
  const int32_t e_eff = max_of(ex, int32_t(1)) - C::kExpBias;  // carrier subnormals share 2^(1-bias)
  const Bits sig = (a & C::kMantMask) | (ex != 0 ? C::kImplicit : Bits(0));
  // True exponent: for carrier subnormals, that of sig's leading bit (read off the exact
  // integer-to-float conversion, which vectorises); it matters when the target's normal range
  // reaches below the carrier's (e.g. fp(8,m,1) in float32).
  using F = typename C::Float;
  using SInt = std::conditional_t<sizeof(Bits) == 4, int32_t, int64_t>;
  const int32_t lead = int32_t(bit_cast<Bits>(F(SInt(sig))) >> C::kMantBits) - C::kExpBias;
  const int32_t e_true = ex != 0 ? e_eff : e_eff - C::kMantBits + lead;
  const int32_t d = e_true < p.emin ? p.below_drop + (p.emin - e_eff)
                                    : p.normal_drop + (e_true - e_eff);
  const int32_t dm = min_of(d, C::kMaxShift);  // shifts past the significand all behave alike
  const Bits unit = Bits(1) << dm;
  const Bits rem = sig & (unit - 1);
  const Bits trunc = sig >> dm;

  bool up;
  if constexpr (Kind == RoundKind::Nearest) {
    const Bits twice_rem = rem << 1;  // sig < 2^(MB+1): no overflow
    up = twice_rem > unit || (twice_rem == unit && ((trunc & 1) != 0 || p.ties_away));
  } else if constexpr (Kind == RoundKind::Directed) {
    up = rem != 0 && (sign != 0 ? p.away_neg : p.away_pos);
  } else {
    // Up with probability floor(f * 2^R) / 2^R, f = rem / 2^d: compare R random bits with the top
    // R bits of the dropped fraction.
    const int32_t r_bits = 32 - int32_t(p.sr_shift);
    const Bits threshold = d <= r_bits ? rem << min_of(r_bits - d, C::kMaxShift)
                                       : rem >> min_of(d - r_bits, C::kMaxShift);
    up = Bits(rand >> p.sr_shift) < threshold;
  }

  const Bits stepped = (a & ~(unit - 1)) + (Bits(up) << dm);
  const Bits mag = d <= C::kMantBits ? stepped : (up ? p.below_step : Bits(0));

  ev.nan = a > C::kInf;
  ev.overflow = !ev.nan && mag > p.max_bits;  // includes infinite inputs
  ev.underflow = !ev.nan && a != 0 && mag == 0;

  const Bits zero_sign = p.no_negative_zero && mag == 0 ? Bits(0) : sign;
  const Bits rounded = zero_sign | mag;
  const Bits overflowed = (a == C::kInf && p.inf_stays_inf) ? x
                          : sign != 0                      ? p.overflow_neg
                                                           : p.overflow_pos;
  return ev.nan ? x : (ev.overflow ? overflowed : rounded);
}

}  // namespace lowfp
