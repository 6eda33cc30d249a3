// Fills the CPU driver's random-word buffers: blocks block0 .. block0+blocks-1 of lowfp's Philox
// stream, word k of block j at out[4j + k]. The rounds are lowfp::philox4x32_10_rounds from the
// shared header; with AVX-512 or AVX2 it runs on a SIMD word type (one block per 32-bit lane) that
// supplies only mulhilo and ^ (gcc's own vectorisation of the scalar code uses 64-bit multiplies
// and reaches about two thirds of this speed).
#pragma once
#include "lowfp/philox.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace lowfp {
// Internal linkage: each instruction-set build of the kernels gets its own copy (an inline
// function shared across them could be merged into the baseline build by the linker).
namespace {
namespace lanes {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
struct Words { __m512i v; };
inline Words operator^(Words a, Words b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline Words operator^(Words a, uint32_t k) { return {_mm512_xor_si512(a.v, _mm512_set1_epi32(int(k)))}; }
inline void mulhilo(uint32_t m, Words x, Words& hi, Words& lo) {
  // 32x32->64 products of the even lanes, then of the odd lanes shifted down
  const __m512i mm = _mm512_set1_epi64(m);
  const __m512i even = _mm512_mul_epu32(x.v, mm);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(x.v, 32), mm);
  lo.v = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi.v = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}
inline Words counters(uint32_t first) {
  return {_mm512_add_epi32(_mm512_set1_epi32(int(first)),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))};
}
inline Words broadcast(uint32_t v) { return {_mm512_set1_epi32(int(v))}; }
// Lane j of c0..c3 holds block j's words: store them block after block.
inline void store_blocks(uint32_t* out, Words c0, Words c1, Words c2, Words c3) {
  const __m512i a = _mm512_unpacklo_epi32(c0.v, c1.v), b = _mm512_unpackhi_epi32(c0.v, c1.v);
  const __m512i c = _mm512_unpacklo_epi32(c2.v, c3.v), d = _mm512_unpackhi_epi32(c2.v, c3.v);
  // e_k: 128-bit lane q holds block 4q + k
  const __m512i e0 = _mm512_unpacklo_epi64(a, c), e1 = _mm512_unpackhi_epi64(a, c);
  const __m512i e2 = _mm512_unpacklo_epi64(b, d), e3 = _mm512_unpackhi_epi64(b, d);
  const __m512i f0 = _mm512_shuffle_i32x4(e0, e1, 0x44), f1 = _mm512_shuffle_i32x4(e2, e3, 0x44);
  const __m512i f2 = _mm512_shuffle_i32x4(e0, e1, 0xEE), f3 = _mm512_shuffle_i32x4(e2, e3, 0xEE);
  _mm512_storeu_si512(out, _mm512_shuffle_i32x4(f0, f1, 0x88));
  _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(f0, f1, 0xDD));
  _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(f2, f3, 0x88));
  _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(f2, f3, 0xDD));
}
#elif defined(__AVX2__)
constexpr int kLanes = 8;
struct Words { __m256i v; };
inline Words operator^(Words a, Words b) { return {_mm256_xor_si256(a.v, b.v)}; }
inline Words operator^(Words a, uint32_t k) { return {_mm256_xor_si256(a.v, _mm256_set1_epi32(int(k)))}; }
inline void mulhilo(uint32_t m, Words x, Words& hi, Words& lo) {
  const __m256i mm = _mm256_set1_epi64x(m);
  const __m256i even = _mm256_mul_epu32(x.v, mm);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x.v, 32), mm);
  lo.v = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi.v = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
inline Words counters(uint32_t first) {
  return {_mm256_add_epi32(_mm256_set1_epi32(int(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
}
inline Words broadcast(uint32_t v) { return {_mm256_set1_epi32(int(v))}; }
inline void store_blocks(uint32_t* out, Words c0, Words c1, Words c2, Words c3) {
  const __m256i a = _mm256_unpacklo_epi32(c0.v, c1.v), b = _mm256_unpackhi_epi32(c0.v, c1.v);
  const __m256i c = _mm256_unpacklo_epi32(c2.v, c3.v), d = _mm256_unpackhi_epi32(c2.v, c3.v);
  // e_k: 128-bit lane q holds block 4q + k
  const __m256i e0 = _mm256_unpacklo_epi64(a, c), e1 = _mm256_unpackhi_epi64(a, c);
  const __m256i e2 = _mm256_unpacklo_epi64(b, d), e3 = _mm256_unpackhi_epi64(b, d);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(e0, e1, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), _mm256_permute2x128_si256(e2, e3, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm256_permute2x128_si256(e0, e1, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 24), _mm256_permute2x128_si256(e2, e3, 0x31));
}
#else
constexpr int kLanes = 1;  // scalar only
#endif

}  // namespace lanes

inline void philox_fill(uint32_t* out, uint64_t seed, uint64_t block0, int64_t blocks) {
  int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  const uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (; j + lanes::kLanes <= blocks; j += lanes::kLanes) {
    const uint64_t first = block0 + uint64_t(j);
    if (uint32_t(first) > 0xffffffffu - uint32_t(lanes::kLanes - 1)) {
      // the low counter word wraps inside this group: once per 2^32 blocks, done one by one
      for (int l = 0; l < lanes::kLanes; ++l) {
        const Philox4x32Block r = philox_block(seed, first + uint64_t(l));
        for (int k = 0; k < 4; ++k) out[4 * (j + l) + k] = r.w[k];
      }
      continue;
    }
    lanes::Words c0 = lanes::counters(uint32_t(first)), c1 = lanes::broadcast(uint32_t(first >> 32));
    lanes::Words c2 = lanes::broadcast(0), c3 = lanes::broadcast(0);
    philox4x32_10_rounds(c0, c1, c2, c3, k0, k1);
    lanes::store_blocks(out + 4 * j, c0, c1, c2, c3);
  }
#endif
  for (; j < blocks; ++j) {
    const Philox4x32Block r = philox_block(seed, block0 + uint64_t(j));
    out[4 * j + 0] = r.w[0];
    out[4 * j + 1] = r.w[1];
    out[4 * j + 2] = r.w[2];
    out[4 * j + 3] = r.w[3];
  }
}

}  // namespace
}  // namespace lowfp
