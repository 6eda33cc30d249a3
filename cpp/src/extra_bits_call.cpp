#include "extra_bits_call.hpp"

#include <stdexcept>
#include <string>

namespace lowfp {

ExtraBitsParams make_extra_bits_params(DType weights, int32_t k, Rounding mode) {
  if (weights != DType::Float16 && weights != DType::BFloat16)
    throw std::invalid_argument("extra bits need float16 or bfloat16 weights");
  const bool bf16 = weights == DType::BFloat16;
  const int32_t k_max = bf16 ? 16 : 13;
  if (k < 1 || k > k_max)
    throw std::invalid_argument("k must be between 1 and " + std::to_string(k_max) + " for " +
                                (bf16 ? "bfloat16" : "float16") + ", got " + std::to_string(k));
  if (mode != Rounding::TowardZero && mode != Rounding::Nearest && mode != Rounding::Stochastic)
    throw std::invalid_argument("extra-bits rounding must be toward_zero, nearest or stochastic");
  const FormatSpec spec = bf16 ? FormatSpec{8, 7, 0, Specials::IEEE, true}
                               : FormatSpec{5, 10, 0, Specials::IEEE, true};
  ExtraBitsParams e{};
  e.round = make_round_params<uint32_t>(spec, Overflow::Inf, mode, 32);
  // split_bits rounds float16 by e.round, and bfloat16 by round_to_bfloat16_bits, which folds in
  // the parameters e.round has for it (a fixed drop of 16 bits, overflow to inf, 32 random bits).
  if (e.round.fixed_drop != bf16) throw std::logic_error("extra bits: unexpected rounding grid");
  e.m16 = spec.m;
  e.emin16 = min_exponent(spec);
  e.emax16 = max_exponent(spec);
  e.k = uint32_t(k);
  e.q = uint32_t(k) + (mode == Rounding::TowardZero ? 0u : 1u);
  e.bf16 = bf16;
  return e;
}

}  // namespace lowfp
