// 16-bit weights plus k extra bits (DESIGN §5): split an fp32 master W into a float16/bfloat16
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
  RoundParams<uint32_t> round;  // rounding of W to float16 by the chosen mode (bfloat16: folded in)
  int32_t m16, emin16, emax16;  // the 16-bit type's fraction bits and exponent range
  uint32_t k;                   // extra bits per element
  uint32_t q;                   // packed bits per element: k, + 1 flag bit unless toward_zero
  bool bf16;
};

constexpr uint32_t kF32Abs = 0x7fffffffu, kF32Inf = 0x7f800000u;

// The k bits of |W| just below the last bit of t = W truncated toward zero to the 16-bit type:
// floor((|W| - |t|) / ulp(t) * 2^k). Zero for inf/NaN and for |W| >= 2^(emax16 + 1) (t is then
// not in W's binade). Branch-free 32-bit integer code.
template <class W16>
LOWFP_HD uint32_t extra_bits_of(uint32_t w32, const ExtraBitsParams& e) {
  if constexpr (std::is_same_v<W16, BFloat>) {
    // bfloat16 is the top half of float32 (subnormals included): the extra bits are the next k.
    const bool finite = (w32 & kF32Abs) < kF32Inf;
    return select(finite, (w32 >> (16 - e.k)) & ((1u << e.k) - 1u), 0u);
  }
  const uint32_t a = w32 & kF32Abs;
  const int32_t field = int32_t(a >> 23);
  const int32_t exp_w = field - 127;  // -127 for zero and float32 subnormals
  const uint32_t sig = (a & 0x7fffffu) | (field != 0 ? 0x800000u : 0u);  // |W| = sig * 2^e_w
  const int32_t e_t = max_of(exp_w, e.emin16) - e.m16;                 // ulp(t) = 2^e_t
  const int32_t e_w = max_of(exp_w, -126) - 23;
  const int32_t d = e_t - e_w;  // |W| mod ulp(t) = (sig mod 2^d) * 2^e_w; d >= k for every W
  const uint32_t low = select(d >= 32, sig, sig & ((1u << min_of(d, 31)) - 1u));
  const uint32_t extra = low >> min_of(d - int32_t(e.k), 31);
  return select((field < 255) & (exp_w <= e.emax16), extra, 0u);
}

// split: w = W rounded to the 16-bit type by the mode (returned as float32 bits; Store<W16>
// narrows them exactly), its extra bits and its flag.
template <class W16, RoundKind Kind, bool kSubExp>
LOWFP_HD uint32_t split_bits(uint32_t w32, const ExtraBitsParams& e, uint32_t rand, uint32_t& extra,
                             uint32_t& flag, RoundEvents& ev) {
  uint32_t w;
  if constexpr (std::is_same_v<W16, BFloat>)  // e.round's parameters, folded in
    w = round_to_bfloat16_bits<Kind>(w32, rand, ev);
  else
    w = round_bits<Kind, uint32_t, kSubExp>(w32, e.round, rand, ev);
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

// merge: W' = t + extra * ulp(t) / 2^k (t as float32 bits). Exact: W' is representable in
// float32, so the float addition does not round.
template <class W16>
LOWFP_HD uint32_t merge_bits(uint32_t t, uint32_t extra, const ExtraBitsParams& e) {
  if constexpr (std::is_same_v<W16, BFloat>) {
    // The same sum as below, as bits: t's low 16 bits are zero and extra fills the top k of them.
    return t | (extra << (16 - e.k));
  }
  const uint32_t a = t & kF32Abs;
  const int32_t e_scale = max_of(int32_t(a >> 23) - 127, e.emin16) - e.m16 - int32_t(e.k);
  // 2^e_scale as a float (>= 2^-149: a float32 subnormal below 2^-126)
  const uint32_t scale_bits = select(e_scale >= -126, uint32_t(max_of(e_scale + 127, 0)) << 23,
                                     1u << min_of(max_of(e_scale + 149, 0), 31));
  const float extra_f = float(int32_t(extra));  // < 2^17
  const uint32_t mag = bit_cast<uint32_t>(bit_cast<float>(a) + extra_f * bit_cast<float>(scale_bits));
  return select(a >= kF32Inf, t, mag | (t & ~kF32Abs));
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
