// Rounding one carrier value to fp(e, m, b) (docs/design.md §3), branch-free on the carrier's integer
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

// TowardZero is Directed known at compile time to round toward zero (never up): drivers that
// only offer toward_zero among the directed modes (the extra-bits split) use it, and round_kind
// never returns it.
enum class RoundKind { Nearest, Directed, Stochastic, TowardZero };

LOWFP_HD RoundKind round_kind(Rounding mode) {
  return mode == Rounding::Stochastic ? RoundKind::Stochastic
         : (mode == Rounding::Nearest || mode == Rounding::NearestAway) ? RoundKind::Nearest
                                                                         : RoundKind::Directed;
}

// What happened to one element. above_max also holds for NaN inputs (their magnitude bits exceed
// max's), so the overflow count is count(above_max) - count(nan): one mask operation less per
// element than testing overflow directly, which the counting loops feel.
struct RoundEvents {
  bool above_max, underflow, nan;
  LOWFP_HD bool overflow() const { return above_max & !nan; }
};

// x's result given the rounded magnitude mag of its finite magnitude: the events, the sign a
// zero keeps, overflow by the policy, NaN as it came.
template <class Bits>
LOWFP_HD Bits rounded_result(Bits x, Bits mag, const RoundParams<Bits>& p, RoundEvents& ev) {
  using C = CarrierTraits<Bits>;
  const Bits sign = x & C::kSign;
  const Bits a = x & ~C::kSign;
  ev.nan = a > C::kInf;
  ev.above_max = mag > p.max_bits;  // overflow (infinite inputs included), or NaN
  // (a NaN never gets mag == 0: its exponent field keeps the stepped value above inf's bits)
  ev.underflow = (a != 0) & (mag == 0);

  // The sign a zero result keeps: none in fnuz formats. (A loop-invariant mask: combining the
  // bool with the per-lane test would cost mask-register moves every vector.)
  const Bits zero_keeps = p.no_negative_zero ? Bits(0) : C::kSign;
  const Bits zero_sign = sign & select(mag == 0, zero_keeps, C::kSign);
  const Bits rounded = zero_sign | mag;
  const Bits overflowed = select((a == C::kInf) & p.inf_stays_inf, x,
                                 select(sign != 0, p.overflow_neg, p.overflow_pos));
  return select(ev.nan, x, select(ev.above_max, overflowed, rounded));
}

// Whether rounded_result_symmetric gives rounded_result's results under p: a zero keeps its sign
// (not fnuz), an overflow of either sign is that sign with overflow_pos's bits, and infinite
// inputs saturate with finite ones or overflow_pos is the infinity they stay (policies saturate
// and, in the nearest modes, inf).
template <class Bits>
LOWFP_HD bool symmetric_overflow(const RoundParams<Bits>& p) {
  using C = CarrierTraits<Bits>;
  return !p.no_negative_zero && p.overflow_neg == (C::kSign | p.overflow_pos) &&
         (p.overflow_pos & C::kSign) == 0 && (!p.inf_stays_inf || p.overflow_pos == C::kInf);
}

// rounded_result where symmetric_overflow(p) holds: the sign of x on the magnitude mag, on
// overflow_pos above max (infinite inputs included), on |x| for NaN. The same events; about half
// the vector operations.
template <class Bits>
LOWFP_HD Bits rounded_result_symmetric(Bits x, Bits mag, const RoundParams<Bits>& p, RoundEvents& ev) {
  using C = CarrierTraits<Bits>;
  const Bits a = x & ~C::kSign;
  ev.nan = a > C::kInf;
  ev.above_max = mag > p.max_bits;
  ev.underflow = (a != 0) & (mag == 0);
  return (x & C::kSign) | select(ev.nan, a, select(ev.above_max, p.overflow_pos, mag));
}

