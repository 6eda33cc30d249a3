// CUDA driver for emulated-accumulation GEMMs (docs/design.md §10; built only with nvcc, see
// cpp/src/cuda/CMakeLists.txt).
#pragma once
#include <cstdint>

#include "accumulate_call.hpp"

namespace lowfp {

// Enqueues the whole call on `stream` of `device` (A, B, C device buffers); nothing waits for it.
// counts (a device int64[5], or null): += {overflow, underflow, nan, roundings, swamped}.
void accumulate_cuda(const AccumulateCall& call, int64_t* counts, int device, uintptr_t stream);

}  // namespace lowfp
