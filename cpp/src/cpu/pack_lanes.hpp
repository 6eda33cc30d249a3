// The extra-bits packing of docs/design.md §5 on vectors, for the CPU kernels' tiles: the same layout as
// unpack_one / pack_block of cpp/include/lowfp/extra_bits.hpp, one instance per q (Q).
//
// AVX-512BW, 16 elements at a time. A 32-element block of q bits per element is 32 q bits; each
// half (16 elements) is exactly q 16-bit words, element e at bit e q of them: in word e q / 16,
// from bit e q % 16, and with the next word in one 32-bit window (e q % 16 + q <= 15 + 17).
// Unpacking gathers each element's two words into a 32-bit lane with one word permute (vpermw),
// shifts and masks. Packing shifts each value to its bit offset (its low and high 16 bits then
// belong to its first and second word) and ORs the halves that share an output word, one word
// permute per "layer": as many layers as the most elements one word receives parts of (2 for
// q = 8 or 17, 3 for q = 9). Loads and stores are masked to the q words of the half block, so
// nothing outside the packed tensor is touched. Replaces 2 to 4 scalar instructions per element
// with about 5 to 8 per 16.
//
// AVX2, 8 elements at a time: a group of 8 is exactly q bytes, and AVX2 has no word permute across
// 128-bit lanes, so each 128-bit half h (0 or 1) handles 4 elements, whose 4 q bits start at byte
// floor(q / 2) h of the group, at bit s_h of that byte (s_1 = 4 for odd q, else 0). Element e of a
// half then lies in the 4 bytes from byte floor((s_h + e q) / 8) of the half's bytes, from bit
// (s_h + e q) % 8 (7 + 17 bits at most): unpacking loads each half's 16 bytes, gathers every
// element's 4 bytes with a byte shuffle (vpshufb), shifts and masks. Packing shifts each value to
// that bit offset, moves its 3 bytes to their place in the half's bytes by byte shuffles ORed in
// layers (at most 4: one byte takes parts of 4 elements for q = 2), and ORs the upper half into
// the lower one shifted by floor(q / 2) bytes. Both read or write 16 bytes from a group's start
// (17 for q = 17), past its q bytes, so they stop before the last blocks of a tile, whose access
// would leave the tile, and return how many blocks they did: the caller's scalar code does the
// rest.
#pragma once
#include <cstdint>

#if defined(__AVX2__)  // (AVX-512BW too)
#include <immintrin.h>

