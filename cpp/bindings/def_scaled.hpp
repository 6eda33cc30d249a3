// scaled_quantize(x_ptr, dtype, y_ptr, rows, cols, block_rows, block_cols,
//                 e, m, b, specials, subnormals, overflow, rounding, sr_bits, seed, offset,
//                 rule, se, sm, sb, sspecials, ssubnormals, tensor_scale,
//                 scales_ptr, q_ptr, tensor_scale_ptr, counts_ptr, device, stream):
// one scaled-format rounding (docs/design.md §9). scales_ptr: float64 per block; q_ptr (or 0):
// float32 per element; tensor_scale_ptr: one float64; counts_ptr (or 0): int64[6].
// `run(call, tensor_scale, counts, device, stream)` executes the checked call without the GIL.
#pragma once
#include <pybind11/pybind11.h>

#include "scaled_call.hpp"

namespace lowfp {

template <class Run>
void def_scaled(pybind11::module_& mod, Run run) {
  mod.def("scaled_quantize",
          [run](uintptr_t x, int32_t dtype, uintptr_t y, int64_t rows, int64_t cols,
                int64_t block_rows, int64_t block_cols, int32_t e, int32_t m, int32_t b,
                int32_t specials, bool subnormals, int32_t overflow, int32_t rounding,
                int32_t sr_bits, uint64_t seed, uint64_t offset, int32_t rule, int32_t se,
                int32_t sm, int32_t sb, int32_t sspecials, bool ssubnormals, bool tensor_scale,
                uintptr_t scales, uintptr_t q, uintptr_t tensor_scale_out, uintptr_t counts,
                int32_t device, uintptr_t stream) {
            const ScaledRequest r{{e, m, b, Specials(specials), subnormals},
                                  Overflow(overflow),
                                  Rounding(rounding),
                                  sr_bits,
                                  ScaleRule(rule),
                                  {se, sm, sb, Specials(sspecials), ssubnormals},
                                  tensor_scale,
                                  DType(dtype),
                                  rows, cols, block_rows, block_cols, seed, offset};
            const ScaledCall call = make_scaled_call(
                r, reinterpret_cast<const void*>(x), reinterpret_cast<void*>(y),
                reinterpret_cast<double*>(scales), reinterpret_cast<float*>(q), counts != 0);
            if (tensor_scale_out == 0) throw std::invalid_argument("scaled_quantize needs a tensor scale buffer");
            pybind11::gil_scoped_release release;
            run(call, reinterpret_cast<double*>(tensor_scale_out), reinterpret_cast<int64_t*>(counts),
                device, stream);
          });
}

}  // namespace lowfp
