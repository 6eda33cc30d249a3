// CUDA driver for scaled formats (built only with nvcc; see cpp/src/cuda/CMakeLists.txt).
#pragma once
#include <cstdint>

#include "scaled_call.hpp"

namespace lowfp {

// Enqueues the whole call on `stream` of `device` (every pointer a device buffer; call.scales
// holds one double per block, tensor_scale one double); nothing waits for it. counts (or null):
// += {overflow, underflow, nan, numel}, then {saturated blocks, blocks} when call.count_blocks,
// as scaled_cpu.
void scaled_cuda(const ScaledCall& call, double* tensor_scale, int64_t* counts, int device,
                 uintptr_t stream);

// Enqueues the Hadamard transform of call's groups (device buffers) on `stream` of `device`.
void hadamard_cuda(const HadamardCall& call, int device, uintptr_t stream);

}  // namespace lowfp
