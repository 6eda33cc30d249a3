// 16-bit weights plus k extra bits (docs/design.md §5): split an fp32 master W into a float16/bfloat16
// weight w and the next k bits of W's significand below the truncation t of W, merge them back
// into W' (W truncated to 16-bit precision + k bits), and pack q bits per element (k, plus a flag
// bit when w was rounded away from t) into blocks of 32 elements = q int32 words.
#pragma once
#include <type_traits>

#include "round.hpp"
#include "storage.hpp"

namespace lowfp {

// The weights' grid and k; built on the host (make_extra_bits_params). The grid is the 16-bit
// type's own, or (grid) a weight format F whose values the 16-bit type holds exactly: w is then
// rounded to F (saturating) and the extra bits continue below F's last bit.
struct ExtraBitsParams {
  int32_t m16, emin16, emax16;  // the grid's fraction bits and exponent range
  uint32_t k;                   // extra bits per element
  uint32_t q;                   // packed bits per element: k, + 1 flag bit unless toward_zero
  bool bf16;                    // the storage type
  bool grid;                    // a weight format F (then f rounds to it)
  int32_t below_ulp_exp;        // the grid's step below 2^emin16 is 2^below_ulp_exp
  uint32_t top_bits;            // float32 bits of the first magnitude whose truncation to the
                                // grid is out of its range: max + one ulp
  RoundParams<uint32_t> f;      // grid: the rounding to F in a float32 carrier
};

constexpr uint32_t kF32Abs = 0x7fffffffu, kF32Inf = 0x7f800000u;

// 2^exponent as float32 bits, for exponents of float32's normal range.
LOWFP_HD uint32_t pow2_bits(int32_t exponent) { return uint32_t(127 + exponent) << 23; }

// The k bits of |W| just below the last bit of t = W truncated toward zero to the 16-bit type:
// floor((|W| - |t|) / ulp(t) * 2^k). Zero for inf/NaN and for |W| >= 2^(emax16 + 1) (t is then
// not in W's binade). Branch-free.
template <class W16, bool kGrid = false>
LOWFP_HD uint32_t extra_bits_of(uint32_t w32, const ExtraBitsParams& e) {
  const uint32_t k_mask = (1u << e.k) - 1u;
  if constexpr (std::is_same_v<W16, BFloat> && !kGrid) {
    // bfloat16 is the top half of float32 (subnormals included): the extra bits are the next k.
    const bool finite = (w32 & kF32Abs) < kF32Inf;
    return select(finite, (w32 >> (16 - e.k)) & k_mask, 0u);
  }
  const uint32_t a = w32 & kF32Abs;
  // From 2^emin16 up, ulp(t) is float32's bit 23 - m16 of W: the extra bits are the k below it.
  const uint32_t normal = (a >> (23 - e.m16 - int32_t(e.k))) & k_mask;
  // Below, ulp(t) = 2^below_ulp_exp: |W| / ulp(t) * 2^k < 2^(m16 + k) <= 2^23 is an exact product
  // (a power of two), and its integer part ends in the k bits. (|W| clamped to 2^emin16 so that
  // the lanes not selected convert in range too.)
  const float to_units = bit_cast<float>(pow2_bits(int32_t(e.k) - e.below_ulp_exp));
  const float below = bit_cast<float>(min_of(a, pow2_bits(e.emin16)));
  const uint32_t subnormal = uint32_t(int32_t(below * to_units)) & k_mask;
  return select(a < pow2_bits(e.emin16), subnormal, select(a < e.top_bits, normal, 0u));
}

// split: w = W rounded to the 16-bit type by the mode (returned as float32 bits; Store<W16>
// narrows them exactly), its extra bits and its flag. The rounding has every parameter folded in
// (IEEE overflow, 32 random bits; make_extra_bits_params checks them against make_round_params).
template <class W16, RoundKind Kind, bool kGrid = false>
LOWFP_HD uint32_t split_bits(uint32_t w32, const ExtraBitsParams& e, uint32_t rand, uint32_t& extra,
                             uint32_t& flag, RoundEvents& ev) {
  uint32_t w;
  if constexpr (kGrid)
    w = round_bits<Kind, uint32_t, false>(w32, e.f, rand, ev);
  else
    w = std::is_same_v<W16, BFloat> ? round_to_bfloat16_bits<Kind>(w32, rand, ev)
                                    : round_to_float16_bits<Kind>(w32, rand, ev);
  // w is t or t's neighbour away from zero; the latter exactly when |w| > |W|.
  const uint32_t a = w32 & kF32Abs;
  flag = uint32_t(a <= kF32Inf) & uint32_t((w & kF32Abs) > a);  // & not &&: no branch
  if constexpr (Kind == RoundKind::TowardZero) flag = 0;  // w = t (and no flag bit is stored)
  extra = extra_bits_of<W16, kGrid>(w32, e);
  return w;
}

// t from w (float32 bits, a value of the weight format F) and its flag: w's neighbour toward zero
// on F's grid when the flag is set. Above 2^emin16 that is the float32 pattern less one F ulp (a
// binade's first value steps to the last of the one below); from 2^emin16 down, w less F's step
// there, exactly.
LOWFP_HD uint32_t grid_truncation_bits(uint32_t w, uint32_t flag, const ExtraBitsParams& e) {
  const uint32_t a = w & kF32Abs;
  const uint32_t above = a - (1u << (23 - e.m16));
  const uint32_t below =
      bit_cast<uint32_t>(bit_cast<float>(a) - bit_cast<float>(pow2_bits(e.below_ulp_exp)));
  const uint32_t t = (w & ~kF32Abs) | select(a > pow2_bits(e.emin16), above, below);
  return select(flag != 0u, t, w);
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

// truncation_bits on the weights' grid: the 16-bit type's, or (kGrid) a weight format's.
template <class W16, bool kGrid>
LOWFP_HD uint32_t grid_or_type_truncation_bits(W16 w, uint32_t flag, const ExtraBitsParams& e) {
  if constexpr (kGrid) return grid_truncation_bits(Widen<uint32_t>::from(w), flag, e);
  else return truncation_bits(w, flag);
}

// merge: W' = t + extra * ulp(t) / 2^k (t as float32 bits), exact: W' is representable in
// float32. From 2^emin16 up (bfloat16: everywhere) that is extra written into the zero bits of t's
// pattern below the 16-bit type's last bit; below, ulp(t) = 2^(emin16 - m16) and the float sum is
// exact. inf and NaN stay t.
template <class W16, bool kGrid = false>
LOWFP_HD uint32_t merge_bits(uint32_t t, uint32_t extra, const ExtraBitsParams& e) {
  if constexpr (std::is_same_v<W16, BFloat> && !kGrid) return t | (extra << (16 - e.k));
  const uint32_t a = t & kF32Abs;
  const uint32_t written = t | (extra << (23 - e.m16 - int32_t(e.k)));
  // float16: >= 2^-37; a weight format: at least 2^-126 (make_extra_bits_params)
  const float step = bit_cast<float>(pow2_bits(e.below_ulp_exp - int32_t(e.k)));
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
