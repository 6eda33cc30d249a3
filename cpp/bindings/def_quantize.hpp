// The one Python signature of quantize shared by lowfp._C and lowfp._C_cuda:
// quantize(x_ptr, x_dtype, y_ptr, y_dtype, n, e, m, b, specials, subnormals, overflow, rounding,
//          sr_bits, seed, offset, counts_ptr, device, stream)
// `run(call, counts, device, stream)` executes a checked call with the GIL released.
#pragma once
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "quantize_call.hpp"

namespace lowfp {

template <class Run>
void def_quantize(pybind11::module_& mod, Run run) {
  mod.def("quantize", [run](uintptr_t x, int32_t x_dtype, uintptr_t y, int32_t y_dtype, int64_t n,
                            int32_t e, int32_t m, int32_t b, int32_t specials, bool subnormals,
                            int32_t overflow, int32_t rounding, int32_t sr_bits, uint64_t seed,
                            uint64_t offset, uintptr_t counts, int32_t device, uintptr_t stream) {
    const QuantizeRequest r{{e, m, b, Specials(specials), subnormals}, Overflow(overflow),
                            Rounding(rounding), sr_bits, DType(x_dtype), DType(y_dtype), seed,
                            offset};
    const QuantizeCall call = make_quantize_call(r, reinterpret_cast<const void*>(x),
                                                 reinterpret_cast<void*>(y), n, counts != 0);
    pybind11::gil_scoped_release release;
    run(call, reinterpret_cast<int64_t*>(counts), device, stream);
  });
}

// s2fp8(x_ptr, dtype, y_ptr, n, e, m, b, specials, subnormals, overflow, rounding, sr_bits, seed,
//       offset, log_max, sums_ptr, params_ptr, counts_ptr, device, stream):
// `run(call, sums, params, counts, device, stream)` with the GIL released.
template <class Run>
void def_s2fp8(pybind11::module_& mod, Run run) {
  mod.def("s2fp8", [run](uintptr_t x, int32_t dtype, uintptr_t y, int64_t n, int32_t e, int32_t m,
                         int32_t b, int32_t specials, bool subnormals, int32_t overflow,
                         int32_t rounding, int32_t sr_bits, uint64_t seed, uint64_t offset,
                         double log_max, uintptr_t sums, uintptr_t params, uintptr_t counts,
                         int32_t device, uintptr_t stream) {
    const QuantizeRequest r{{e, m, b, Specials(specials), subnormals}, Overflow(overflow),
                            Rounding(rounding), sr_bits, DType(dtype), DType(dtype), seed, offset};
    const S2fp8Call call = make_s2fp8_call(r, log_max, reinterpret_cast<const void*>(x),
                                           reinterpret_cast<void*>(y), n, counts != 0);
    if (sums == 0 || params == 0) throw std::invalid_argument("s2fp8 needs sums and params buffers");
    pybind11::gil_scoped_release release;
    run(call, reinterpret_cast<int64_t*>(sums), reinterpret_cast<double*>(params),
        reinterpret_cast<int64_t*>(counts), device, stream);
  });
}

}  // namespace lowfp
