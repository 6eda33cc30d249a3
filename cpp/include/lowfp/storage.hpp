// Storage types of the buffers a driver reads and writes, and their conversion to and from the
// carrier's bit pattern (float32 bits in uint32_t, float64 bits in uint64_t).
// Widening is exact. Narrowing only ever sees values on a format's grid that the storage type
// holds (the caller checked the format fits it), plus inf and NaN.
#pragma once
#include <type_traits>

#include "half.hpp"

namespace lowfp {

struct Half { uint16_t v; };    // IEEE binary16
struct BFloat { uint16_t v; };  // bfloat16

// The unsigned integer holding a storage type's bits.
template <class T>
using RawOf = std::conditional_t<sizeof(T) == 2, uint16_t,
                                 std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;

template <class Bits> struct Widen;
template <> struct Widen<uint32_t> {
  static LOWFP_HD uint32_t from(Half h) { return half_to_float_bits(h.v); }
  static LOWFP_HD uint32_t from(BFloat h) { return bfloat16_to_float_bits(h.v); }
  static LOWFP_HD uint32_t from(float f) { return bit_cast<uint32_t>(f); }
};
template <> struct Widen<uint64_t> {
  static LOWFP_HD uint64_t f32(uint32_t b) { return bit_cast<uint64_t>(double(bit_cast<float>(b))); }
  static LOWFP_HD uint64_t from(Half h) { return f32(half_to_float_bits(h.v)); }
  static LOWFP_HD uint64_t from(BFloat h) { return f32(bfloat16_to_float_bits(h.v)); }
  static LOWFP_HD uint64_t from(float f) { return bit_cast<uint64_t>(double(f)); }
  static LOWFP_HD uint64_t from(double f) { return bit_cast<uint64_t>(f); }
};

template <class Out> struct Store;
template <> struct Store<Half> {
  static LOWFP_HD Half from(uint32_t b) { return Half{float_bits_to_half(b)}; }
  static LOWFP_HD Half from(uint64_t b) { return from(bit_cast<uint32_t>(float(bit_cast<double>(b)))); }
};
template <> struct Store<BFloat> {
  static LOWFP_HD BFloat from(uint32_t b) { return BFloat{float_bits_to_bfloat16(b)}; }
  static LOWFP_HD BFloat from(uint64_t b) { return from(bit_cast<uint32_t>(float(bit_cast<double>(b)))); }
};
template <> struct Store<float> {
  static LOWFP_HD float from(uint32_t b) { return bit_cast<float>(b); }
  static LOWFP_HD float from(uint64_t b) { return float(bit_cast<double>(b)); }
};
template <> struct Store<double> {
  static LOWFP_HD double from(uint64_t b) { return bit_cast<double>(b); }
};

}  // namespace lowfp