// rand: one 32-bit Philox word (ignored unless Kind is Stochastic).
// kSubnormalExponent must equal p.subnormal_exponent (a template parameter so that the common
// formats skip the work; drivers dispatch on it). kFixedDrop may be set when p.fixed_drop holds:
// every input then drops the same normal_drop bits (bfloat16 in float32), a shift by one count.
template <RoundKind Kind, class Bits, bool kSubnormalExponent, bool kFixedDrop = false>
LOWFP_HD Bits round_bits(Bits x, const RoundParams<Bits>& p, uint32_t rand, RoundEvents& ev) {
  static_assert(!(kFixedDrop && kSubnormalExponent), "a fixed drop needs no true exponent");
  using C = CarrierTraits<Bits>;
  const Bits sign = x & C::kSign;
  const Bits a = x & ~C::kSign;
  // Exponent arithmetic in the carrier's own width: mixing 32- and 64-bit lanes defeats gcc's
  // vectoriser for the float64 carrier.
  using SInt = std::make_signed_t<Bits>;
  using F = typename C::Float;
  const SInt ex = SInt(a >> C::kMantBits);
  const SInt e_eff = max_of(ex, SInt(1)) - C::kExpBias;  // carrier subnormals share 2^(1-bias)
  const Bits sig = (a & C::kMantMask) | select(ex != 0, C::kImplicit, Bits(0));
  // True exponent: for carrier subnormals, that of sig's leading bit (read off the exact
  // integer-to-float conversion, which vectorises). Only formats whose grid below the carrier's
  // emin differs from the carrier's subnormal grid need it (RoundParams::subnormal_exponent).
  SInt e_true = e_eff;
  if constexpr (kSubnormalExponent) {
    const SInt lead = SInt(bit_cast<Bits>(F(SInt(sig))) >> C::kMantBits) - C::kExpBias;
    e_true = select(ex != 0, e_eff, e_eff - C::kMantBits + lead);
  }
  const SInt emin = p.emin;
  const SInt max_shift = C::kMaxShift;
  SInt d, dm;
  if constexpr (kFixedDrop) {
    d = dm = SInt(p.normal_drop);  // <= MB: never past the significand
  } else {
    d = select(e_true < emin, SInt(p.below_drop) + (emin - e_eff),
               SInt(p.normal_drop) + (e_true - e_eff));
    dm = min_of(d, max_shift);  // shifts past the significand all behave alike
  }
  const Bits trunc = sig >> Bits(dm);
  // unit = 2^dm. For 64-bit lanes not written 1 << dm: gcc narrows a shift count to 32 bits and
  // then cannot vectorise a shift of a constant (it can when the shifted value is a variable),
  // and the float64 carrier's loops ran scalar. For 32-bit lanes the plain shift is faster.
  const Bits unit = sizeof(Bits) == 8 ? ((trunc + 1) << Bits(dm)) - (trunc << Bits(dm))
                                      : Bits(1) << Bits(dm);
  const Bits rem = sig & (unit - 1);

  // up is 0 or 1 in the carrier's integer width (bools in the data flow defeat gcc's vectoriser).
  Bits up;
  if constexpr (Kind == RoundKind::Nearest) {
    // 2 rem > unit, or a tie whose lower neighbour's encoding is odd (or ties away). 2 rem is
    // even and unit a power of two, so adding the 0/1 tie flag can only turn an exact tie into
    // "greater". With m = 0 the lower neighbour is 0 (trunc = 0, even) or 2^e_true, whose
    // exponent code is e_true + B; e_true is that neighbour's exponent whenever trunc != 0.
    const Bits twice_rem = rem << 1;  // sig < 2^(MB+1): no overflow
    const Bits odd = trunc & (Bits(e_true + SInt(p.parity_bias)) | p.parity_mask);
    const Bits tie_up = (odd | Bits(p.ties_away)) & 1;
    up = Bits(twice_rem + tie_up > unit);
  } else if constexpr (Kind == RoundKind::Directed) {
    up = Bits(rem != 0) & select(sign != 0, Bits(p.away_neg), Bits(p.away_pos));
  } else if constexpr (Kind == RoundKind::TowardZero) {
    up = 0;
  } else {
    // Up with probability floor(f * 2^R) / 2^R, f = rem / 2^d: compare R random bits with the top
    // R bits of the dropped fraction.
    const SInt r_bits = 32 - SInt(p.sr_shift);
    // (shift counts clamped to [0, kMaxShift]: the lane not selected must not shift out of range)
    const Bits widened = rem << Bits(min_of(max_of(r_bits - d, SInt(0)), max_shift));
    const Bits narrowed = rem >> Bits(min_of(max_of(d - r_bits, SInt(0)), max_shift));
    const Bits threshold = select(d <= r_bits, widened, narrowed);
    up = Bits(Bits(rand >> p.sr_shift) < threshold);
  }

  const Bits stepped = (a & ~(unit - 1)) + (up << Bits(dm));
  Bits mag = stepped;
  if constexpr (!kFixedDrop)  // (a select, not below_step * up: vector multiplies are slow)
    mag = select(d <= SInt(C::kMantBits), stepped, select(up != 0, p.below_step, Bits(0)));
  return rounded_result(x, mag, p, ev);
}

