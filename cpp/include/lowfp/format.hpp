// Formats fp(e, m, b) and the constants the rounding kernel needs for one carrier (docs/design.md §2-3).
#pragma once
#include <cmath>
#include <string>

#include "config.hpp"

namespace lowfp {

// The special-value conventions (docs/design.md §2): None, every code finite; IEEE, the top
// exponent code holds infinities and NaNs; FN, the all-ones code (both signs) is NaN (OCP E4M3);
// FNUZ, the values of None without negative zero (-0's code is NaN); P3109, IEEE P3109's
// extended domain: the all-ones code is +-inf and -0's code NaN, no negative zero.
enum class Specials : int32_t { None = 0, IEEE = 1, FN = 2, FNUZ = 3, P3109 = 4 };
constexpr int32_t kSpecialsCodes = 5;  // the codes a caller may pass: 0 to 4
enum class Overflow : int32_t { Saturate = 0, Inf = 1, NaN = 2 };
enum class Rounding : int32_t {
  Nearest = 0, NearestAway = 1, TowardZero = 2, Up = 3, Down = 4, Stochastic = 5
};
// Storage types of buffers handed to the drivers.
enum class DType : int32_t { Float16 = 0, BFloat16 = 1, Float32 = 2, Float64 = 3 };

struct FormatSpec {
  int32_t e;         // exponent bits
  int32_t m;         // mantissa (fraction) bits
  int32_t b;         // extra exponent bias
  Specials specials;
  bool subnormals;
};

// Bytes per element of a storage type.
LOWFP_HD int32_t dtype_size(DType t) {
  return t == DType::Float64 ? 8 : t == DType::Float32 ? 4 : 2;
}

// The format of a storage type: IEEE binary16, bfloat16, binary32 or binary64.
LOWFP_HD FormatSpec storage_spec(DType t) {
  switch (t) {
    case DType::Float16: return FormatSpec{5, 10, 0, Specials::IEEE, true};
    case DType::BFloat16: return FormatSpec{8, 7, 0, Specials::IEEE, true};
    case DType::Float32: return FormatSpec{8, 23, 0, Specials::IEEE, true};
    default: return FormatSpec{11, 52, 0, Specials::IEEE, true};
  }
}

// Derived exponents. B = 2^(e-1) - 1 + b, emin = 1 - B.
LOWFP_HD int32_t exponent_bias(const FormatSpec& f) { return (1 << (f.e - 1)) - 1 + f.b; }
LOWFP_HD int32_t min_exponent(const FormatSpec& f) { return 1 - exponent_bias(f); }
// Whether the all-ones code (both signs) is not a finite number: NaN ("fn") or inf ("p3109").
LOWFP_HD bool reserves_top_code(const FormatSpec& f) {
  return f.specials == Specials::FN || f.specials == Specials::P3109;
}
LOWFP_HD int32_t max_exponent(const FormatSpec& f) {
  const int32_t top = (1 << f.e) - 1 - exponent_bias(f);
  // IEEE reserves the top exponent code for inf/NaN; with m = 0 the all-ones code is that
  // exponent's only code
  return f.specials == Specials::IEEE || (reserves_top_code(f) && f.m == 0) ? top - 1 : top;
}
// Largest finite value is 2^emax * max_significand; the all-ones code may be reserved.
inline double max_significand(const FormatSpec& f) {
  if (reserves_top_code(f) && f.m == 0) return 1.0;
  return 2.0 - std::ldexp(1.0, (reserves_top_code(f) ? 1 : 0) - f.m);
}
inline double max_value(const FormatSpec& f) {
  return std::ldexp(max_significand(f), max_exponent(f));
}
// Exponent of the smallest positive value: a subnormal, or 2^emin without subnormals.
LOWFP_HD int32_t smallest_exponent(const FormatSpec& f) {
  return min_exponent(f) - (f.subnormals ? f.m : 0);
}

// What a storage or carrier type can hold exactly.
struct TypeLimits {
  const char* name;
  int32_t mant_bits;
  int32_t max_exp;
  int32_t smallest_exp;
};
// The exponent field of a storage type's raw bits (all ones: an infinity or a NaN).
LOWFP_HD uint64_t exponent_mask(DType t) {
  switch (t) {
    case DType::Float16: return 0x7c00u;
    case DType::BFloat16: return 0x7f80u;
    case DType::Float32: return 0x7f800000u;
    default: return 0x7ff0000000000000ull;
  }
}
template <class U>
LOWFP_HD bool non_finite_bits(U bits, U exponent) { return (bits & exponent) == exponent; }
// A NaN's raw bits: without the sign, above the exponent field's all-ones (an infinity).
template <class U>
LOWFP_HD bool nan_bits(U bits, U exponent) {
  return U(bits & U(~(U(1) << (8 * sizeof(U) - 1)))) > exponent;
}

inline TypeLimits type_limits(DType t) {
  switch (t) {
    case DType::Float16: return {"float16", 10, 15, -24};
    case DType::BFloat16: return {"bfloat16", 7, 127, -133};
    case DType::Float32: return {"float32", 23, 127, -149};
    default: return {"float64", 52, 1023, -1074};
  }
}

// Empty when every value of f is exactly representable in t; else which limit it exceeds.
inline std::string fit_error(const FormatSpec& f, DType t) {
  const TypeLimits lim = type_limits(t);
  const std::string fmt = "fp(" + std::to_string(f.e) + "," + std::to_string(f.m) + "," +
                          std::to_string(f.b) + ")";
  if (f.m > lim.mant_bits)
    return fmt + " has m=" + std::to_string(f.m) + " mantissa bits; " + lim.name + " holds at most " +
           std::to_string(lim.mant_bits);
  if (max_exponent(f) > lim.max_exp)
    return fmt + " has largest exponent emax=" + std::to_string(max_exponent(f)) + "; " + lim.name +
           " allows at most " + std::to_string(lim.max_exp);
  // The finest grid step, 2^(emin - m), must be a value of t: with subnormals it is the smallest
  // subnormal; without, the normals just above 2^emin are still that far apart.
  const int32_t finest = min_exponent(f) - f.m;
  if (finest < lim.smallest_exp)
    return fmt + " has finest grid step 2^" + std::to_string(finest) + " (2^(emin-m) with emin=" +
           std::to_string(min_exponent(f)) + "); " + lim.name + " reaches down to 2^" +
           std::to_string(lim.smallest_exp);
  return std::string();
}

// Empty when (e, m, b, specials) describes a format some carrier can hold.
inline std::string spec_error(const FormatSpec& f) {
  if (f.e < 1 || f.e > 11) return "e must be between 1 and 11, got " + std::to_string(f.e);
  if (f.m < 0 || f.m > 52) return "m must be between 0 and 52, got " + std::to_string(f.m);
  if (f.b < -4096 || f.b > 4096) return "b must be between -4096 and 4096, got " + std::to_string(f.b);
  if (f.specials == Specials::IEEE && f.e < 2)
    return "specials='ieee' needs e >= 2 (the top exponent code is reserved), got e=" +
           std::to_string(f.e);
  if (f.specials == Specials::FN && f.m < 1)
    return "specials='fn' needs m >= 1 (the all-ones code is NaN), got m=" + std::to_string(f.m);
  if (f.specials == Specials::P3109 && f.e + f.m < 2)
    return "specials='p3109' needs e + m >= 2 (the all-ones code is inf: fp(1,0) would hold only 0)";
  return fit_error(f, DType::Float64);
}

// Integer view of a binary floating-point carrier.
template <class Bits> struct CarrierTraits;
template <> struct CarrierTraits<uint32_t> {
  using Float = float;
  static constexpr int32_t kMantBits = 23, kExpBias = 127, kMaxShift = 31;
  static constexpr uint32_t kSign = 0x80000000u, kInf = 0x7f800000u, kQuietNaN = 0x7fc00000u;
  static constexpr uint32_t kMantMask = 0x007fffffu, kImplicit = 0x00800000u;
  static constexpr DType kDType = DType::Float32;
};
template <> struct CarrierTraits<uint64_t> {
  using Float = double;
  static constexpr int32_t kMantBits = 52, kExpBias = 1023, kMaxShift = 63;
  static constexpr uint64_t kSign = 0x8000000000000000ull, kInf = 0x7ff0000000000000ull;
  static constexpr uint64_t kQuietNaN = 0x7ff8000000000000ull;
  static constexpr uint64_t kMantMask = 0x000fffffffffffffull, kImplicit = 0x0010000000000000ull;
  static constexpr DType kDType = DType::Float64;
};

// Everything the element kernel needs, as carrier bit patterns; built once per call on the host.
template <class Bits>
struct RoundParams {
  int32_t normal_drop;    // carrier mantissa bits dropped at or above 2^emin: MB - m
  int32_t below_drop;     // MB - m_low below 2^emin (m_low = m with subnormals, else 0) ...
  int32_t emin;           // ... plus (emin - exponent) for each binade further down
  Bits below_step;        // grid step below 2^emin, 2^(emin - m_low): the result when d > MB
  Bits max_bits;          // largest finite magnitude
  Bits overflow_pos;      // what a positive overflow becomes (full bit pattern)
  Bits overflow_neg;      // what a negative overflow becomes
  bool inf_stays_inf;     // policy "inf": infinite inputs stay infinite whatever the mode
  bool no_negative_zero;  // "fnuz", "p3109": zero is +0
  bool ties_away;         // nearest_away
  // Which neighbour a nearest tie keeps: the one whose encoding is even. With m > 0 that is the
  // kept significand's last bit (parity_mask all ones); with m = 0 there is none and it is the
  // exponent code's, E + B (parity_mask 0, parity_bias B): trunc & ((E + parity_bias) | parity_mask).
  int32_t parity_bias;
  Bits parity_mask;
  bool away_pos, away_neg;  // directed modes: which signs round their magnitude up
  uint32_t sr_shift;      // 32 - sr_bits: the random word keeps its top sr_bits bits
  bool subnormal_exponent;  // carrier subnormals need their true exponent (see round_bits)
  bool fixed_drop;          // every carrier value drops normal_drop bits: emin is the carrier's,
                            // with subnormals (bfloat16 in float32)
};

template <class Bits>
inline Bits float_bits(typename CarrierTraits<Bits>::Float v) { return bit_cast<Bits>(v); }

// Host-side construction; the caller has checked that fit_error(f, carrier) is empty.
template <class Bits>
RoundParams<Bits> make_round_params(const FormatSpec& f, Overflow overflow, Rounding mode,
                                    int32_t sr_bits) {
  using C = CarrierTraits<Bits>;
  using F = typename C::Float;
  RoundParams<Bits> p{};
  const int32_t m_low = f.subnormals ? f.m : 0;
  p.normal_drop = C::kMantBits - f.m;
  p.below_drop = C::kMantBits - m_low;
  p.emin = min_exponent(f);
  p.below_step = float_bits<Bits>(std::ldexp(F(1), p.emin - m_low));
  p.max_bits = float_bits<Bits>(F(max_value(f)));
  const Bits inf = C::kInf, mx = p.max_bits, s = C::kSign;
  switch (overflow) {
    case Overflow::Saturate: p.overflow_pos = mx; p.overflow_neg = s | mx; break;
    case Overflow::NaN: p.overflow_pos = p.overflow_neg = C::kQuietNaN; break;
    case Overflow::Inf:  // as IEEE 754 overflow: directed modes stop at max on their side
      p.overflow_pos = (mode == Rounding::TowardZero || mode == Rounding::Down) ? mx : inf;
      p.overflow_neg = s | ((mode == Rounding::TowardZero || mode == Rounding::Up) ? mx : inf);
      break;
  }
  p.inf_stays_inf = overflow == Overflow::Inf;
  p.no_negative_zero = f.specials == Specials::FNUZ || f.specials == Specials::P3109;
  p.ties_away = mode == Rounding::NearestAway;
  p.parity_bias = f.m == 0 ? exponent_bias(f) : 0;
  p.parity_mask = f.m == 0 ? Bits(0) : ~Bits(0);
  p.away_pos = mode == Rounding::Up;
  p.away_neg = mode == Rounding::Down;
  p.sr_shift = uint32_t(32 - sr_bits);
  // Carrier subnormals lie below the carrier's emin. Taking their exponent as that emin gives the
  // same grid step when the target's emin is above it, or equal with subnormals on; otherwise
  // (e.g. fp(8,m,1) in float32) the kernel must find their leading bit.
  const int32_t carrier_emin = 1 - C::kExpBias;
  p.subnormal_exponent = p.emin < carrier_emin || (p.emin == carrier_emin && !f.subnormals);
  p.fixed_drop = p.emin == carrier_emin && f.subnormals;
  return p;
}

}  // namespace lowfp
