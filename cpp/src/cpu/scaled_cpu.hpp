// CPU driver for scaled formats (docs/design.md §9) and the Hadamard transform.
#pragma once
#include <cstdint>

#include "scaled/plan.hpp"
#include "scaled_call.hpp"

namespace lowfp {

// A scaled-format rounding on the CPU threads: the blocks' scales into call.scales, the tensor
// scale (1 without one) into *tensor_scale, s · q into call.y; adds {overflow, underflow, nan,
// numel} to counts when it is not null, and {blocks whose scale saturated, blocks} after them
// when call.count_blocks. forms: prepare_scaled_cpu's for the call's request.
void scaled_cpu(const ScaledCall& call, const ScaledCpuForms& forms, double* tensor_scale, int64_t* counts);

// The Hadamard transform of the call's groups on the CPU threads.
void hadamard_cpu(const HadamardCall& call);

}  // namespace lowfp