// round_bits for nearest, ties to even, by the classic addition (|x| + c) - c with
// c = 2^(e + MB - m), e being |x|'s exponent held in [emin, e_cap] (MB: the carrier's mantissa
// bits): the carrier's own rounding of the sum drops exactly the bits below the format's step
// there (the sum stays in c's binade when at least one bit is dropped). It gives round_bits'
// results and events when nearest_by_addition(p, e_cap) holds: 0 < m < MB with subnormals (the
// step below 2^emin is the step at it) and c a normal carrier value for every such e, e_cap at
// least emax + 1 (a larger exponent's sum still lands above max_bits). About half the vector
// operations. magnitude_by_addition: the rounded magnitude of a = |x| as a carrier value, and c
// (2^MB times the format's step at a).
// The bits of c = 2^(e + MB - m) for the magnitude a (e held in [emin, e_cap]): its ulp is the
// format's step at a (the rounding by addition's constant).
template <class Bits>
LOWFP_HD Bits addition_constant_bits(Bits a, const RoundParams<Bits>& p, int32_t e_cap) {
  using C = CarrierTraits<Bits>;
  using SInt = std::make_signed_t<Bits>;  // exponent arithmetic in the carrier's lane width
  // (e + bias, clamped as the exponent field: one add fewer each way than clamping e itself)
  const SInt field = min_of(max_of(SInt(a >> C::kMantBits), SInt(p.emin + C::kExpBias)), SInt(e_cap + C::kExpBias));
  return Bits(field + p.normal_drop) << C::kMantBits;
}

template <class Bits, class F = typename CarrierTraits<Bits>::Float>
LOWFP_HD F magnitude_by_addition(Bits a, const RoundParams<Bits>& p, int32_t e_cap, F& c) {
  c = bit_cast<F>(addition_constant_bits(a, p, e_cap));
  return (bit_cast<F>(a) + c) - c;  // inf, NaN stay
}

// kSymmetric: symmetric_overflow(p) holds (rounded_result_symmetric).
template <class Bits, bool kSymmetric = false>
LOWFP_HD Bits round_nearest_by_addition(Bits x, const RoundParams<Bits>& p, int32_t e_cap,
                                        RoundEvents& ev) {
  typename CarrierTraits<Bits>::Float c;
  const Bits mag = bit_cast<Bits>(magnitude_by_addition(x & ~CarrierTraits<Bits>::kSign, p, e_cap, c));
  if constexpr (kSymmetric) return rounded_result_symmetric(x, mag, p, ev);
  else return rounded_result(x, mag, p, ev);
}

// Whether the carrier's rounding of |x| + c, c = 2^(e + MB - m) from addition_constant_bits, lands
// on the format's grid at every x: 0 < m < MB with subnormals (the step below 2^emin is the step
// at it), and c a normal carrier value for every e in [emin, e_cap].
template <class Bits>
inline bool steps_by_addition(const RoundParams<Bits>& p, int32_t e_cap) {
  using C = CarrierTraits<Bits>;
  auto normal = [&](int32_t e) {
    const int32_t field = e + p.normal_drop + C::kExpBias;
    return field >= 1 && field <= 2 * C::kExpBias;
  };
  return p.normal_drop >= 1 && p.below_drop == p.normal_drop && !p.subnormal_exponent && !p.fixed_drop &&
         p.emin <= e_cap && normal(p.emin) && normal(e_cap);
}

template <class Bits>
inline bool nearest_by_addition(const RoundParams<Bits>& p, int32_t e_cap) {
  return !p.ties_away && p.parity_mask != 0 && steps_by_addition(p, e_cap);
}

