// Fills the CPU driver's random-word buffers: blocks block0 .. block0+blocks-1 of lowfp's Philox
// stream, word k of block j at out[4j + k]. The rounds are lowfp::philox4x32_10_rounds from the
// shared header; with AVX-512 or AVX2 it runs on a SIMD word type that supplies only mulhilo and ^.
// One block per 64-bit lane, its word in the lane's low half: the lane's 32x32->64 multiply
// (vpmuludq) then gives lo and hi at once, with no shuffles between rounds. The high halves carry
// garbage that nothing reads (the multiply ignores them, the store drops them). Several vectors
// per group (kRegs), so that independent chains of rounds fill the multiplier's latency. This
// measured faster than one block per 32-bit lane (two multiplies, shifts and blends per mulhilo)
// with AVX-512 and with AVX2 (bench/RESULTS.md).
#pragma once
#include <cstring>

#include "lowfp/philox.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// gcc 12 warns that the pass-through operand (_mm512_undefined_epi32) of the AVX-512 intrinsics
// "may be used" or "is used uninitialized" once they are inlined into these loops (gcc bug
// 105593): it is never read, as their masks are all ones.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace lowfp {
// Internal linkage: each instruction-set build of the kernels gets its own copy (an inline
// function shared across them could be merged into the baseline build by the linker).
namespace {
namespace lanes {

// Per instruction set: the vector, its multiply (32x32->64 in each 64-bit lane) and the store of
// a register's blocks once each lane holds its block's words 0-1 (w01) and 2-3 (w23) as 64 bits.
#if defined(__AVX512F__)
using Vec = __m512i;
constexpr int kVecBlocks = 8;
inline Vec mul_lo32(Vec x, Vec m) { return _mm512_mul_epu32(x, m); }
// Each 64-bit lane's low word, stored as kVecBlocks consecutive 32-bit words.
inline void store_low_words(uint32_t* out, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi64_epi32(v));
}
inline void store_vec_blocks(uint32_t* out, Vec w01, Vec w23) {
  _mm512_storeu_si512(out, _mm512_permutex2var_epi64(w01, _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), w23));
  _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi64(w01, _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15), w23));
}
#elif defined(__AVX2__)
using Vec = __m256i;
constexpr int kVecBlocks = 4;
inline Vec mul_lo32(Vec x, Vec m) { return _mm256_mul_epu32(x, m); }
inline void store_low_words(uint32_t* out, Vec v) {
  const Vec low = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(low));
}
inline void store_vec_blocks(uint32_t* out, Vec w01, Vec w23) {
  // 128-bit lane q of lo: block 2q (words 0-3); of hi: block 2q + 1
  const Vec lo = _mm256_unpacklo_epi64(w01, w23), hi = _mm256_unpackhi_epi64(w01, w23);
  _mm256_storeu_si256(reinterpret_cast<Vec*>(out), _mm256_permute2x128_si256(lo, hi, 0x20));
  _mm256_storeu_si256(reinterpret_cast<Vec*>(out + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// The rest as GNU vector operations on 64-bit lanes (gcc 12's _mm512_set1_epi64 and shift
// intrinsics also trip the warning above).
typedef uint64_t U64 __attribute__((vector_size(sizeof(Vec))));
inline Vec splat(uint64_t v) { return Vec(U64{} + v); }

// Independent vectors per group: the rounds are a chain of dependent multiplies, which one vector
// alone leaves idle. With AVX2's 16 registers 3 measured fastest (4 spill); AVX-512 keeps 2.
#if defined(__AVX512F__)
constexpr int kRegs = 2;
#else
constexpr int kRegs = 3;
#endif
constexpr int kLanes = kVecBlocks * kRegs;
template <int kR>
struct WordsOf { Vec v[kR]; };
using Words = WordsOf<kRegs>;
template <int kR>
inline WordsOf<kR> operator^(WordsOf<kR> a, WordsOf<kR> b) {
  for (int r = 0; r < kR; ++r) a.v[r] = Vec(U64(a.v[r]) ^ U64(b.v[r]));
  return a;
}
template <int kR>
inline WordsOf<kR> operator^(WordsOf<kR> a, uint32_t k) {
  for (int r = 0; r < kR; ++r) a.v[r] = Vec(U64(a.v[r]) ^ U64(splat(k)));
  return a;
}
template <int kR>
inline void mulhilo(uint32_t m, WordsOf<kR> x, WordsOf<kR>& hi, WordsOf<kR>& lo) {
  for (int r = 0; r < kR; ++r) {
    lo.v[r] = mul_lo32(x.v[r], splat(m));
    hi.v[r] = Vec(U64(lo.v[r]) >> 32);
  }
}
// Block counters first, first + 1, ...: lane j of register r holds block kVecBlocks r + j.
inline Words counters(uint32_t first) {
  U64 lane{};
  for (int j = 0; j < kVecBlocks; ++j) lane[j] = uint64_t(j);
  Words w{};
  for (int r = 0; r < kRegs; ++r) w.v[r] = Vec(lane + uint64_t(first + uint32_t(kVecBlocks * r)));
  return w;
}
inline Words broadcast(uint32_t v) {
  Words w{};
  for (int r = 0; r < kRegs; ++r) w.v[r] = splat(v);
  return w;
}
inline void store_blocks(uint32_t* out, Words c0, Words c1, Words c2, Words c3) {
  const U64 low = U64{} + 0xffffffffu;
  for (int r = 0; r < kRegs; ++r)
    store_vec_blocks(out + 4 * kVecBlocks * r, Vec((U64(c0.v[r]) & low) | (U64(c1.v[r]) << 32)),
                     Vec((U64(c2.v[r]) & low) | (U64(c3.v[r]) << 32)));
}
// Vectors per group of philox_blocks_at: 4 measured fastest with AVX-512's 32 registers.
#if defined(__AVX512F__)
constexpr int kCounterRegs = 4;
#else
constexpr int kCounterRegs = 2;
#endif
#else
constexpr int kLanes = 1;  // scalar only
#endif

}  // namespace lanes

// Blocks block[l] of the stream under key seed, for any counters (philox.hpp's philox_blocks):
// word k of block[l] into w[k][l]. Each block in a 64-bit lane as philox_fill's; groups of
// vectors whose chains of rounds overlap.
template <int kN>
inline void philox_blocks_at(uint64_t seed, const uint64_t (&block)[kN], uint32_t (&w)[4][kN]) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (kN % lanes::kVecBlocks == 0) {
    constexpr int kVecs = kN / lanes::kVecBlocks;
    constexpr int kR = kVecs % lanes::kCounterRegs == 0 ? lanes::kCounterRegs : kVecs % 2 == 0 ? 2 : 1;
    constexpr int kGroup = kR * lanes::kVecBlocks;
    for (int g = 0; g < kN; g += kGroup) {
      // (the lanes' high halves carry what the multiply ignores and the stores drop: c0 holds the
      // whole counter, c1 its high word)
      lanes::WordsOf<kR> c0{}, c1{}, c2{}, c3{};
      for (int r = 0; r < kR; ++r) {
        lanes::Vec b;
        std::memcpy(&b, block + g + r * lanes::kVecBlocks, sizeof(b));
        c0.v[r] = b;
        c1.v[r] = lanes::Vec(lanes::U64(b) >> 32);
        c2.v[r] = c3.v[r] = lanes::splat(0);
      }
      philox4x32_10_rounds(c0, c1, c2, c3, uint32_t(seed), uint32_t(seed >> 32));
      for (int r = 0; r < kR; ++r) {
        const int at = g + r * lanes::kVecBlocks;
        lanes::store_low_words(w[0] + at, c0.v[r]);
        lanes::store_low_words(w[1] + at, c1.v[r]);
        lanes::store_low_words(w[2] + at, c2.v[r]);
        lanes::store_low_words(w[3] + at, c3.v[r]);
      }
    }
    return;
  }
#endif
  philox_blocks(seed, block, w);
}

// Philox words for blocks [block0, block0 + blocks) into out (4 per block). between(k) is called
// after the k-th group of vector lanes (a hook for work to overlap with the arithmetic).
struct NoHook {
  void operator()(int64_t) const {}
};
template <class Hook = NoHook>
inline void philox_fill(uint32_t* out, uint64_t seed, uint64_t block0, int64_t blocks,
                        [[maybe_unused]] const Hook& between = Hook{}) {
  int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  const uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (; j < blocks; j += lanes::kLanes) {
    const uint64_t first = block0 + uint64_t(j);
    // A last group that runs past `blocks` is computed whole into `spare`, its blocks copied.
    const bool whole = j + lanes::kLanes <= blocks;
    alignas(64) uint32_t spare[4 * lanes::kLanes];
    uint32_t* dst = whole ? out + 4 * j : spare;
    if (uint32_t(first) > 0xffffffffu - uint32_t(lanes::kLanes - 1)) {
      // the low counter word wraps inside this group: once per 2^32 blocks, done one by one
      for (int l = 0; l < lanes::kLanes; ++l) {
        const Philox4x32Block r = philox_block(seed, first + uint64_t(l));
        for (int k = 0; k < 4; ++k) dst[4 * l + k] = r.w[k];
      }
    } else {
      lanes::Words c0 = lanes::counters(uint32_t(first));
      lanes::Words c1 = lanes::broadcast(uint32_t(first >> 32));
      lanes::Words c2 = lanes::broadcast(0), c3 = lanes::broadcast(0);
      philox4x32_10_rounds(c0, c1, c2, c3, k0, k1);
      lanes::store_blocks(dst, c0, c1, c2, c3);
    }
    if (!whole) std::memcpy(out + 4 * j, spare, sizeof(uint32_t) * 4 * size_t(blocks - j));
    between(j / lanes::kLanes);
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
#pragma GCC diagnostic pop
