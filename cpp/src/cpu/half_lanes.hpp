// float16 tiles to and from float32 for the CPU drivers. With F16C (the avx2 and avx512 kernels)
// vcvtph2ps / vcvtps2ph convert 8 elements an instruction; gcc 12 does not vectorise _Float16
// conversions and vectorises the portable formulas of lowfp/half.hpp step by step (more than a
// dozen operations an element each way). The results are the formulas' bits for every input the
// drivers pass: the hardware quiets a signalling NaN when widening and keeps a NaN's payload when
// narrowing, so NaN lanes are patched to the formulas' patterns (the payload kept and not quieted;
// the canonical sign | 0x7e00). Narrowing is only asked of values float16 holds. (The vector
// types may alias any type; the scalar tails go through bit_cast.)
#pragma once
#include <type_traits>

#include "lowfp/half.hpp"
#include "lowfp/storage.hpp"

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

// gcc 12 warns that a caller's tile "may be used uninitialized" when these are inlined: the
// caller writes elements [0, n) before asking for them, which gcc does not follow.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace lowfp {
namespace {  // internal linkage: one copy per instruction-set build

#if defined(__F16C__) && defined(__AVX2__)
constexpr bool kHardwareHalf = true;

// F: float, or uint32_t for a tile of float32 bits.
template <class F>
inline void half_tile_to_float(const Half* h, F* f, int64_t n) {
  int64_t i = 0;
  const __m256i abs_mask = _mm256_set1_epi32(0x7fff), inf = _mm256_set1_epi32(0x7c00);
  for (; i + 8 <= n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
    const __m256i hw = _mm256_castps_si256(_mm256_cvtph_ps(raw));
    const __m256i h32 = _mm256_cvtepu16_epi32(raw);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(h32, abs_mask), inf);
    // half_to_float_bits of a NaN: sign, float32's all-ones exponent, the payload shifted up
    const __m256i kept = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x8000)), 16),
        _mm256_or_si256(_mm256_set1_epi32(0x7f800000),
                        _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x3ff)), 13)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(f + i), _mm256_blendv_epi8(hw, kept, nan));
  }
  for (; i < n; ++i) f[i] = bit_cast<F>(half_to_float_bits(h[i].v));
}

template <class F>
inline void float_tile_to_half(const F* f, Half* h, int64_t n) {
  int64_t i = 0;
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + i));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf);
    // a NaN becomes float_bits_to_half's sign | 0x7e00: its sign with a quiet NaN of no payload
    const __m256i canonical = _mm256_or_si256(_mm256_andnot_si256(abs_mask, bits),
                                              _mm256_set1_epi32(0x7fc00000));
    const __m256 v = _mm256_castsi256_ps(_mm256_blendv_epi8(bits, canonical, nan));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) h[i].v = float_bits_to_half(bit_cast<uint32_t>(f[i]));
}
#else
constexpr bool kHardwareHalf = false;
#endif

// Whether the drivers move tiles of T through the F16C conversions above (float16 with F16C).
template <class T>
constexpr bool kF16cTiles = kHardwareHalf && std::is_same_v<T, Half>;

// A tile of x as the loops read it: float16 widened into `buffer` (Src = float) where F16C is
// used, any other type the tile itself (Src = In).
template <class In, class Src>
inline const Src* readable_tile(const In* tile, int64_t n, Src* buffer) {
  if constexpr (std::is_same_v<In, Src>) {
    return tile;
  } else {
    half_tile_to_float(tile, buffer, n);
    return buffer;
  }
}

}  // namespace
}  // namespace lowfp
#pragma GCC diagnostic pop
