// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
// lowfp's stream: element i of a call with (seed, offset) takes output word i % 4 of the block
// with counter (offset + i / 4) as 128 bits {lo32, hi32, 0, 0} and key {lo32(seed), hi32(seed)}.
// A result therefore depends on (seed, offset, i) only: not on threads, chunking or device.
#pragma once
#include "config.hpp"

namespace lowfp {

struct Philox4x32Block {
  uint32_t w[4];
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;  // Weyl key increments

// hi:lo = m * x for 32-bit words.
LOWFP_HD void mulhilo(uint32_t m, uint32_t x, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = uint64_t(m) * x;
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

// The ten rounds, written once for any word type W: uint32_t here and on the GPU, or a SIMD type
// of 32-bit lanes in the CPU driver (one block per lane), which supplies mulhilo and operator^.
template <class W>
LOWFP_HD void philox4x32_10_rounds(W& c0, W& c1, W& c2, W& c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    W hi0{}, lo0{}, hi1{}, lo1{};  // (initialised: gcc warns on SIMD word types otherwise)
    mulhilo(kPhiloxM0, c0, hi0, lo0);
    mulhilo(kPhiloxM1, c2, hi1, lo1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
}

// The general 128-bit-counter form (used by the known-answer tests).
LOWFP_HD Philox4x32Block philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                       uint32_t key0, uint32_t key1) {
  philox4x32_10_rounds(c0, c1, c2, c3, key0, key1);
  return Philox4x32Block{{c0, c1, c2, c3}};
}

LOWFP_HD Philox4x32Block philox_block(uint64_t seed, uint64_t block) {
  return philox4x32_10(uint32_t(block), uint32_t(block >> 32), 0u, 0u, uint32_t(seed),
                       uint32_t(seed >> 32));
}

// Internal linkage from here on: each file compiled for an instruction-set level (and CUDA) keeps
// its own copy of the lane loops, where the linker would otherwise keep one of them for all.
namespace {

// kLanes Philox words side by side, each in the low half of a 64-bit lane: a word type for
// philox4x32_10_rounds whose lane loops the CPU's compiler turns into vector instructions (a
// 32x32->64 multiply per 64-bit lane; 32-bit lanes take shuffles around each multiply).
template <int kLanes>
struct PhiloxLanes {
  uint64_t v[kLanes];
  // (user-provided: the rounds' `W hi{}` then leaves the lanes for mulhilo to write rather than
  // zeroing kLanes words first, each round)
  LOWFP_HD PhiloxLanes() {}
};

template <int kLanes>
LOWFP_HD void mulhilo(uint32_t m, const PhiloxLanes<kLanes>& x, PhiloxLanes<kLanes>& hi, PhiloxLanes<kLanes>& lo) {
  for (int l = 0; l < kLanes; ++l) {
    const uint64_t p = uint64_t(m) * (x.v[l] & 0xffffffffu);
    hi.v[l] = p >> 32;
    lo.v[l] = p & 0xffffffffu;
  }
}
template <int kLanes>
LOWFP_HD PhiloxLanes<kLanes> operator^(PhiloxLanes<kLanes> a, const PhiloxLanes<kLanes>& b) {
  for (int l = 0; l < kLanes; ++l) a.v[l] ^= b.v[l];
  return a;
}
template <int kLanes>
LOWFP_HD PhiloxLanes<kLanes> operator^(PhiloxLanes<kLanes> a, uint32_t k) {
  for (int l = 0; l < kLanes; ++l) a.v[l] ^= k;
  return a;
}

// Blocks block[l] of the stream under key seed, lane by lane: word k of block[l] into w[k][l].
// Groups of kGroup lanes run the ten rounds in turn: few enough that a group's words stay in
// vector registers, two vectors of them so that two chains of multiplies overlap.
template <int kLanes>
LOWFP_HD void philox_blocks(uint64_t seed, const uint64_t (&block)[kLanes], uint32_t (&w)[4][kLanes]) {
  if constexpr (kLanes == 1) {  // (one GPU thread: 32-bit words)
    const Philox4x32Block r = philox_block(seed, block[0]);
    for (int k = 0; k < 4; ++k) w[k][0] = r.w[k];
  } else {
    constexpr int kGroup = kLanes % 16 == 0 ? 16 : kLanes;
    for (int g = 0; g < kLanes; g += kGroup) {
      PhiloxLanes<kGroup> c0, c1, c2, c3;
      for (int l = 0; l < kGroup; ++l) {
        c0.v[l] = block[g + l] & 0xffffffffu;
        c1.v[l] = block[g + l] >> 32;
        c2.v[l] = c3.v[l] = 0;
      }
      philox4x32_10_rounds(c0, c1, c2, c3, uint32_t(seed), uint32_t(seed >> 32));
      for (int l = 0; l < kGroup; ++l) {
        w[0][g + l] = uint32_t(c0.v[l]);
        w[1][g + l] = uint32_t(c1.v[l]);
        w[2][g + l] = uint32_t(c2.v[l]);
        w[3][g + l] = uint32_t(c3.v[l]);
      }
    }
  }
}

}  // namespace
}  // namespace lowfp
