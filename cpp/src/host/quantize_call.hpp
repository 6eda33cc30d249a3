// One quantize request, validated and turned into what the CPU and CUDA drivers take (shared by
// both bindings). make_quantize_call throws std::invalid_argument (pybind11: ValueError).
#pragma once
#include <cstdint>

#include "lowfp/format.hpp"

namespace lowfp {

struct QuantizeCall {
  const void* x;
  DType x_dtype;
  void* y;
  DType y_dtype;
  int64_t n;
  bool wide;                     // carrier is float64 (else float32)
  RoundParams<uint32_t> p32;
  RoundParams<uint64_t> p64;
  // float32 carrier, nearest with ties to even and nearest_by_addition(p32, addition_cap)
  // (round.hpp): the loop rounds by addition
  bool nearest_by_addition;
  int32_t addition_cap;          // the format's largest exponent + 1
  // symmetric_overflow of the carrier's RoundParams (round.hpp): the forms that round by addition
  // or by steps take rounded_result_symmetric
  bool symmetric_overflow;
  // stochastic, stochastic_by_steps of the carrier's RoundParams and symmetric_overflow
  // (round.hpp): the loop rounds by steps (round_stochastic_by_steps)
  bool stochastic_by_steps;
  // float32 in, float32 or bfloat16 out, the bfloat16 format with overflow to inf, nearest or
  // stochastic with 32 random bits: the loop takes round_to_bfloat16_bits (round.hpp), whose
  // folded parameters these are
  bool bfloat16_by_bits;
  Rounding mode;
  uint64_t seed, offset;
  bool count;                    // accumulate overflow/underflow/nan/numel counts
};

struct QuantizeRequest {
  FormatSpec spec;
  Overflow overflow;
  Rounding mode;
  int32_t sr_bits;
  DType x_dtype, y_dtype;
  uint64_t seed, offset;
};

QuantizeCall make_quantize_call(const QuantizeRequest& r, const void* x, void* y, int64_t n,
                                bool count);

// S2FP8 (docs/design.md §4): x and y share one dtype; Y is rounded to the request's format in a float64
// carrier (q.p64); x' is stored in the dtype, rounded to nearest once when it is 16-bit.
struct S2fp8Call {
  QuantizeCall q;
  double log_max;
  RoundParams<uint64_t> p_store;  // float16/bfloat16 grid for x' (nearest, overflow to inf)
};

S2fp8Call make_s2fp8_call(const QuantizeRequest& r, double log_max, const void* x, void* y,
                          int64_t n, bool count);

}  // namespace lowfp
