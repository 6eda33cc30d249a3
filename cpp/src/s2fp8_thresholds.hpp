// Building the threshold form of an S2FP8 call's element transform (see S2fp8Thresholds).
#pragma once
#include <vector>

#include "quantize_cpu.hpp"

namespace lowfp {

// Fills t (its arrays in storage) for call with statistics s; false when the call has no
// threshold form (float64 x, stochastic rounding, a format finer than 4096 grid points, more
// than 2^16 buckets) or is too small to pay for building it: the float64 path then runs.
bool s2fp8_build_thresholds(const S2fp8Call& call, const S2fp8Stats& s, S2fp8Thresholds& t,
                            std::vector<uint32_t>& storage);

}  // namespace lowfp
