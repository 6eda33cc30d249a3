// lowfp._C: the CPU core. Python passes raw buffers (data_ptr, element count, dtype code);
// argument checking with user-facing messages happens in python/lowfp.
#include <pybind11/pybind11.h>

#include "accumulate_cpu.hpp"
#include "def_accumulate.hpp"
#include "def_bound_round.hpp"
#include "def_emulate.hpp"
#include "def_extra_bits.hpp"
#include "def_intercept.hpp"
#include "def_quantize.hpp"
#include "def_scaled.hpp"
#include "driver.hpp"
#include "extra_bits_cpu.hpp"
#include "lowfp/philox.hpp"
#include "quantize_cpu.hpp"
#include "rounding_kernels.hpp"
#include "s2fp8_cpu.hpp"
#include "scaled_cpu.hpp"

namespace py = pybind11;
using namespace lowfp;

namespace {

py::dict format_info(int32_t e, int32_t m, int32_t b, int32_t specials, bool subnormals) {
  if (specials < 0 || specials >= kSpecialsCodes) throw std::invalid_argument("bad specials code");
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

// The kernels' entry points with the CUDA module's signatures (device and stream unused here).
void run_quantize(const QuantizeCall& call, int64_t* counts, int, uintptr_t) { quantize_cpu(call, counts); }
void run_scaled(const ScaledCall& call, const ScaledCpuForms& forms, double* tensor_scale, int64_t* counts, int,
                uintptr_t) {
  scaled_cpu(call, forms, tensor_scale, counts);
}

using CpuRounding = ModuleRounding<ScaledCpuForms, &run_quantize, &run_scaled>;

}  // namespace

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "lowfp CPU core (raw-buffer interface; use the lowfp package)";
  def_contract(mod);
  lowfp::intercept::def_intercept(mod);
  lowfp::emulate_round::def_emulate(mod);
  mod.def("format_info", &format_info);
  mod.attr("S2FP8_SUM_SIZE") = int(kSumSize);  // int64 accumulators an s2fp8 call writes
  def_quantize(mod, &run_quantize);
  lowfp::bound_round::def_bound_round(mod, CpuRounding::kernels);
  def_s2fp8(mod, [](const S2fp8Call& call, int64_t* sums, double* params, int64_t* counts,
                    int32_t, uintptr_t) { s2fp8_cpu(call, sums, params, counts); });
  auto prepared_scaled = def_scaled<ScaledCpuForms>(mod, &prepare_scaled_cpu, &run_scaled);
  // The CPU's element strategy (cpp/src/cpu/scaled/plan.hpp) for a counted call of this request
  // on blocks block_cols wide, with or without its elements q: {"strategy": the one it takes,
  // "allowed": those it allows, "count_by_comparison": bool}. For tests and benchmarks.
  prepared_scaled.def(
      "cpu_plan",
      [](const PreparedScaled<ScaledCpuForms>& p, int64_t block_cols, bool parts) {
        float x = 0.0f, y = 0.0f, q = 0.0f;
        double scale = 0.0;
        const ScaledCall call = with_buffers(p.call, &x, &y, 1, 1, 1, block_cols, 0, 0, 0, &scale,
                                             parts ? &q : nullptr, 4);
        const ScaledPlan plan = plan_scaled(call, p.forms);
        const uint32_t allowed = scaled_strategies(call, p.forms);
        py::list names;
        for (int32_t i = 0; i < kScaledStrategies; ++i)
          if (allowed & (uint32_t(1) << i)) names.append(scaled_strategy_name(ScaledStrategy(i)));
        py::dict d;
        d["strategy"] = scaled_strategy_name(plan.strategy);
        d["allowed"] = names;
        d["count_by_comparison"] = plan.count_by_comparison;
        return d;
      },
      py::kw_only(), py::arg("block_cols"), py::arg("parts"));
  // Forces the CPU's element strategy of every later scaled call that allows it (None: each
  // call's own plan); LOWFP_SCALED_STRATEGY sets it at load. For tests and benchmarks.
  mod.def("force_scaled_strategy", [](std::optional<std::string> name) {
    ScaledStrategy s = ScaledStrategy::Float64;
    if (name && !scaled_strategy_named(name->c_str(), s))
      throw std::invalid_argument("no scaled strategy named '" + *name +
                                  "': float64, checked, narrow, lanes or few");
    force_scaled_strategy(name ? int32_t(s) : -1);
  }, py::arg("name"));
  mod.def("forced_scaled_strategy", []() -> std::optional<std::string> {
    const int32_t s = forced_scaled_strategy();
    if (s < 0) return std::nullopt;
    return std::string(scaled_strategy_name(ScaledStrategy(s)));
  });
  def_hadamard(mod, [](const HadamardCall& call, int32_t, uintptr_t) { hadamard_cpu(call); });
  def_accumulate(mod, [](const AccumulateCall& call, int64_t* counts, int32_t, uintptr_t) {
    accumulate_cpu(call, counts);
  });
  def_extra_bits(
      mod,
      [](const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a, int64_t* counts, int32_t,
         uintptr_t) { add_counts(extra_bits_split_cpu(e, mode, a), a.n, counts); },
      [](const ExtraBitsParams& e, const ExtraBitsMerge& a, int32_t, uintptr_t) {
        extra_bits_merge_cpu(e, a);
      },
      [](const ExtraBitsStep& s, int64_t* counts, int32_t, uintptr_t) {
        if (s.found_inf != nullptr && *s.found_inf) return;  // as step_kernel does on the GPU
        int64_t n = 0;
        for (const ExtraBitsSlot& slot : s.slots) n += slot.n;
        add_counts(extra_bits_step_cpu(s), n, counts);
      });
  // Writes whether any element of a float16/bfloat16/float32/float64 buffer is inf or NaN
  // to the bool at out, and adds it (0 or 1) to each of the n_counts int64 at counts.
  mod.def("any_non_finite", [](uintptr_t x, int32_t dtype, int64_t n, uintptr_t out,
                               uintptr_t counts, int64_t n_counts) {
    if (dtype < 0 || dtype > 3) throw std::invalid_argument("bad dtype code");
    pybind11::gil_scoped_release release;
    const bool found = any_non_finite_cpu(DType(dtype), reinterpret_cast<const void*>(x), n);
    *reinterpret_cast<bool*>(out) = found;
    for (int64_t i = 0; i < n_counts; ++i) reinterpret_cast<int64_t*>(counts)[i] += found;
  });
  // count_unchanged_cpu: the counts of a rounding that returns the n elements at x unchanged
  // (their NaNs, their number) added to the int64[4] at counts.
  mod.def("count_unchanged", [](uintptr_t x, int32_t dtype, int64_t n, uintptr_t counts) {
    if (dtype < 0 || dtype > 3) throw std::invalid_argument("bad dtype code");
    if (n < 0) throw std::invalid_argument("negative element count");
    pybind11::gil_scoped_release release;
    count_unchanged_cpu(DType(dtype), reinterpret_cast<const void*>(x), n,
                        reinterpret_cast<int64_t*>(counts));
  });
  // Reorders packed extra bits (extra_bits_gather_cpu): element i of dst = element index[i] of
  // src. Rare (a parameter's layout changed), so the CPU alone; the caller checked the indices.
  mod.def("extra_bits_gather", [](uintptr_t src, uintptr_t index, int64_t n, uint32_t q,
                                  uintptr_t dst) {
    if (q < 1 || q > kMaxPackedBits) throw std::invalid_argument("bad bits per element");
    pybind11::gil_scoped_release release;
    extra_bits_gather_cpu(as_ptr<const uint32_t>(src), as_ptr<const int64_t>(index), n, q,
                          as_ptr<uint32_t>(dst));
  });
  // Adds value to the float32 at each address: Adam's step counts (one-element CPU tensors) in
  // one call, where torch._foreach_add_ dispatches an add per tensor.
  mod.def("add_to_float32s", [](const py::list& addresses, float value) {
    for (const py::handle a : addresses) *reinterpret_cast<float*>(a.cast<uintptr_t>()) += value;
  });
  mod.def("philox4x32_10", &philox);
  // The deterministic log2/exp2 that S2FP8 uses (tests compare them with float64 references).
  mod.def("log2_det", [](double x) { return log2_det(x); });
  mod.def("exp2_det", [](double t) { return exp2_det(t); });
  // The CPU Adam step's vector square root (extra_bits_call.hpp): the address of a function with
  // vmsSqrt's signature and its mode argument, or 0 for std::sqrt.
  mod.def("set_cpu_sqrt", [](uintptr_t fn, int64_t mode) {
    set_cpu_sqrt({reinterpret_cast<VectorSqrt>(fn), mode});
  });
  mod.def("set_num_threads", &set_num_threads);
  mod.def("set_default_threads", &set_default_threads);
  mod.def("get_num_threads", &get_num_threads);
  mod.def("cpu_kernel", &cpu_kernel_name);
}
