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

LOWFP_HD void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0,
                           uint32_t k1) {
  const uint64_t p0 = uint64_t(0xD2511F53u) * c0;
  const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
  const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
  const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
  c0 = hi1 ^ c1 ^ k0;
  c1 = lo1;
  c2 = hi0 ^ c3 ^ k1;
  c3 = lo0;
}

// The general 128-bit-counter form (used by the known-answer tests).
LOWFP_HD Philox4x32Block philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                       uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    philox_round(c0, c1, c2, c3, k0, k1);
  }
  return Philox4x32Block{{c0, c1, c2, c3}};
}

LOWFP_HD Philox4x32Block philox_block(uint64_t seed, uint64_t block) {
  return philox4x32_10(uint32_t(block), uint32_t(block >> 32), 0u, 0u, uint32_t(seed),
                       uint32_t(seed >> 32));
}

}  // namespace lowfp
