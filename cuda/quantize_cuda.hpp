// CUDA driver for quantize (built only with nvcc; see cuda/CMakeLists.txt).
#pragma once
#include <cstdint>

#include "quantize_call.hpp"

namespace lowfp {

// Enqueues the whole call on `stream` of `device`; nothing waits for it. When `counts` is not
// null (a device buffer of 4 int64), {overflow, underflow, nan, numel} are added to it on the GPU.
void quantize_cuda(const QuantizeCall& call, int64_t* counts, int device, uintptr_t stream);

}  // namespace lowfp
