// The extra-bits packing of DESIGN §5 on AVX-512BW vectors, for the CPU kernels' tiles: the same
// layout as unpack_one / pack_block of cpp/include/lowfp/extra_bits.hpp, 16 elements at a time.
//
// A 32-element block of q bits per element is 32 q bits; each half (16 elements) is exactly q
// 16-bit words, element e at bit e q of them: in word e q / 16, from bit e q % 16, and with the
// next word in one 32-bit window (e q % 16 + q <= 15 + 17). Unpacking gathers each element's two
// words into a 32-bit lane with one word permute (vpermw), shifts and masks. Packing shifts each
// value to its bit offset (its low and high 16 bits then belong to its first and second word) and
// ORs the halves that share an output word, one word permute per "layer": as many layers as the
// most elements one word receives parts of (2 for q = 8 or 17, 3 for q = 9). Loads and stores are
// masked to the q words of the half block, so nothing outside the packed tensor is touched.
// Replaces 2 to 4 scalar instructions per element with about 5 to 8 per 16.
#pragma once
#include <cstdint>

#if defined(__AVX512BW__)
#include <immintrin.h>

// gcc 12 warns that the pass-through operand (_mm512_undefined_epi32) of the AVX-512 intrinsics
// "may be used uninitialized" once they are inlined into the kernels (gcc bug 105593): it is never
// read, as their masks are all ones.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace lowfp {
namespace {
namespace pack_lanes {

constexpr int kMaxLayers = 16;  // q = 1: one output word holds 16 elements

struct HalfBlockLayout {
  uint16_t window[32];  // unpack: source words of element e's window, at 2e (low) and 2e + 1
  uint32_t shift[16];   // element e's bit offset in its first word
  int layers;
  uint16_t source[kMaxLayers][32];  // pack: layer j's source halfword of the shifted values
  uint32_t present[kMaxLayers];     // bit w: output word w takes a part in layer j
};

constexpr HalfBlockLayout make_layout(uint32_t q) {
  HalfBlockLayout l{};
  int parts[32] = {};
  auto add = [&](uint32_t word, uint16_t halfword) {
    const int j = parts[word]++;
    l.source[j][word] = halfword;
    l.present[j] |= 1u << word;
  };
  for (uint32_t e = 0; e < 16; ++e) {
    const uint32_t word = e * q / 16, shift = e * q % 16;
    l.window[2 * e] = uint16_t(word);
    l.window[2 * e + 1] = uint16_t(word + 1);  // <= q < 32; masked to zero past the half block
    l.shift[e] = shift;
    add(word, uint16_t(2 * e));                              // low 16 bits of value << shift
    if (shift + q > 16) add(word + 1, uint16_t(2 * e + 1));  // its high 16 bits
  }
  for (int w = 0; w < 32; ++w) l.layers = parts[w] > l.layers ? parts[w] : l.layers;
  return l;
}

template <uint32_t Q>
struct Layout {
  static constexpr HalfBlockLayout value = make_layout(Q);
  static_assert(value.layers <= kMaxLayers);
};

constexpr __mmask32 half_block_words(uint32_t q) { return __mmask32((1ull << q) - 1); }

// values[0..32 blocks) from blocks of Q words each.
template <uint32_t Q>
inline void unpack_blocks(const uint32_t* words, int64_t blocks, uint32_t* values) {
  constexpr const HalfBlockLayout& L = Layout<Q>::value;
  const __m512i window = _mm512_loadu_si512(L.window);
  const __m512i shift = _mm512_loadu_si512(L.shift);
  const __m512i mask = _mm512_set1_epi32(int((1u << Q) - 1));
  const uint16_t* half = reinterpret_cast<const uint16_t*>(words);
  for (int64_t h = 0; h < 2 * blocks; ++h, half += Q) {
    const __m512i src = _mm512_maskz_loadu_epi16(half_block_words(Q), half);
    const __m512i win = _mm512_permutexvar_epi16(window, src);
    _mm512_storeu_si512(values + 16 * h, _mm512_and_si512(_mm512_srlv_epi32(win, shift), mask));
  }
}

// blocks of Q words each from values (each < 2^Q).
template <uint32_t Q>
inline void pack_blocks(const uint32_t* values, int64_t blocks, uint32_t* words) {
  constexpr const HalfBlockLayout& L = Layout<Q>::value;
  const __m512i shift = _mm512_loadu_si512(L.shift);
  __m512i source[kMaxLayers];
  for (int j = 0; j < L.layers; ++j) source[j] = _mm512_loadu_si512(L.source[j]);
  uint16_t* half = reinterpret_cast<uint16_t*>(words);
  for (int64_t h = 0; h < 2 * blocks; ++h, half += Q) {
    const __m512i shifted = _mm512_sllv_epi32(_mm512_loadu_si512(values + 16 * h), shift);
    __m512i out = _mm512_maskz_permutexvar_epi16(L.present[0], source[0], shifted);
    for (int j = 1; j < L.layers; ++j)
      out = _mm512_or_si512(out, _mm512_maskz_permutexvar_epi16(L.present[j], source[j], shifted));
    _mm512_mask_storeu_epi16(half, half_block_words(Q), out);
  }
}

}  // namespace pack_lanes
}  // namespace
}  // namespace lowfp

#pragma GCC diagnostic pop
#endif
