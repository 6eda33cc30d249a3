// CPU driver for emulated-accumulation GEMMs (docs/design.md §10).
#pragma once
#include <cstdint>

#include "accumulate_call.hpp"

namespace lowfp {

// The whole call on the CPU threads (rows of C shared out); when counts is not null (int64[5])
// adds {overflow, underflow, nan, roundings, swamped additions}.
void accumulate_cpu(const AccumulateCall& call, int64_t* counts);

}  // namespace lowfp
