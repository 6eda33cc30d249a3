// The one Python signature of quantize shared by lowfp._C and lowfp._C_cuda:
// quantize(x_ptr, x_dtype, y_ptr, y_dtype, n, e, m, b, specials, subnormals, overflow, rounding,
//          sr_bits, seed, offset, counts_ptr, device, stream)
// `run(call, counts, device, stream)` executes a checked call with the GIL released.
#pragma once
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "quantize_call.hpp"

namespace lowfp {

// A request made into the kernels' call once (checked, its RoundParams computed): lowfp's eager
// plans keep one per rounding, and each call passes only its buffers, count, seed and offset.
struct PreparedQuantize {
  QuantizeCall call;
};

template <class Run>
void def_quantize(pybind11::module_& mod, Run run) {
  // PreparedQuantize(x_dtype, y_dtype, e, m, b, specials, subnormals, overflow, rounding, sr_bits)
  // (quantize's arguments without the buffers, seed and offset); called as
  // p(x_ptr, y_ptr, n, seed, offset, counts_ptr, device, stream). Each module has its own class
  // (module_local): a request runs on the backend that made it.
  pybind11::class_<PreparedQuantize>(mod, "PreparedQuantize", pybind11::module_local())
      .def(pybind11::init([](int32_t x_dtype, int32_t y_dtype, int32_t e, int32_t m, int32_t b,
                             int32_t specials, bool subnormals, int32_t overflow, int32_t rounding,
                             int32_t sr_bits) {
        const QuantizeRequest r{{e, m, b, Specials(specials), subnormals}, Overflow(overflow),
                                Rounding(rounding), sr_bits, DType(x_dtype), DType(y_dtype), 0, 0};
        return PreparedQuantize{make_quantize_call(r, nullptr, nullptr, 0, false)};
      }))
      .def("__call__", [run](const PreparedQuantize& p, uintptr_t x, uintptr_t y, int64_t n,
                             uint64_t seed, uint64_t offset, uintptr_t counts, int32_t device,
                             uintptr_t stream) {
        if (n < 0) throw std::invalid_argument("negative element count");
        QuantizeCall call = p.call;
        call.x = reinterpret_cast<const void*>(x);
        call.y = reinterpret_cast<void*>(y);
        call.n = n;
        call.seed = seed;
        call.offset = offset;
        call.count = counts != 0;
        pybind11::gil_scoped_release release;
        run(call, reinterpret_cast<int64_t*>(counts), device, stream);
      });

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
  // The element kernel's RoundParams of a request (same arguments as quantize, without the
  // buffers), whether the kernel rounds it to nearest by addition (with the exponent cap of the
  // constant) and whether stochastically by steps (dispatch.hpp's element forms), for lowfp's
  // torch form of the rounding (python/lowfp/_torch_round.py), which must compute what the kernel
  // computes from the same constants, and for tests. Bit patterns are unsigned.
  mod.def("round_params", [](int32_t x_dtype, int32_t y_dtype, int32_t e, int32_t m, int32_t b,
                             int32_t specials, bool subnormals, int32_t overflow, int32_t rounding,
                             int32_t sr_bits) {
    const QuantizeRequest r{{e, m, b, Specials(specials), subnormals}, Overflow(overflow),
                            Rounding(rounding), sr_bits, DType(x_dtype), DType(y_dtype), 0, 0};
    const QuantizeCall call = make_quantize_call(r, nullptr, nullptr, 0, false);
    pybind11::dict d;
    auto fill = [&](const auto& p) {
      d["normal_drop"] = p.normal_drop;
      d["below_drop"] = p.below_drop;
      d["emin"] = p.emin;
      d["below_step"] = p.below_step;
      d["max_bits"] = p.max_bits;
      d["overflow_pos"] = p.overflow_pos;
      d["overflow_neg"] = p.overflow_neg;
      d["inf_stays_inf"] = p.inf_stays_inf;
      d["no_negative_zero"] = p.no_negative_zero;
      d["ties_away"] = p.ties_away;
      d["parity_bias"] = p.parity_bias;
      d["parity_mask"] = p.parity_mask;
      d["away_pos"] = p.away_pos;
      d["away_neg"] = p.away_neg;
      d["sr_shift"] = p.sr_shift;
      d["subnormal_exponent"] = p.subnormal_exponent;
      d["fixed_drop"] = p.fixed_drop;
    };
    if (call.wide)
      fill(call.p64);
    else
      fill(call.p32);
    d["carrier_bits"] = call.wide ? 64 : 32;
    d["nearest_by_addition"] = call.nearest_by_addition;
    d["addition_cap"] = call.addition_cap;
    d["stochastic_by_steps"] = call.stochastic_by_steps;
    return d;
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
