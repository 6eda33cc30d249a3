// What one CUDA thread holds, written for nvcc and for the host compiler (so that the CPU
// stand-ins of tests/cpp/ hold the same): its event counts, and groups of four elements.
#pragma once
#include <cstdint>

#include "lowfp/round.hpp"

namespace lowfp {

// A thread's events, reduced per warp at the end of a kernel (common.cuh's flush_counts).
struct ThreadCounts {
  uint32_t overflow = 0, underflow = 0, nan = 0;
  LOWFP_HD void add(const RoundEvents& ev) {
    overflow += ev.overflow();
    underflow += ev.underflow;
    nan += ev.nan;
  }
};

// Four consecutive elements, loaded or stored with one vector access (16 bytes for float32 in and
// out; two accesses for float64). Four because a Philox block holds four random words.
template <class T> struct alignas(4 * sizeof(T) > 16 ? 16 : 4 * sizeof(T)) Quad { T v[4]; };

}  // namespace lowfp
