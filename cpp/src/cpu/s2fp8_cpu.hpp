// CPU driver for S2FP8 (docs/design.md §8).
#pragma once
#include <cstdint>

#include "s2fp8_forms.hpp"

namespace lowfp {

// S2FP8 on the CPU threads: writes the reduction's sums (int64[kSumSize]) and the statistics
// (double[kParamSize]: alpha, beta, mu, m), then x' into call.q.y; adds {overflow, underflow,
// nan, numel} to counts when counts is not null.
void s2fp8_cpu(const S2fp8Call& call, int64_t* sums, double* params, int64_t* counts);

}  // namespace lowfp
