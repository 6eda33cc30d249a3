// Validates one quantize request and turns it into a QuantizeCall (shared by the CPU and CUDA
// bindings). Throws std::invalid_argument, which pybind11 raises as ValueError.
#pragma once
#include "quantize_cpu.hpp"

namespace lowfp {

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

}  // namespace lowfp
