// One emulated-accumulation GEMM (docs/design.md §10) as the drivers see it: batches of
// C (m × n, float32, contiguous) = A (m × k) · B (k × n), A and B float32 with any strides (the
// caller widens bfloat16 and float16 operands, which is exact), each output element summed by
// accumulate_lanes.
#pragma once
#include <cstdint>

#include "lowfp/accumulate.hpp"
#include "lowfp/format.hpp"

namespace lowfp {

// An accumulation as the caller asks for it, without its buffers: lowfp prepares one per
// Accumulate and reuses it.
struct AccumulateRequest {
  FormatSpec accumulator;
  Overflow overflow;
  Rounding mode;
  int32_t sr_bits;
  AccumulateOrder order;
  int64_t block;        // Blocked: products per block (>= 1); else unused
  bool compensated;
  int32_t group;        // fused groups of this many products (0: none) ...
  int32_t align_bits;   // ... keeping this many bits below each group's largest exponent,
  int32_t operand_emin; // ... operands below 2^operand_emin aligned as if at it
  bool has_product;
  FormatSpec product;   // when has_product: the products' format (nearest) ...
  Overflow product_overflow;  // ... and its overflow policy
  FormatSpec outer;     // Blocked: the outer sum's format (nearest) ...
  Overflow outer_overflow;    // ... and its overflow policy
};

struct AccumulateCall {
  AccumulateParams p;
  const float* a;
  const float* b;
  float* c;
  int64_t batch, m, n, k;
  int64_t a_batch, a_row, a_k;  // A's strides in elements: batch, row, reduction
  int64_t b_batch, b_k, b_col;  // B's: batch, reduction, column
  uint64_t seed, offset;        // stochastic: element e = (batch · m + i) · n + j's t-th rounding
                                // takes word w = e · accumulate_roundings(p, k) + t: word w % 4
                                // of Philox block offset + w / 4
};

// Checks r (std::invalid_argument: pybind11's ValueError) and builds the parameters.
AccumulateParams prepare_accumulate(const AccumulateRequest& r);

}  // namespace lowfp
