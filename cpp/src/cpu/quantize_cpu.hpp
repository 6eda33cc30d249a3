// CPU driver for quantize: one call describes a whole buffer; the dispatcher splits it over
// threads and hands contiguous ranges to the kernel built for the best instruction set.
#pragma once
#include <cstdint>

#include "extra_bits_call.hpp"
#include "quantize_call.hpp"
#include "s2fp8_forms.hpp"
#include "scaled_call.hpp"

namespace lowfp {

struct EventCounts {
  int64_t overflow = 0, underflow = 0, nan = 0;
  void add(const EventCounts& o) { overflow += o.overflow; underflow += o.underflow; nan += o.nan; }
};

// Elements per tile: a multiple of 4 so that tiles start on Philox block boundaries.
constexpr int64_t kTile = 2048;

// One kernel per instruction-set level (same source compiled with different -march flags).
#define LOWFP_DECLARE_KERNEL(ns)                                                              \
  namespace ns {                                                                              \
  void quantize_range(const QuantizeCall&, int64_t, int64_t, EventCounts&);                   \
  void s2fp8_reduce_range(const S2fp8Call&, int64_t, int64_t, S2fp8Partial&);                 \
  void s2fp8_transform_range(const S2fp8Call&, const S2fp8Stats&, const S2fp8Forms&, int64_t,  \
                             int64_t, EventCounts&);                                          \
  void extra_bits_step_range(const ExtraBitsStep&, int64_t, int64_t, int64_t, EventCounts&);  \
  void extra_bits_split_range(const ExtraBitsParams&, Rounding, const ExtraBitsSplit&, int64_t,   \
                              int64_t, EventCounts&);                                         \
  void extra_bits_merge_range(const ExtraBitsParams&, const ExtraBitsMerge&, int64_t, int64_t); \
  bool any_non_finite_range(DType, const void*, int64_t, int64_t);                           \
  double scaled_amax_range(const ScaledCall&, int64_t, int64_t);                             \
  void scaled_scales_range(const ScaledCall&, double, int64_t, int64_t, int64_t&);            \
  void scaled_elements_range(const ScaledCall&, int64_t, int64_t, EventCounts&);              \
  }
LOWFP_DECLARE_KERNEL(isa_baseline)
LOWFP_DECLARE_KERNEL(isa_avx2)
LOWFP_DECLARE_KERNEL(isa_avx512)
#undef LOWFP_DECLARE_KERNEL

// Adds {overflow, underflow, nan} and n to a counts buffer (int64[4]; nothing when null).
void add_counts(const EventCounts& c, int64_t n, int64_t* counts);

// Runs the whole call on the CPU threads; adds {overflow, underflow, nan, numel} to counts
// when counts is not null.
void quantize_cpu(const QuantizeCall& call, int64_t* counts);

// S2FP8 on the CPU threads: writes the reduction's sums (int64[kSumSize]) and the statistics
// (double[kParamSize]: alpha, beta, mu, m), then x' into call.q.y; counts as quantize_cpu.
void s2fp8_cpu(const S2fp8Call& call, int64_t* sums, double* params, int64_t* counts);

// Extra bits (docs/design.md §5) on the CPU threads; the returned counts are the 16-bit weights'
// rounding events (overflow, underflow, nan).
EventCounts extra_bits_split_cpu(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a);
void extra_bits_merge_cpu(const ExtraBitsParams& e, const ExtraBitsMerge& a);
// One fused optimizer step over every slot (parameter) of a group, all threads over all blocks.
EventCounts extra_bits_step_cpu(const ExtraBitsStep& s);

// Packed extra bits in another element order (a parameter's memory layout changed): element i
// of dst (n elements of q bits, docs/design.md §5's blocks) is element index[i] of src, each index in
// [0, n); dst's padding elements are 0.
void extra_bits_gather_cpu(const uint32_t* src, const int64_t* index, int64_t n, uint32_t q,
                           uint32_t* dst);

// Whether any of the n elements of x (a float16/bfloat16/float32/float64 buffer) is an infinity
// or a NaN.
bool any_non_finite_cpu(DType t, const void* x, int64_t n);

// A scaled-format rounding (docs/design.md §9) on the CPU threads: the blocks' scales into
// call.scales, the tensor scale (1 without one) into *tensor_scale, s · q into call.y; adds
// {overflow, underflow, nan, numel} to counts when it is not null, and {blocks whose scale
// saturated, blocks} after them when call.count_blocks.
void scaled_cpu(const ScaledCall& call, double* tensor_scale, int64_t* counts);

// The Hadamard transform of the call's groups on the CPU threads.
void hadamard_cpu(const HadamardCall& call);

const char* cpu_kernel_name();
void set_num_threads(int n);
// The thread count when set_num_threads has none (torch's, from the Python layer; 0: every core).
void set_default_threads(int n);
int get_num_threads();

}  // namespace lowfp
