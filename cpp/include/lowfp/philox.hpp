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

}  // namespace lowfp
