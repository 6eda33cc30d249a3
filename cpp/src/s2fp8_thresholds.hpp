// Building the threshold form of an S2FP8 call's element transform (see S2fp8Thresholds).
#pragma once
#include <vector>

#include "quantize_cpu.hpp"

namespace lowfp {

// Whether the call may take the threshold form at all: a deterministic mode, 16- or 32-bit x,
// and LOWFP_S2FP8_FLOAT64 not set to 1 (which keeps every element on the float64 path; tests
// compare the two). Checked before waiting for statistics that would then go unused.
bool s2fp8_threshold_form_allowed(const S2fp8Call& call);

// Fills t (its arrays in storage) for call with statistics s; false when the call has no
// threshold form (not allowed above, a format finer than 4096 grid points, more than 2^16
// buckets) or is too small to pay for building it: the float64 path then runs.
bool s2fp8_build_thresholds(const S2fp8Call& call, const S2fp8Stats& s, S2fp8Thresholds& t,
                            std::vector<uint32_t>& storage);

}  // namespace lowfp
