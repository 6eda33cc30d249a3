// CPU driver for quantize: one call describes a whole buffer; the dispatcher splits it over
// threads and hands contiguous ranges to the kernel built for the best instruction set.
#pragma once
#include <cstdint>

#include "extra_bits_call.hpp"
#include "lowfp/s2fp8.hpp"
#include "lowfp/s2fp8_stochastic.hpp"
#include "quantize_call.hpp"

namespace lowfp {

struct EventCounts {
  int64_t overflow = 0, underflow = 0, nan = 0;
  void add(const EventCounts& o) { overflow += o.overflow; underflow += o.underflow; nan += o.nan; }
};

// The threshold form of an S2FP8 call's element transform (s2fp8_thresholds.cpp), for float32
// and 16-bit x in the deterministic modes: x' depends on |x| only through which of a few hundred
// intervals of x's magnitude bits it falls in, so the CPU looks it up instead of evaluating the
// logarithms per element. Built per call once the statistics are known; index 0 of the per-sign
// arrays is for positive x, 1 for negative.
struct S2fp8Thresholds {
  // Magnitude bits a are first raised to base (below it x' does not change: base lies below
  // every threshold and is a multiple of 2^shift). Bucket (a - base) >> shift of sign s, clamped
  // to buckets - 1, is entry s * sign_entries + bucket: (v << shift) | t, where v indexes values
  // and t is the low bits of the bucket's one threshold (0 when it has none):
  // x' = values[v - ((a & low) < t)] | (x & mirror_sign) with low = 2^shift - 1.
  const uint32_t* entries = nullptr;
  const uint32_t* values = nullptr;  // x' as raw bits of x's dtype, both signs unless mirrored
  uint32_t n_values = 0;
  uint32_t base = 0, shift = 0, buckets = 0;
  // Mirrored (x' of -x is -(x' of x) and the event ranges are the same for both signs, as in
  // every mode but up and down): the negative sign has no entries or values of its own
  // (sign_entries = 0) and takes x's sign bit (mirror_sign, the sign bit of x's dtype); halving
  // the table keeps the CPU's lookup of values in fewer registers, and the CPU loops drop their
  // per-sign terms. Else sign_entries = buckets and mirror_sign = 0.
  uint32_t sign_entries = 0, mirror_sign = 0;
  // The steps for magnitude bits a, sign neg (0 or 1) and x's bits xb, shared by the CPU and GPU
  // kernels.
  LOWFP_HD uint32_t raised(uint32_t a) const { return max_of(a, base); }
  LOWFP_HD uint32_t entry_index(uint32_t a_raised, uint32_t neg) const {
    return min_of((a_raised - base) >> shift, buckets - 1) + ((uint32_t(0) - neg) & sign_entries);
  }
  LOWFP_HD uint32_t value_index(uint32_t a_raised, uint32_t entry) const {
    const uint32_t low = (uint32_t(1) << shift) - 1;  // shift < 32, so both below 2^31:
    // compared as signed integers, which AVX2 does in one instruction (unsigned takes two)
    return (entry >> shift) - uint32_t(int32_t(a_raised & low) < int32_t(entry & low));
  }
  LOWFP_HD uint32_t signed_value(uint32_t value, uint32_t xb) const {
    return value | (xb & mirror_sign);
  }
  // Events as ranges of magnitude bits a: underflow for under_lo <= a < under_hi, above max (or
  // NaN) for a >= above.
  uint32_t under_lo[2] = {0, 0}, under_hi[2] = {0, 0}, above[2] = {0, 0};
};

// The fast form of stochastic S2FP8 (lowfp/s2fp8_stochastic.hpp) for float32 and 16-bit x:
// constants and x' per grid index as raw bits of x's dtype (per_sign + sign_offset entries).
// Built per call by s2fp8_build_stochastic.
struct S2fp8StochasticForm {
  S2fp8FastStochastic k{};
  const uint32_t* values = nullptr;
};

// The per-call forms an S2FP8 transform may take (null: not built); the float64 path otherwise.
struct S2fp8Forms {
  const S2fp8Thresholds* thresholds = nullptr;
  const S2fp8StochasticForm* stochastic = nullptr;
};

// The bits of +inf and of the sign in each 16- or 32-bit storage type.
template <class T> constexpr uint32_t kInfRaw = 0;
template <> constexpr uint32_t kInfRaw<Half> = 0x7C00;
template <> constexpr uint32_t kInfRaw<BFloat> = 0x7F80;
template <> constexpr uint32_t kInfRaw<float> = 0x7F800000u;
template <class T> constexpr uint32_t kSignRaw = uint32_t(1) << (8 * sizeof(T) - 1);

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

const char* cpu_kernel_name();
void set_num_threads(int n);
int get_num_threads();

}  // namespace lowfp
