// The scaled-format rounding (docs/design.md §9) shared by lowfp._C and lowfp._C_cuda: a request
// prepared once by keyword, then called on buffers,
//   PreparedScaled(element=, overflow=, rounding=, sr_bits=, scale_rule=, scale_format=,
//                  tensor_scale=, choice=, dtype=)
//   p(x_ptr, y_ptr, rows, cols, block_rows, block_cols, word_run, seed, offset, scales_ptr, q_ptr,
//     tensor_scale_ptr, counts_ptr, counts_size, device, stream)
// word_run: the stochastic words' order (ScaledCall::word_run; 0: row-major);
// scales_ptr: float64 per block; q_ptr (or 0): float32 per element; tensor_scale_ptr: one float64;
// counts_ptr (or 0): int64[counts_size], 4 (overflow, underflow, nan, numel: a lowfp.Stats) or 6
// (saturated blocks and blocks too: a ScaledStats), added to. `run(call, tensor_scale, counts,
// device, stream)` executes the call with the GIL released.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <optional>
#include <stdexcept>

#include "scaled_call.hpp"

namespace lowfp {

// A request as a backend prepares it: the call both backends share, and what the backend's own
// driver prepares beside it (the CPU's strategies' forms; nothing on CUDA: NoForms).
struct NoForms {};
template <class Forms>
struct PreparedScaled {
  ScaledCall call;
  Forms forms;
};

// prepare(request, call) -> Forms; run(call, forms, tensor_scale, counts, device, stream). Returns
// the class, for a backend's own methods.
template <class Forms, class Prepare, class Run>
pybind11::class_<PreparedScaled<Forms>> def_scaled(pybind11::module_& mod, Prepare prepare, Run run) {
  namespace py = pybind11;
  using Prepared = PreparedScaled<Forms>;
  // module_local: a request runs on the backend that made it.
  py::class_<Prepared> cls(mod, "PreparedScaled", py::module_local());
  cls.def(py::init([prepare](FormatSpec element, Overflow overflow, Rounding rounding, int32_t sr_bits,
                             ScaleRule scale_rule, std::optional<FormatSpec> scale_format,
                             bool tensor_scale, BlockChoice choice, DType dtype) {
            if ((scale_rule == ScaleRule::Format) != scale_format.has_value())
              throw std::invalid_argument(
                  "scale_format goes with the 'nearest' scale rule, and only with it");
            const ScaledRequest r{element, overflow, rounding, sr_bits, scale_rule,
                                  scale_format.value_or(element), tensor_scale, choice, dtype};
            const ScaledCall call = prepare_scaled_call(r);
            return Prepared{call, prepare(r, call)};
          }),
          py::kw_only(), py::arg("element"), py::arg("overflow"), py::arg("rounding"),
          py::arg("sr_bits"), py::arg("scale_rule"), py::arg("scale_format"),
          py::arg("tensor_scale"), py::arg("choice"), py::arg("dtype"))
      .def("__call__", [run](const Prepared& p, uintptr_t x, uintptr_t y, int64_t rows,
                             int64_t cols, int64_t block_rows, int64_t block_cols, int64_t word_run,
                             uint64_t seed, uint64_t offset, uintptr_t scales, uintptr_t q,
                             uintptr_t tensor_scale, uintptr_t counts, int32_t counts_size,
                             int32_t device, uintptr_t stream) {
        if (tensor_scale == 0)
          throw std::invalid_argument("scaled_quantize needs a tensor scale buffer");
        const ScaledCall call = with_buffers(
            p.call, reinterpret_cast<const void*>(x), reinterpret_cast<void*>(y), rows, cols,
            block_rows, block_cols, word_run, seed, offset, reinterpret_cast<double*>(scales),
            reinterpret_cast<float*>(q), counts != 0 ? counts_size : 0);
        py::gil_scoped_release release;
        run(call, p.forms, reinterpret_cast<double*>(tensor_scale), reinterpret_cast<int64_t*>(counts),
            device, stream);
      });
  return cls;
}

// hadamard16(x_ptr, dtype, y_ptr, groups, signs, inverse, device, stream): the random Hadamard
// transform (HadamardCall) of `groups` groups of 16; signs: 16 floats. `run(call, device,
// stream)` executes it with the GIL released.
template <class Run>
void def_hadamard(pybind11::module_& mod, Run run) {
  mod.def("hadamard16", [run](uintptr_t x, int32_t dtype, uintptr_t y, int64_t groups,
                              const std::array<double, kHadamardSize>& signs, bool inverse,
                              int32_t device, uintptr_t stream) {
    if (dtype < 0 || dtype > 3) throw std::invalid_argument("bad dtype code");
    if (groups < 0) throw std::invalid_argument("negative group count");
    HadamardCall call{reinterpret_cast<const void*>(x), DType(dtype), reinterpret_cast<void*>(y),
                      groups, {}, inverse};
    for (int i = 0; i < kHadamardSize; ++i) call.signs[i] = signs[i];
    pybind11::gil_scoped_release release;
    run(call, device, stream);
  });
}

}  // namespace lowfp
