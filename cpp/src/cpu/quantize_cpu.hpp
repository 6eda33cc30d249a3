// CPU driver for quantize: one call describes a whole buffer; the driver splits it over threads
// and hands contiguous ranges to the kernel built for the best instruction set.
#pragma once
#include <cstdint>

#include "quantize_call.hpp"

namespace lowfp {

// Runs the whole call on the CPU threads; adds {overflow, underflow, nan, numel} to counts
// when counts is not null.
void quantize_cpu(const QuantizeCall& call, int64_t* counts);

// Whether any of the n elements of x (a float16/bfloat16/float32/float64 buffer) is an infinity
// or a NaN.
bool any_non_finite_cpu(DType t, const void* x, int64_t n);

// Adds to counts {overflow, underflow, nan, numel} those of a rounding that returns x unchanged:
// its NaNs and its n elements (the emulation's skipped roundings, docs/design.md §6).
void count_unchanged_cpu(DType t, const void* x, int64_t n, int64_t* counts);

}  // namespace lowfp
