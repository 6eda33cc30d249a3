// The named contract between Python and both extension modules: the codes of formats, modes and
// dtypes as enums whose members carry their semantics (docs/design.md §2, §3, §5), and the
// optimizer hyperparameters as structs built by keyword. module_local: lowfp._C and lowfp._C_cuda
// each own their copy, and a struct is built by the module that takes it.
#pragma once
#include <pybind11/pybind11.h>

#include "lowfp/accumulate.hpp"
#include "lowfp/format.hpp"
#include "lowfp/optim_math.hpp"
#include "lowfp/scaled.hpp"

namespace lowfp {

inline void def_contract(pybind11::module_& mod) {
  namespace py = pybind11;
  py::enum_<Specials>(mod, "Specials", py::module_local(), "special-value conventions (§2)")
      .value("none", Specials::None, "every code is a finite number")
      .value("ieee", Specials::IEEE, "the top exponent code holds infinities and NaNs")
      .value("fn", Specials::FN, "only the all-ones code (both signs) is NaN, as OCP E4M3")
      .value("fnuz", Specials::FNUZ, "the values of 'none' without negative zero; -0's code is NaN")
      .value("p3109", Specials::P3109,
             "IEEE P3109's extended domain: the all-ones code is +-inf, -0's code NaN, no -0");
  py::enum_<Overflow>(mod, "Overflow", py::module_local(), "overflow policies (§3)")
      .value("saturate", Overflow::Saturate, "an overflow becomes +-max")
      .value("inf", Overflow::Inf,
             "as IEEE 754: +-inf for nearest and stochastic, +-max on the side a directed mode "
             "rounds toward zero; infinite inputs stay infinite")
      .value("nan", Overflow::NaN, "an overflow becomes NaN");
  py::enum_<Rounding>(mod, "Rounding", py::module_local(), "rounding modes (§3)")
      .value("nearest", Rounding::Nearest,
             "the nearer neighbour; a tie to the one whose encoding is even (with m = 0: whose "
             "exponent code is even)")
      .value("nearest_away", Rounding::NearestAway, "the nearer neighbour; a tie away from zero")
      .value("toward_zero", Rounding::TowardZero, "the neighbour nearer to zero")
      .value("up", Rounding::Up, "the neighbour toward +infinity")
      .value("down", Rounding::Down, "the neighbour toward -infinity")
      .value("stochastic", Rounding::Stochastic,
             "the upper neighbour with probability floor(f 2^R) / 2^R, f the fraction of the way "
             "to it, R random bits of Philox4x32-10 word i mod 4 of block offset + i / 4");
  py::enum_<DType>(mod, "DType", py::module_local(), "buffer dtypes")
      .value("float16", DType::Float16, "IEEE binary16")
      .value("bfloat16", DType::BFloat16, "bfloat16 (float32's top 16 bits)")
      .value("float32", DType::Float32, "IEEE binary32")
      .value("float64", DType::Float64, "IEEE binary64");
  py::enum_<ScaleRule>(mod, "ScaleRule", py::module_local(),
                       "how a block's scale follows from its largest finite magnitude a (§9)")
      .value("floor", ScaleRule::Floor, "e8m0 scale 2^k, k = floor(log2 a) - emax_E (OCP MX v1.0)")
      .value("ceil", ScaleRule::Ceil, "e8m0 scale 2^k, k = ceil(log2(a / max_E))")
      .value("rceil", ScaleRule::RCeil,
             "e8m0 scale 2^k, k = the exponent of float32(a / max_E) rounded up (cuBLAS)")
      .value("even", ScaleRule::Even,
             "e8m0 scale by floor after a is rounded to E's mantissa bits, ties away (torchao EVEN)")
      .value("nearest", ScaleRule::Format,
             "a scale in a format S: round_S(a / max_E) to nearest, saturating, never 0");
  py::enum_<BlockChoice>(mod, "BlockChoice", py::module_local(),
                         "which of a block's candidate scales it keeps (§9)")
      .value("fixed", BlockChoice::Fixed, "the scale rule's one scale")
      .value("four_over_six_mae", BlockChoice::FourOverSixMAE,
             "4over6: the scale mapping the block's amax to 6 or to 4, the smaller sum of |x - s q|")
      .value("four_over_six_mse", BlockChoice::FourOverSixMSE,
             "4over6: the scale mapping the block's amax to 6 or to 4, the smaller sum of (x - s q)^2");
  mod.attr("SCALED_MAX_ELEMENT_MANTISSA") = kScaledMaxElementMantissa;
  py::enum_<AccumulateOrder>(mod, "AccumulateOrder", py::module_local(),
                             "the order of a GEMM's additions for each output element (§10)")
      .value("sequential", AccumulateOrder::Sequential,
             "s_0 = +0, s_k = round(s_{k-1} + p_k) for k = 1..K")
      .value("pairwise", AccumulateOrder::Pairwise,
             "a tree whose left subtrees hold a power of two of leaves: round(p_k) at each leaf, "
             "round(left + right) at each node")
      .value("blocked", AccumulateOrder::Blocked,
             "blocks of `block` products summed sequentially, each block's sum added to an outer "
             "sum rounded to nearest in the outer format");
  mod.attr("ACCUMULATE_MAX_MANTISSA") = kAccumulateMaxMantissa;
  mod.attr("ACCUMULATE_MAX_GROUP") = kAccumulateMaxGroup;
  mod.attr("ACCUMULATE_MAX_ALIGN_BITS") = kAccumulateMaxAlignBits;
  py::class_<FormatSpec>(mod, "FormatSpec", py::module_local(),
                         "a format's encoding (§2): e exponent bits, m mantissa bits, extra bias b")
      .def(py::init([](int32_t e, int32_t m, int32_t b, Specials specials, bool subnormals) {
             return FormatSpec{e, m, b, specials, subnormals};
           }),
           py::kw_only(), py::arg("e"), py::arg("m"), py::arg("b"), py::arg("specials"),
           py::arg("subnormals"))
      .def_readonly("e", &FormatSpec::e)
      .def_readonly("m", &FormatSpec::m)
      .def_readonly("b", &FormatSpec::b)
      .def_readonly("specials", &FormatSpec::specials)
      .def_readonly("subnormals", &FormatSpec::subnormals);
  py::class_<SgdHyper>(mod, "SgdHyper", py::module_local(),
                       "one SGD step's scalars, each rounded to float32 as torch's kernels do")
      .def(py::init([](float neg_lr, float momentum, float one_minus_dampening, float weight_decay,
                       bool nesterov, bool maximize, bool first_step, bool has_momentum) {
             return SgdHyper{neg_lr, momentum, one_minus_dampening, weight_decay, nesterov,
                             maximize, first_step, has_momentum};
           }),
           py::kw_only(), py::arg("neg_lr"), py::arg("momentum"), py::arg("one_minus_dampening"),
           py::arg("weight_decay"), py::arg("nesterov"), py::arg("maximize"),
           py::arg("first_step"), py::arg("has_momentum"))
      .def_readonly("neg_lr", &SgdHyper::neg_lr)
      .def_readonly("momentum", &SgdHyper::momentum)
      .def_readonly("has_momentum", &SgdHyper::has_momentum);
  py::class_<AdamHyper>(mod, "AdamHyper", py::module_local(),
                        "one Adam/AdamW step's scalars, each rounded to float32 as torch's "
                        "kernels do")
      .def(py::init([](float decay, float weight_decay, float lerp_weight, float beta2,
                       float one_minus_beta2, float bias_correction2_sqrt, float eps,
                       float neg_step_size, bool decoupled, bool amsgrad, bool maximize,
                       bool cuda_association) {
             return AdamHyper{decay, weight_decay, lerp_weight, beta2, one_minus_beta2,
                              bias_correction2_sqrt, eps, neg_step_size, decoupled, amsgrad,
                              maximize, cuda_association};
           }),
           py::kw_only(), py::arg("decay"), py::arg("weight_decay"), py::arg("lerp_weight"),
           py::arg("beta2"), py::arg("one_minus_beta2"), py::arg("bias_correction2_sqrt"),
           py::arg("eps"), py::arg("neg_step_size"), py::arg("decoupled"), py::arg("amsgrad"),
           py::arg("maximize"), py::arg("cuda_association"))
      .def_readonly("neg_step_size", &AdamHyper::neg_step_size)
      .def_readonly("amsgrad", &AdamHyper::amsgrad)
      .def_readonly("cuda_association", &AdamHyper::cuda_association);
}

}  // namespace lowfp
