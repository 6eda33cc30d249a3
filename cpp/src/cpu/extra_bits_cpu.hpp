// CPU driver for extra bits (docs/design.md §5). The returned counts are the 16-bit weights'
// rounding events (overflow, underflow, nan).
#pragma once
#include <cstdint>

#include "extra_bits_call.hpp"
#include "kernels.hpp"

namespace lowfp {

EventCounts extra_bits_split_cpu(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a);
void extra_bits_merge_cpu(const ExtraBitsParams& e, const ExtraBitsMerge& a);
// One fused optimizer step over every slot (parameter) of a group, all threads over all blocks.
EventCounts extra_bits_step_cpu(const ExtraBitsStep& s);

// Packed extra bits in another element order (a parameter's memory layout changed): element i
// of dst (n elements of q bits, docs/design.md §5's blocks) is element index[i] of src, each index in
// [0, n); dst's padding elements are 0.
void extra_bits_gather_cpu(const uint32_t* src, const int64_t* index, int64_t n, uint32_t q,
                           uint32_t* dst);

}  // namespace lowfp
