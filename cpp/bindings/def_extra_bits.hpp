// The extra-bits functions shared by lowfp._C and lowfp._C_cuda (one signature for both):
//   extra_bits_split(w32, w16, dtype, words, n, k, grid, rounding, seed, offset, counts, device,
//                    stream)
//   extra_bits_merge(w16, dtype, words, w32, n, k, grid, rounding, device, stream)
//   extra_bits_step(opt, dtype, k, grid, rounding, state_dtype, hyper, seed, slots, found_inf,
//                   grad_scale, counts, device, stream)
// grid: () for the 16-bit type's own grid, or a weight format (e, m, b, specials, subnormals).
// slots: (w16, grad, words, state0, state1, state2, n, rand_element) per parameter; found_inf: a
// bool on the device that skips the step when true, or 0; grad_scale: a float32 loss scale on the
// device that divides the gradients (in float32), or 0; counts: an int64[4] buffer (overflow,
// underflow, nan, numel) of the weights' roundings, or 0.
#pragma once
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "def_contract.hpp"
#include "extra_bits_call.hpp"

namespace lowfp {

template <class T> T* as_ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

// A weight format from its tuple (e, m, b, specials, subnormals) into spec, or null for ().
inline const FormatSpec* grid_spec(const pybind11::tuple& grid, FormatSpec& spec) {
  if (grid.size() == 0) return nullptr;
  if (grid.size() != 5) throw std::invalid_argument("grid must be () or (e, m, b, specials, subnormals)");
  spec = FormatSpec{grid[0].cast<int32_t>(), grid[1].cast<int32_t>(), grid[2].cast<int32_t>(),
                    Specials(grid[3].cast<int32_t>()), grid[4].cast<bool>()};
  return &spec;
}

// The extra-bits parameters of weights of dtype code `weights` rounded by rounding code
// `rounding` to their grid (grid_spec), the codes checked.
inline ExtraBitsParams extra_bits_params(int32_t weights, int32_t k, const pybind11::tuple& grid,
                                         int32_t rounding) {
  if (weights < 0 || weights > 3 || rounding < 0 || rounding > 5)
    throw std::invalid_argument("bad dtype or rounding code");
  FormatSpec spec;
  return make_extra_bits_params(DType(weights), k, Rounding(rounding), grid_spec(grid, spec));
}

// slots: (w16, grad, words, state0, state1, state2, n, rand_element) per parameter.
// hyper: the module's SgdHyper (opt 0) or AdamHyper (opt 1).
inline ExtraBitsStep make_extra_bits_step(int32_t opt, int32_t weights, int32_t k,
                                          const pybind11::tuple& grid, int32_t rounding,
                                          int32_t state, const pybind11::object& hyper, uint64_t seed,
                                          const pybind11::list& slots) {
  ExtraBitsStep s{};
  if (state < 0 || state > 3) throw std::invalid_argument("bad dtype code");
  s.e = extra_bits_params(weights, k, grid, rounding);
  s.mode = Rounding(rounding);
  s.weights = DType(weights);
  s.state = DType(state);
  if (s.state != DType::Float32 && s.state != DType::BFloat16)
    throw std::invalid_argument("state dtype must be float32 or bfloat16");
  s.seed = seed;
  if (opt == 0) {
    s.opt = OptimKind::Sgd;
    s.sgd = hyper.cast<SgdHyper>();
    s.has_momentum = s.sgd.has_momentum;
  } else if (opt == 1) {
    s.opt = OptimKind::Adam;
    s.adam = hyper.cast<AdamHyper>();
  } else {
    throw std::invalid_argument("bad optimizer code");
  }
  for (const auto& item : slots) {
    const pybind11::tuple t = item.cast<pybind11::tuple>();
    s.slots.push_back({as_ptr<void>(t[0].cast<uintptr_t>()), as_ptr<const void>(t[1].cast<uintptr_t>()),
                       as_ptr<uint32_t>(t[2].cast<uintptr_t>()), as_ptr<void>(t[3].cast<uintptr_t>()),
                       as_ptr<void>(t[4].cast<uintptr_t>()), as_ptr<void>(t[5].cast<uintptr_t>()),
                       t[6].cast<int64_t>(), t[7].cast<uint64_t>()});
  }
  return s;
}


template <class Split, class Merge, class Step>
void def_extra_bits(pybind11::module_& mod, Split split, Merge merge, Step step) {
  mod.def("extra_bits_split", [split](uintptr_t w32, uintptr_t w16, int32_t weights, uintptr_t words,
                                      int64_t n, int32_t k, const pybind11::tuple& grid,
                                      int32_t rounding, uint64_t seed, uint64_t offset,
                                      uintptr_t counts, int32_t device, uintptr_t stream) {
    const ExtraBitsParams e = extra_bits_params(weights, k, grid, rounding);
    const ExtraBitsSplit a{as_ptr<const float>(w32), as_ptr<void>(w16), as_ptr<uint32_t>(words), n,
                           seed, offset};
    pybind11::gil_scoped_release release;
    split(e, Rounding(rounding), a, as_ptr<int64_t>(counts), device, stream);
  });
  mod.def("extra_bits_merge", [merge](uintptr_t w16, int32_t weights, uintptr_t words, uintptr_t w32,
                                      int64_t n, int32_t k, const pybind11::tuple& grid,
                                      int32_t rounding, int32_t device, uintptr_t stream) {
    const ExtraBitsParams e = extra_bits_params(weights, k, grid, rounding);
    const ExtraBitsMerge a{as_ptr<const void>(w16), as_ptr<const uint32_t>(words), as_ptr<float>(w32), n};
    pybind11::gil_scoped_release release;
    merge(e, a, device, stream);
  });
  mod.def("extra_bits_step", [step](int32_t opt, int32_t weights, int32_t k,
                                    const pybind11::tuple& grid, int32_t rounding, int32_t state,
                                    const pybind11::object& hyper, uint64_t seed,
                                    const pybind11::list& slots, uintptr_t found_inf,
                                    uintptr_t grad_scale, uintptr_t counts, int32_t device,
                                    uintptr_t stream) {
    ExtraBitsStep s =
        make_extra_bits_step(opt, weights, k, grid, rounding, state, hyper, seed, slots);
    s.found_inf = as_ptr<const bool>(found_inf);
    s.grad_scale = as_ptr<const float>(grad_scale);
    pybind11::gil_scoped_release release;
    step(s, as_ptr<int64_t>(counts), device, stream);
  });
}

}  // namespace lowfp
