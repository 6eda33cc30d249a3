// The CPU kernels: each feature's loops over a range of one call, compiled once per
// instruction-set level (the same sources with different -march flags, in a namespace per level);
// the drivers (*_cpu.cpp) pick a level at run time and split a call over threads.
#pragma once
#include <cstdint>

#include "extra_bits_call.hpp"
#include "quantize_call.hpp"
#include "s2fp8_forms.hpp"
#include "scaled/plan.hpp"
#include "scaled_call.hpp"

namespace lowfp {

struct AccumulateCall;    // accumulate_call.hpp
struct AccumulateCounts;  // lowfp/accumulate.hpp

struct EventCounts {
  int64_t overflow = 0, underflow = 0, nan = 0;
  void add(const EventCounts& o) { overflow += o.overflow; underflow += o.underflow; nan += o.nan; }
};

// Elements per tile: a multiple of 4 so that tiles start on Philox block boundaries.
constexpr int64_t kTile = 2048;

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
  void scaled_elements_range(const ScaledCall&, const ScaledCpuForms&, const ScaledPlan&, int64_t, \
                             int64_t, EventCounts&);                                          \
  void accumulate_range(const AccumulateCall&, int64_t, int64_t, AccumulateCounts&);           \
  }
LOWFP_DECLARE_KERNEL(isa_baseline)
LOWFP_DECLARE_KERNEL(isa_avx2)
LOWFP_DECLARE_KERNEL(isa_avx512)
#undef LOWFP_DECLARE_KERNEL

}  // namespace lowfp
