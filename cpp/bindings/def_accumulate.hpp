// The emulated-accumulation GEMM (docs/design.md §10) shared by lowfp._C and lowfp._C_cuda: a
// request prepared once by keyword, then called on buffers,
//   PreparedAccumulate(accumulator=, overflow=, rounding=, sr_bits=, order=, block=,
//                      compensated=, group=, align_bits=, operand_emin=, product=,
//                      product_overflow=, outer=,
//                      outer_overflow=)
//   p(a_ptr, b_ptr, c_ptr, batch, m, n, k, a_strides, b_strides, seed, offset, counts_ptr,
//     device, stream)
// a_strides: A's (batch, row, reduction) strides in elements; b_strides: B's (batch, reduction,
// column); A and B float32; C: float32, contiguous (batch, m, n); counts_ptr (or 0): int64[5]
// added to (overflow, underflow, nan, roundings, swamped additions). `run(call, counts, device, stream)` executes the
// call with the GIL released.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <optional>
#include <stdexcept>

#include "accumulate_call.hpp"

namespace lowfp {

struct PreparedAccumulate {
  AccumulateParams p;
};

template <class Run>
void def_accumulate(pybind11::module_& mod, Run run) {
  namespace py = pybind11;
  // module_local: a request runs on the backend that made it.
  py::class_<PreparedAccumulate>(mod, "PreparedAccumulate", py::module_local())
      .def(py::init([](FormatSpec accumulator, Overflow overflow, Rounding rounding, int32_t sr_bits,
                       AccumulateOrder order, int64_t block, bool compensated, int32_t group,
                       int32_t align_bits, int32_t operand_emin, std::optional<FormatSpec> product, Overflow product_overflow, FormatSpec outer,
                       Overflow outer_overflow) {
             const AccumulateRequest r{accumulator, overflow, rounding, sr_bits, order, block,
                                       compensated, group, align_bits, operand_emin,
                                       product.has_value(),
                                       product.value_or(accumulator),
                                       product_overflow, outer, outer_overflow};
             return PreparedAccumulate{prepare_accumulate(r)};
           }),
           py::kw_only(), py::arg("accumulator"), py::arg("overflow"), py::arg("rounding"),
           py::arg("sr_bits"), py::arg("order"), py::arg("block"), py::arg("compensated"),
           py::arg("group"), py::arg("align_bits"), py::arg("operand_emin"), py::arg("product"), py::arg("product_overflow"), py::arg("outer"),
           py::arg("outer_overflow"))
      // The lane form the kernels take for the request (accumulate.hpp's LaneForm), for tests
      // that check which one a device runs: "by_addition", "in_mode" or "bits".
      .def_property_readonly("form",
                             [](const PreparedAccumulate& p) {
                               return p.p.in_mode ? "in_mode" : p.p.by_addition ? "by_addition" : "bits";
                             })
      .def("__call__", [run](const PreparedAccumulate& p, uintptr_t a, uintptr_t b, uintptr_t c,
                             int64_t batch, int64_t m, int64_t n, int64_t k,
                             const std::array<int64_t, 3>& a_strides,
                             const std::array<int64_t, 3>& b_strides, uint64_t seed, uint64_t offset,
                             uintptr_t counts, int32_t device, uintptr_t stream) {
        if (batch < 0 || m < 0 || n < 0 || k < 0) throw std::invalid_argument("negative shape");
        const AccumulateCall call{p.p, reinterpret_cast<const float*>(a),
                                  reinterpret_cast<const float*>(b), reinterpret_cast<float*>(c),
                                  batch, m, n, k, a_strides[0], a_strides[1], a_strides[2],
                                  b_strides[0], b_strides[1], b_strides[2], seed, offset};
        py::gil_scoped_release release;
        run(call, reinterpret_cast<int64_t*>(counts), device, stream);
      });
}

}  // namespace lowfp
