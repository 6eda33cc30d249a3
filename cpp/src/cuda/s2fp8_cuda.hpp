// CUDA driver for S2FP8 (docs/design.md §8; built only with nvcc, see cpp/src/cuda/CMakeLists.txt).
#pragma once
#include <cstdint>

#include "s2fp8_forms.hpp"

namespace lowfp {

// S2FP8 enqueued on `stream` of `device`, nothing waiting for it: sums (int64[kSumSize]) and
// params (double[kParamSize]) are device buffers written by the kernels; when counts (a device
// buffer of 4 int64) is not null, {overflow, underflow, nan, numel} are added to it on the GPU.
void s2fp8_cuda(const S2fp8Call& call, int64_t* sums, double* params, int64_t* counts, int device,
                uintptr_t stream);

}  // namespace lowfp
