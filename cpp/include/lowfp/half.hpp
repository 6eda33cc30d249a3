// float16 / bfloat16 storage <-> float32 carrier bits. Widening is exact; narrowing is only ever
// asked of values the 16-bit type holds exactly (the rounding kernel put them on its grid), plus
// inf and NaN, so it needs no rounding of its own.
#pragma once
#include "config.hpp"

namespace lowfp {

LOWFP_HD uint32_t half_to_float_bits(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t ex = (h >> 10) & 0x1fu;
  const uint32_t frac = h & 0x3ffu;
  // Subnormal halves (ex == 0) are frac * 2^-24: exact as a float32 product.
  const float sub = float(frac) * 5.9604644775390625e-08f;
  const uint32_t sub_bits = bit_cast<uint32_t>(sub);
  const uint32_t normal_bits = ((ex + (127 - 15)) << 23) | (frac << 13);
  const uint32_t special_bits = 0x7f800000u | (frac << 13);  // inf, or NaN keeping its payload
  const uint32_t mag = select(ex == 0, sub_bits, select(ex == 0x1f, special_bits, normal_bits));
  return sign | mag;
}

LOWFP_HD uint16_t float_bits_to_half(uint32_t f) {
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7fffffffu;
  const int32_t ex = int32_t(a >> 23);
  // Normal half: rebias and drop the 13 low fraction bits (zero for representable values).
  const uint32_t normal = (uint32_t(ex - (127 - 15)) << 10) | ((a >> 13) & 0x3ffu);
  // Subnormal half (|v| < 2^-14): the value in units of 2^-24, exact for representable values.
  // (clamped to 2^-14 so that the discarded lanes convert in range)
  const uint32_t sub = uint32_t(int32_t(bit_cast<float>(min_of(a, 0x38800000u)) * 16777216.0f));
  const uint32_t special = select(a > 0x7f800000u, 0x7e00u, 0x7c00u);
  const uint32_t mag = select(a >= 0x7f800000u, special, select(ex >= 127 - 14, normal, sub));
  return uint16_t(sign | mag);
}

LOWFP_HD uint32_t bfloat16_to_float_bits(uint16_t h) { return uint32_t(h) << 16; }

LOWFP_HD uint16_t float_bits_to_bfloat16(uint32_t f) {
  // Truncation is exact for representable values; a NaN whose payload sits in the low half
  // must not turn into inf.
  const bool nan = (f & 0x7fffffffu) > 0x7f800000u;
  return uint16_t(select(nan, (f >> 16) | 0x0040u, f >> 16));
}

}  // namespace lowfp
