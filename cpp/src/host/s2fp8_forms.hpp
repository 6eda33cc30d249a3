// The per-call forms of an S2FP8 call's element transform, built on the host once the statistics
// are known (s2fp8_thresholds.cpp, s2fp8_stochastic.cpp) and read by the CPU and CUDA kernels.
#pragma once
#include <cstdint>

#include "lowfp/s2fp8.hpp"
#include "lowfp/s2fp8_stochastic.hpp"
#include "quantize_call.hpp"

namespace lowfp {

// The threshold form of an S2FP8 call's element transform (s2fp8_thresholds.cpp), for float32
// and 16-bit x in the deterministic modes: x' depends on |x| only through which of a few hundred
// intervals of x's magnitude bits it falls in, so the CPU looks it up instead of evaluating the
// logarithms per element. Built per call once the statistics are known; index 0 of the per-sign
// arrays is for positive x, 1 for negative.
struct S2fp8Thresholds {
  // Magnitude bits a are first raised to base (below it x' does not change: base lies below
  // every threshold and is a multiple of 2^shift). Bucket (a - base) >> shift of sign s, clamped
  // to buckets - 1, is entry s * sign_entries + bucket: (v << shift) | t, where v indexes values
  // and t is the low bits of the bucket's one threshold (0 when it has none):
  // x' = values[v - ((a & low) < t)] | (x & mirror_sign) with low = 2^shift - 1.
  const uint32_t* entries = nullptr;
  const uint32_t* values = nullptr;  // x' as raw bits of x's dtype, both signs unless mirrored
  uint32_t n_values = 0;
  uint32_t base = 0, shift = 0, buckets = 0;
  // Mirrored (x' of -x is -(x' of x) and the event ranges are the same for both signs, as in
  // every mode but up and down): the negative sign has no entries or values of its own
  // (sign_entries = 0) and takes x's sign bit (mirror_sign, the sign bit of x's dtype); halving
  // the table keeps the CPU's lookup of values in fewer registers, and the CPU loops drop their
  // per-sign terms. Else sign_entries = buckets and mirror_sign = 0.
  uint32_t sign_entries = 0, mirror_sign = 0;
  // The steps for magnitude bits a, sign neg (0 or 1) and x's bits xb, shared by the CPU and GPU
  // kernels.
  LOWFP_HD uint32_t raised(uint32_t a) const { return max_of(a, base); }
  LOWFP_HD uint32_t entry_index(uint32_t a_raised, uint32_t neg) const {
    return min_of((a_raised - base) >> shift, buckets - 1) + ((uint32_t(0) - neg) & sign_entries);
  }
  LOWFP_HD uint32_t value_index(uint32_t a_raised, uint32_t entry) const {
    const uint32_t low = (uint32_t(1) << shift) - 1;  // shift < 32, so both below 2^31:
    // compared as signed integers, which AVX2 does in one instruction (unsigned takes two)
    return (entry >> shift) - uint32_t(int32_t(a_raised & low) < int32_t(entry & low));
  }
  LOWFP_HD uint32_t signed_value(uint32_t value, uint32_t xb) const {
    return value | (xb & mirror_sign);
  }
  // Events as ranges of magnitude bits a: underflow for under_lo <= a < under_hi, above max (or
  // NaN) for a >= above.
  uint32_t under_lo[2] = {0, 0}, under_hi[2] = {0, 0}, above[2] = {0, 0};
};

// The fast form of stochastic S2FP8 (lowfp/s2fp8_stochastic.hpp) for float32 and 16-bit x:
// constants and x' per grid index as raw bits of x's dtype (per_sign + sign_offset entries).
// Built per call by s2fp8_build_stochastic.
struct S2fp8StochasticForm {
  S2fp8FastStochastic k{};
  const uint32_t* values = nullptr;
};

// The per-call forms an S2FP8 transform may take (null: not built); the float64 path otherwise.
struct S2fp8Forms {
  const S2fp8Thresholds* thresholds = nullptr;
  const S2fp8StochasticForm* stochastic = nullptr;
};

// The bits of +inf and of the sign in each 16- or 32-bit storage type.
template <class T> constexpr uint32_t kInfRaw = 0;
template <> constexpr uint32_t kInfRaw<Half> = 0x7C00;
template <> constexpr uint32_t kInfRaw<BFloat> = 0x7F80;
template <> constexpr uint32_t kInfRaw<float> = 0x7F800000u;
template <class T> constexpr uint32_t kSignRaw = uint32_t(1) << (8 * sizeof(T) - 1);

}  // namespace lowfp
