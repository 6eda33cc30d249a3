// CUDA drivers for extra bits (built only with nvcc). Enqueued on `stream` of `device`; counts
// (a device int64[4] or null) receive the 16-bit weights' overflow/underflow/nan events.
#pragma once
#include <cstdint>

#include "extra_bits_call.hpp"

namespace lowfp {

// One launch for every parameter of the step (the slots' buffers are device pointers).
void extra_bits_step_cuda(const ExtraBitsStep& s, int64_t* counts, int device, uintptr_t stream);
void extra_bits_split_cuda(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a,
                           int64_t* counts, int device, uintptr_t stream);
void extra_bits_merge_cuda(const ExtraBitsParams& e, const ExtraBitsMerge& a, int device,
                           uintptr_t stream);

}  // namespace lowfp