// Stochastic rounding as a sum: round_bits' results and events, about half its vector
// operations, where stochastic_by_steps(p) holds (subnormals on, m < MB, and 32 + m - emin at
// most the carrier's bias - 1). With d the bits dropped at |x| (normal_drop, plus one per binade
// below 2^emin), rem the dropped part and r the random word with its low sr_shift bits set,
// round_bits steps up exactly when r < floor(rem 2^32 / 2^d), that is when rem + noise carries
// into bit d, noise = (~r >> (32 - d)) for d <= 32 and (~r << (d - 32)) above (~r: its 32 bits,
// less than 2^d either way). So for d <= MB the magnitude is |x| + noise with its low d bits
// cleared (a carry steps into the next binade). Below the smallest step u = 2^(emin - m) (d > MB)
// the result is u or 0, up when r is below floor(|x| 2^32 / u): |x| times that power of two,
// exact, converted by truncation (|x| clamped below u first, so every lane converts a value below
// 2^32). The bound on m - emin keeps the power finite and every carrier subnormal below u 2^-32
// (floor 0, so the result holds whether or not the FPU flushes subnormal inputs to zero).
template <class Bits>
LOWFP_HD bool stochastic_by_steps(const RoundParams<Bits>& p) {
  using C = CarrierTraits<Bits>;
  const int32_t m = C::kMantBits - p.normal_drop;
  return p.normal_drop >= 1 && p.below_drop == p.normal_drop && !p.subnormal_exponent && !p.fixed_drop &&
         32 + m - p.emin <= C::kExpBias - 1;
}

// The bits the steps form drops at magnitude a (stochastic_by_steps): normal_drop, plus one per
// binade below 2^emin; above the carrier's mantissa bits, a lies below E's smallest step.
template <class Bits>
LOWFP_HD std::make_signed_t<Bits> steps_drop(Bits a, const RoundParams<Bits>& p) {
  using C = CarrierTraits<Bits>;
  using SInt = std::make_signed_t<Bits>;  // (exponent arithmetic in the carrier's lane width)
  const SInt normal_drop = SInt(p.normal_drop);
  const SInt drop_at_zero = normal_drop + SInt(p.emin) + C::kExpBias;  // d for exponent field 0
  return max_of(drop_at_zero - SInt(a >> C::kMantBits), normal_drop);
}

// The bound below E's smallest step u: floor(min(a, u-) 2^32 / u), |x| times a power of two,
// exact, converted by truncation (a clamped below u first, so every lane converts a value below
// 2^32).
template <class Bits>
LOWFP_HD Bits steps_below_bound(Bits a, const RoundParams<Bits>& p) {
  using C = CarrierTraits<Bits>;
  using F = typename C::Float;
  const int32_t m = C::kMantBits - p.normal_drop;
  const F to_fraction = bit_cast<F>(Bits(C::kExpBias + 32 + m - p.emin) << C::kMantBits);
  return Bits(uint32_t(bit_cast<F>(min_of(a, p.below_step - 1u)) * to_fraction));
}

// kSymmetric: symmetric_overflow(p) holds (rounded_result_symmetric).
template <bool kSymmetric, class Bits>
LOWFP_HD Bits round_stochastic_by_steps(Bits x, const RoundParams<Bits>& p, uint32_t rand, RoundEvents& ev) {
  using C = CarrierTraits<Bits>;
  using SInt = std::make_signed_t<Bits>;
  const Bits low_bits = Bits((1u << p.sr_shift) - 1u);  // (loop-invariant: once per call)
  const Bits a = x & ~C::kSign;
  const SInt d = steps_drop(a, p);
  const Bits r = Bits(rand) | low_bits;
  const Bits not_r = r ^ Bits(0xffffffffu);
  // (shift counts kept in range for the lanes whose result a select drops)
  Bits noise = not_r >> Bits(max_of(SInt(32) - d, SInt(0)));
  if constexpr (sizeof(Bits) == 8)
    noise = select(d <= 32, noise, not_r << Bits(min_of(max_of(d - SInt(32), SInt(0)), SInt(C::kMaxShift))));
  const Bits dm = Bits(min_of(d, SInt(C::kMaxShift)));
  const Bits stepped = ((a + noise) >> dm) << dm;
  const Bits below = select(r < steps_below_bound(a, p), p.below_step, Bits(0));
  const Bits mag = select(d <= SInt(C::kMantBits), stepped, below);
  if constexpr (kSymmetric) return rounded_result_symmetric(x, mag, p, ev);
  else return rounded_result(x, mag, p, ev);
}

