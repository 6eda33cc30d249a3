// lowfp._C: the CPU core. Python passes raw buffers (data_ptr, element count, dtype code);
// argument checking with user-facing messages happens in python/lowfp.
#include <pybind11/pybind11.h>

#include "def_quantize.hpp"
#include "lowfp/philox.hpp"
#include "quantize_cpu.hpp"

namespace py = pybind11;
using namespace lowfp;

namespace {

py::dict format_info(int32_t e, int32_t m, int32_t b, int32_t specials, bool subnormals) {
  if (specials < 0 || specials > 3) throw std::invalid_argument("bad specials code");
  const FormatSpec f{e, m, b, Specials(specials), subnormals};
  const std::string bad = spec_error(f);
  if (!bad.empty()) throw std::invalid_argument(bad);
  py::dict d;
  d["bias"] = exponent_bias(f);
  d["emin"] = min_exponent(f);
  d["emax"] = max_exponent(f);
  d["smallest_exp"] = smallest_exponent(f);
  d["max"] = max_value(f);
  py::dict fits;
  for (DType t : {DType::Float16, DType::BFloat16, DType::Float32, DType::Float64})
    fits[type_limits(t).name] = fit_error(f, t);
  d["fit_errors"] = fits;
  return d;
}

py::tuple philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  const Philox4x32Block r = philox4x32_10(c0, c1, c2, c3, k0, k1);
  return py::make_tuple(r.w[0], r.w[1], r.w[2], r.w[3]);
}

py::tuple counts_tuple(const EventCounts& c) { return py::make_tuple(c.overflow, c.underflow, c.nan); }

template <class T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// slots: (w16, grad, words, state0, state1, state2, n, rand_offset) per parameter.
ExtraBitsStep make_step(int32_t opt, int32_t weights, int32_t k, int32_t rounding, int32_t state,
                        const py::tuple& hyper, uint64_t seed, const py::list& slots) {
  ExtraBitsStep s{};
  if (weights < 0 || weights > 3 || state < 0 || state > 3 || rounding < 0 || rounding > 5)
    throw std::invalid_argument("bad dtype or rounding code");
  s.e = make_extra_bits_params(DType(weights), k, Rounding(rounding));
  s.mode = Rounding(rounding);
  s.weights = DType(weights);
  s.state = DType(state);
  if (s.state != DType::Float32 && s.state != DType::BFloat16)
    throw std::invalid_argument("state dtype must be float32 or bfloat16");
  s.state_round = make_round_params<uint32_t>(FormatSpec{8, 7, 0, Specials::IEEE, true},
                                              Overflow::Inf, Rounding::Nearest, 32);
  s.seed = seed;
  if (opt == 0) {
    s.opt = OptimKind::Sgd;
    s.sgd = SgdHyper{hyper[0].cast<float>(), hyper[1].cast<float>(), hyper[2].cast<float>(),
                     hyper[3].cast<float>(), hyper[4].cast<bool>(), hyper[5].cast<bool>(),
                     hyper[6].cast<bool>()};
    s.has_momentum = hyper[7].cast<bool>();
  } else if (opt == 1) {
    s.opt = OptimKind::Adam;
    s.adam = AdamHyper{hyper[0].cast<float>(), hyper[1].cast<float>(), hyper[2].cast<float>(),
                       hyper[3].cast<float>(), hyper[4].cast<float>(), hyper[5].cast<float>(),
                       hyper[6].cast<float>(), hyper[7].cast<float>(), hyper[8].cast<bool>(),
                       hyper[9].cast<bool>(), hyper[10].cast<bool>()};
  } else {
    throw std::invalid_argument("bad optimizer code");
  }
  for (const auto& item : slots) {
    const py::tuple t = item.cast<py::tuple>();
    s.slots.push_back({ptr<void>(t[0].cast<uintptr_t>()), ptr<const void>(t[1].cast<uintptr_t>()),
                       ptr<uint32_t>(t[2].cast<uintptr_t>()), ptr<void>(t[3].cast<uintptr_t>()),
                       ptr<void>(t[4].cast<uintptr_t>()), ptr<void>(t[5].cast<uintptr_t>()),
                       t[6].cast<int64_t>(), t[7].cast<uint64_t>()});
  }
  return s;
}

}  // namespace

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "lowfp CPU core (raw-buffer interface; use the lowfp package)";
  mod.def("format_info", &format_info);
  def_quantize(mod, [](const QuantizeCall& call, int64_t* counts, int32_t, uintptr_t) {
    quantize_cpu(call, counts);  // (device and stream are the CUDA module's)
  });
  def_s2fp8(mod, [](const S2fp8Call& call, int64_t* sums, double* params, int64_t* counts,
                    int32_t, uintptr_t) { s2fp8_cpu(call, sums, params, counts); });
  mod.def("extra_bits_split", [](uintptr_t w32, uintptr_t w16, int32_t weights, uintptr_t words,
                                 int64_t n, int32_t k, int32_t rounding, uint64_t seed,
                                 uint64_t offset) {
    const ExtraBitsParams e = make_extra_bits_params(DType(weights), k, Rounding(rounding));
    const ExtraBitsSplit a{ptr<const float>(w32), ptr<void>(w16), ptr<uint32_t>(words), n, seed, offset};
    EventCounts c;
    {
      py::gil_scoped_release release;
      c = extra_bits_split_cpu(e, Rounding(rounding), a);
    }
    return counts_tuple(c);
  });
  mod.def("extra_bits_merge", [](uintptr_t w16, int32_t weights, uintptr_t words, uintptr_t w32,
                                 int64_t n, int32_t k, int32_t rounding) {
    const ExtraBitsParams e = make_extra_bits_params(DType(weights), k, Rounding(rounding));
    const ExtraBitsMerge a{ptr<const void>(w16), ptr<const uint32_t>(words), ptr<float>(w32), n};
    py::gil_scoped_release release;
    extra_bits_merge_cpu(e, a);
  });
  mod.def("extra_bits_step", [](int32_t opt, int32_t weights, int32_t k, int32_t rounding,
                                int32_t state, const py::tuple& hyper, uint64_t seed,
                                const py::list& slots) {
    const ExtraBitsStep s = make_step(opt, weights, k, rounding, state, hyper, seed, slots);
    EventCounts c;
    {
      py::gil_scoped_release release;
      c = extra_bits_step_cpu(s);
    }
    return counts_tuple(c);
  });
  mod.def("philox4x32_10", &philox);
  // The deterministic log2/exp2 that S2FP8 uses (tests compare them with float64 references).
  mod.def("log2_det", [](double x) { return log2_det(x); });
  mod.def("exp2_det", [](double t) { return exp2_det(t); });
  mod.def("set_num_threads", &set_num_threads);
  mod.def("get_num_threads", &get_num_threads);
  mod.def("cpu_kernel", &cpu_kernel_name);
}
