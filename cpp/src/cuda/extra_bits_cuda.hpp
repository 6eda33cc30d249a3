// CUDA drivers for extra bits (built only with nvcc). Enqueued on `stream` of `device`; counts
// (a device int64[4] or null) receive the 16-bit weights' overflow/underflow/nan events.
#pragma once
#include <cstdint>

#include "extra_bits_call.hpp"

namespace lowfp {

// One launch per 384 parameters of the step (the slot table is the kernel's argument; the slots'
// buffers are device pointers); it never waits for the GPU.
void extra_bits_step_cuda(const ExtraBitsStep& s, int64_t* counts, int device, uintptr_t stream);
void extra_bits_split_cuda(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a,
                           int64_t* counts, int device, uintptr_t stream);
void extra_bits_merge_cuda(const ExtraBitsParams& e, const ExtraBitsMerge& a, int device,
                           uintptr_t stream);

}  // namespace lowfp