// Where magnitude a lies between its neighbours on E's grid (continued past max), as the 32-bit
// fraction the steps form compares: X = floor(2^32 rem / 2^d) (rem: the d dropped bits), or the
// bound below E's smallest step, so that round_stochastic_by_steps steps up exactly when r < X
// (r: the random word with its low sr_shift bits set). Where stochastic_by_steps(p) holds.
template <class Bits>
LOWFP_HD uint32_t steps_position(Bits a, const RoundParams<Bits>& p) {
  using C = CarrierTraits<Bits>;
  using SInt = std::make_signed_t<Bits>;
  const SInt d = steps_drop(a, p);
  const Bits dm = Bits(min_of(d, SInt(C::kMaxShift)));
  const Bits rem = a & ((Bits(1) << dm) - 1u);
  Bits x = rem << Bits(max_of(SInt(32) - d, SInt(0)));
  if constexpr (sizeof(Bits) == 8) x = select(d <= 32, x, rem >> Bits(max_of(d - SInt(32), SInt(0))));
  return uint32_t(select(d <= SInt(C::kMantBits), x, steps_below_bound(a, p)));
}

// round_bits for float32 to bfloat16 with IEEE overflow to inf and, for stochastic rounding, 32
// random bits (the extra-bits split, bfloat16 optimizer state): the same results and events with
// every parameter folded in. The general form keeps the grid, shifts and overflow choice as
// run-time values: about 30 vector operations per element more in the optimizer step loops.
template <RoundKind Kind>
LOWFP_HD uint32_t round_to_bfloat16_bits(uint32_t x, uint32_t rand, RoundEvents& ev) {
  static_assert(Kind != RoundKind::Directed, "directed rounding: only toward zero");
  constexpr uint32_t kAbs = 0x7fffffffu, kInf = 0x7f800000u, kMax = 0x7f7f0000u;
  const uint32_t a = x & kAbs, rem = a & 0xffffu;  // rem: the 16 dropped bits
  uint32_t up = 0;
  if constexpr (Kind == RoundKind::Nearest)  // rem > half, or a tie with an odd kept part
    up = uint32_t((rem << 1) + ((a >> 16) & 1u) > 0x10000u);
  else if constexpr (Kind == RoundKind::Stochastic)  // rand < rem 2^16
    up = uint32_t((rand >> 16) < rem);
  const uint32_t mag = (a & ~0xffffu) + (up << 16);  // a carry steps into the next binade or inf
  ev.nan = a > kInf;
  ev.above_max = mag > kMax;  // only inf (or NaN): mag never passes inf's bits for a <= inf
  ev.underflow = (a != 0) & (mag == 0);
  return select(ev.nan, x, (x & ~kAbs) | mag);
}

// round_bits's parameters for float32 to float16 (fp(5,10,0), IEEE specials, subnormals) with
// IEEE overflow and 32 random bits, as compile-time constants, for the extra-bits split as
// round_to_bfloat16_bits is for bfloat16 (make_extra_bits_params checks them against
// make_round_params).
template <RoundKind Kind>
LOWFP_HD constexpr RoundParams<uint32_t> float16_round_params() {
  static_assert(Kind != RoundKind::Directed, "directed rounding: only toward zero");
  constexpr uint32_t kMax = 0x477fe000u;  // 65504
  constexpr uint32_t kOverflow = Kind == RoundKind::TowardZero ? kMax : 0x7f800000u;  // or inf
  RoundParams<uint32_t> p{};
  p.normal_drop = 13;
  p.below_drop = 13;
  p.emin = -14;
  p.below_step = 0x33800000u;  // 2^-24
  p.max_bits = kMax;
  p.overflow_pos = kOverflow;
  p.overflow_neg = 0x80000000u | kOverflow;
  p.inf_stays_inf = true;
  p.no_negative_zero = false;
  p.ties_away = false;
  p.parity_bias = 0;
  p.parity_mask = ~0u;
  p.away_pos = p.away_neg = false;
  p.sr_shift = 0;
  p.subnormal_exponent = false;
  p.fixed_drop = false;
  return p;
}

template <RoundKind Kind>
LOWFP_HD uint32_t round_to_float16_bits(uint32_t x, uint32_t rand, RoundEvents& ev) {
  constexpr RoundParams<uint32_t> p = float16_round_params<Kind>();
  return round_bits<Kind, uint32_t, false>(x, p, rand, ev);
}

}  // namespace lowfp
