// CUDA driver for quantize (built only with nvcc; see cpp/src/cuda/CMakeLists.txt).
#pragma once
#include <cstdint>

#include "quantize_call.hpp"

namespace lowfp {

// Enqueues the whole call on `stream` of `device`; nothing waits for it. When `counts` is not
// null (a device buffer of 4 int64), {overflow, underflow, nan, numel} are added to it on the GPU.
void quantize_cuda(const QuantizeCall& call, int64_t* counts, int device, uintptr_t stream);


// Writes whether any of the n elements of a float16/bfloat16/float32/float64 buffer (DType t)
// is inf or NaN to the bool at out and adds it (0 or 1) to each of the n_counts int64 at counts
// (all device memory), in one launch on `stream`. scratch: two uint32 on the device, zero
// before the call and left zero after it; calls that share them must share the stream.
void any_non_finite_cuda(DType t, const void* x, int64_t n, bool* out, int64_t* counts,
                         int64_t n_counts, uint32_t* scratch, int device, uintptr_t stream);

// The counts of a rounding that returns the n elements at x (DType t) unchanged, added to the 4
// int64 at counts (device memory): its NaNs to counts[2], n to counts[3]; one launch on `stream`.
void count_unchanged_cuda(DType t, const void* x, int64_t n, int64_t* counts, int device, uintptr_t stream);

}  // namespace lowfp