#if defined(__AVX512BW__)
// gcc 12 warns that the pass-through operand (_mm512_undefined_epi32) of the AVX-512 intrinsics
// "may be used uninitialized" once they are inlined into the kernels (gcc bug 105593): it is never
// read, as their masks are all ones.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lowfp {
namespace {
namespace pack_lanes {

#if defined(__AVX512BW__)
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
#else
constexpr int kMaxLayers = 4;  // q = 2: one byte holds 4 elements of a half

struct GroupLayout {
  uint8_t window[32];  // unpack: byte shuffle of element e's 4 bytes into lane e (per half)
  uint32_t shift[8];   // element e's bit offset in its first byte
  int layers;
  uint8_t source[kMaxLayers][32];  // pack: layer j's source byte of each byte (0x80: none)
};

constexpr GroupLayout make_layout(uint32_t q) {
  GroupLayout l{};
  for (auto& layer : l.source)
    for (auto& b : layer) b = 0x80;  // the byte shuffle writes zero
  for (uint32_t h = 0; h < 2; ++h) {
    int parts[16] = {};
    const uint32_t start = h == 1 ? 4 * q - 8 * (q / 2) : 0;  // s_h
    for (uint32_t e = 0; e < 4; ++e) {
      const uint32_t bit = start + e * q, byte = bit / 8, lane = 4 * h + e;
      l.shift[lane] = bit % 8;
      for (uint32_t c = 0; c < 4; ++c) l.window[16 * h + 4 * e + c] = uint8_t(byte + c);
      // the shifted value's bits [bit % 8, bit % 8 + q) are in its bytes 0 to 2
      for (uint32_t c = 0; c < 3 && 8 * c < bit % 8 + q; ++c) {
        const int j = parts[byte + c]++;
        l.source[j][16 * h + byte + c] = uint8_t(4 * e + c);
      }
    }
    for (int b = 0; b < 16; ++b) l.layers = parts[b] > l.layers ? parts[b] : l.layers;
  }
  return l;
}
#endif

template <uint32_t Q>
struct Layout {
  static constexpr auto value = make_layout(Q);
  static_assert(value.layers <= kMaxLayers);
};

#if defined(__AVX512BW__)
constexpr __mmask32 half_block_words(uint32_t q) { return __mmask32((1ull << q) - 1); }

// values[0..32 blocks) from blocks of Q words each; returns the blocks done (all of them).
template <uint32_t Q>
inline int64_t unpack_blocks(const uint32_t* words, int64_t blocks, uint32_t* values) {
  constexpr const auto& L = Layout<Q>::value;
  const __m512i window = _mm512_loadu_si512(L.window);
  const __m512i shift = _mm512_loadu_si512(L.shift);
  const __m512i mask = _mm512_set1_epi32(int((1u << Q) - 1));
  const uint16_t* half = reinterpret_cast<const uint16_t*>(words);
  for (int64_t h = 0; h < 2 * blocks; ++h, half += Q) {
    const __m512i src = _mm512_maskz_loadu_epi16(half_block_words(Q), half);
    const __m512i win = _mm512_permutexvar_epi16(window, src);
    _mm512_storeu_si512(values + 16 * h, _mm512_and_si512(_mm512_srlv_epi32(win, shift), mask));
  }
  return blocks;
}

// blocks of Q words each from values (each < 2^Q); returns the blocks done (all of them).
template <uint32_t Q>
inline int64_t pack_blocks(const uint32_t* values, int64_t blocks, uint32_t* words) {
  constexpr const auto& L = Layout<Q>::value;
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
  return blocks;
}
#else
// The last blocks of a tile of `blocks` that the vector code must leave to the scalar code: a
// group's loads reach floor(q / 2) + 16 bytes past its start, its store 16 (+ 1 byte for q = 17).
// The last group of block b starts at byte (4 b + 3) q, so `reach` bytes from it stay in the
// tile's 4 q blocks bytes for b < blocks - ceil((reach - q) / 4 q).
template <uint32_t Q>
constexpr int64_t scalar_blocks(int64_t reach, int64_t blocks) {
  const int64_t over = reach - int64_t(Q);  // bytes past the end of the group's block
  const int64_t tail = over <= 0 ? 0 : (over + 4 * Q - 1) / (4 * Q);
  return tail < blocks ? tail : blocks;
}

// values[0..32 b) from the first b blocks of Q words each; returns b (see scalar_blocks).
template <uint32_t Q>
inline int64_t unpack_blocks(const uint32_t* words, int64_t blocks, uint32_t* values) {
  constexpr const auto& L = Layout<Q>::value;
  const __m256i window = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.window));
  const __m256i shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.shift));
  const __m256i mask = _mm256_set1_epi32(int((1u << Q) - 1));
  const int64_t vector_blocks = blocks - scalar_blocks<Q>(Q / 2 + 16, blocks);
  const uint8_t* group = reinterpret_cast<const uint8_t*>(words);
  for (int64_t g = 0; g < 4 * vector_blocks; ++g, group += Q) {
    const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
    const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + Q / 2));
    const __m256i src = _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
    const __m256i win = _mm256_shuffle_epi8(src, window);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + 8 * g),
                        _mm256_and_si256(_mm256_srlv_epi32(win, shift), mask));
  }
  return vector_blocks;
}

// The first b blocks of Q words each from values (each < 2^Q); returns b (see scalar_blocks).
template <uint32_t Q>
inline int64_t pack_blocks(const uint32_t* values, int64_t blocks, uint32_t* words) {
  constexpr const auto& L = Layout<Q>::value;
  const __m256i shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.shift));
  __m256i source[kMaxLayers];
  for (int j = 0; j < L.layers; ++j)
    source[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.source[j]));
  const int64_t vector_blocks = blocks - scalar_blocks<Q>(Q > 16 ? 17 : 16, blocks);
  uint8_t* group = reinterpret_cast<uint8_t*>(words);
  for (int64_t g = 0; g < 4 * vector_blocks; ++g, group += Q) {
    const __m256i shifted = _mm256_sllv_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 8 * g)), shift);
    __m256i halves = _mm256_shuffle_epi8(shifted, source[0]);
    for (int j = 1; j < L.layers; ++j)
      halves = _mm256_or_si256(halves, _mm256_shuffle_epi8(shifted, source[j]));
    const __m128i high = _mm256_extracti128_si256(halves, 1);
    const __m128i out = _mm_or_si128(_mm256_castsi256_si128(halves), _mm_bslli_si128(high, Q / 2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(group), out);
    if constexpr (Q > 16) group[16] = uint8_t(_mm_extract_epi8(high, 16 - Q / 2));
  }
  return vector_blocks;
}
#endif

}  // namespace pack_lanes
}  // namespace
}  // namespace lowfp

#if defined(__AVX512BW__)
#pragma GCC diagnostic pop
#endif
#endif
