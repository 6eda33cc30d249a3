// 16-bit weights plus k extra bits (docs/design.md §5): split an fp32 master W into a float16/bfloat16
// weight w and the next k bits of W's significand below the truncation t of W, merge them back
// into W' (W truncated to 16-bit precision + k bits), and pack q bits per element (k, plus a flag
// bit when w was rounded away from t) into blocks of 32 elements = q int32 words.
#pragma once
#include <type_traits>

#include "round.hpp"
#include "storage.hpp"

namespace lowfp {

// The 16-bit type and k; built on the host (make_extra_bits_params).
struct ExtraBitsParams {
  int32_t m16, emin16, emax16;  // the 16-bit type's fraction bits and exponent range
  uint32_t k;                   // extra bits per element
  uint32_t q;                   // packed bits per element: k, + 1 flag bit unless toward_zero
  bool bf16;
};

constexpr uint32_t kF32Abs = 0x7fffffffu, kF32Inf = 0x7f800000u;

// 2^exponent as float32 bits, for exponents of float32's normal range.
LOWFP_HD uint32_t pow2_bits(int32_t exponent) { return uint32_t(127 + exponent) << 23; }

// The k bits of |W| just below the last bit of t = W truncated toward zero to the 16-bit type:
// floor((|W| - |t|) / ulp(t) * 2^k). Zero for inf/NaN and for |W| >= 2^(emax16 + 1) (t is then
// not in W's binade). Branch-free.
template <class W16>
LOWFP_HD uint32_t extra_bits_of(uint32_t w32, const ExtraBitsParams& e) {
  const uint32_t k_mask = (1u << e.k) - 1u;
  if constexpr (std::is_same_v<W16, BFloat>) {
    // bfloat16 is the top half of float32 (subnormals included): the extra bits are the next k.
    const bool finite = (w32 & kF32Abs) < kF32Inf;
    return select(finite, (w32 >> (16 - e.k)) & k_mask, 0u);
  }
  const uint32_t a = w32 & kF32Abs;
  // From 2^emin16 up, ulp(t) is float32's bit 23 - m16 of W: the extra bits are the k below it.
  const uint32_t normal = (a >> (23 - e.m16 - int32_t(e.k))) & k_mask;
  // Below, ulp(t) = 2^(emin16 - m16): |W| / ulp(t) * 2^k < 2^(m16 + k) <= 2^23 is an exact product
  // (a power of two), and its integer part ends in the k bits. (|W| clamped to 2^emin16 so that
  // the lanes not selected convert in range too.)
  const float to_units = bit_cast<float>(pow2_bits(e.m16 + int32_t(e.k) - e.emin16));
  const float below = bit_cast<float>(min_of(a, pow2_bits(e.emin16)));
  const uint32_t subnormal = uint32_t(int32_t(below * to_units)) & k_mask;
  return select(a < pow2_bits(e.emin16), subnormal,
                select(a < pow2_bits(e.emax16 + 1), normal, 0u));
}

// split: w = W rounded to the 16-bit type by the mode (returned as float32 bits; Store<W16>
// narrows them exactly), its extra bits and its flag. The rounding has every parameter folded in
// (IEEE overflow, 32 random bits; make_extra_bits_params checks them against make_round_params).
template <class W16, RoundKind Kind>
LOWFP_HD uint32_t split_bits(uint32_t w32, const ExtraBitsParams& e, uint32_t rand, uint32_t& extra,
                             uint32_t& flag, RoundEvents& ev) {
  const uint32_t w = std::is_same_v<W16, BFloat> ? round_to_bfloat16_bits<Kind>(w32, rand, ev)
                                                 : round_to_float16_bits<Kind>(w32, rand, ev);
  // w is t or t's neighbour away from zero; the latter exactly when |w| > |W|.
  const uint32_t a = w32 & kF32Abs;
  flag = uint32_t(a <= kF32Inf) & uint32_t((w & kF32Abs) > a);  // & not &&: no branch
  if constexpr (Kind == RoundKind::TowardZero) flag = 0;  // w = t (and no flag bit is stored)
  extra = extra_bits_of<W16>(w32, e);
  return w;
}

// t, the truncation of W, from w and its flag: w stepped one ulp toward zero on the 16-bit
// pattern when the flag is set (from inf, a rounded-up overflow, that is the largest value).
template <class W16>
LOWFP_HD W16 truncation(W16 w, uint32_t flag) {
  return W16{uint16_t(w.v - flag)};
}
template <class W16>
LOWFP_HD uint32_t truncation_bits(W16 w, uint32_t flag) {
  return Widen<uint32_t>::from(truncation(w, flag));
}

// merge: W' = t + extra * ulp(t) / 2^k (t as float32 bits), exact: W' is representable in
// float32. From 2^emin16 up (bfloat16: everywhere) that is extra written into the zero bits of t's
// pattern below the 16-bit type's last bit; below, ulp(t) = 2^(emin16 - m16) and the float sum is
// exact. inf and NaN stay t.
template <class W16>
LOWFP_HD uint32_t merge_bits(uint32_t t, uint32_t extra, const ExtraBitsParams& e) {
  if constexpr (std::is_same_v<W16, BFloat>) return t | (extra << (16 - e.k));
  const uint32_t a = t & kF32Abs;
  const uint32_t written = t | (extra << (23 - e.m16 - int32_t(e.k)));
  const float step = bit_cast<float>(pow2_bits(e.emin16 - e.m16 - int32_t(e.k)));  // >= 2^-37
  const uint32_t summed = bit_cast<uint32_t>(bit_cast<float>(a) + float(int32_t(extra)) * step);
  return select(a >= kF32Inf, t,
                select(a < pow2_bits(e.emin16), summed | (t & ~kF32Abs), written));
}

// The most bits an element takes in a packed block: k <= 16 extra bits and a flag bit.
constexpr uint32_t kMaxPackedBits = 17;

// Packing: element j of a 32-element block occupies bits [j q, (j + 1) q) of the block's q words
// (a little-endian bit string); value = extra | flag << k.
// unpack_from reads an element's q bits from its first word (block + j q / 32) and bit offset in
// that word (shift = j q % 32): a GPU lane finds them once for all its blocks.
LOWFP_HD uint32_t unpack_from(const uint32_t* first_word, uint32_t shift, uint32_t q) {
  uint64_t window = first_word[0];
  if (shift + q > 32) window |= uint64_t(first_word[1]) << 32;
  return uint32_t(window >> shift) & ((1u << q) - 1u);
}

LOWFP_HD uint32_t unpack_one(const uint32_t* block, uint32_t q, uint32_t j) {
  const uint32_t bit = j * q;
  return unpack_from(block + (bit >> 5), bit & 31, q);
}

// Writes the 32 values of a block (each < 2^q) into its q words.
LOWFP_HD void pack_block(const uint32_t* values, uint32_t q, uint32_t* block) {
  uint64_t acc = 0;
  uint32_t filled = 0, out = 0;
LOWFP_UNROLL
  for (uint32_t j = 0; j < 32; ++j) {
    acc |= uint64_t(values[j]) << filled;
    filled += q;
    if (filled >= 32) {
      block[out++] = uint32_t(acc);
      acc >>= 32;
      filled -= 32;
    }
  }
}

}  // namespace lowfp
