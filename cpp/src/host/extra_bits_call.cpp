#include "extra_bits_call.hpp"

#include <atomic>
#include <stdexcept>
#include <string>

namespace lowfp {
namespace {

RoundParams<uint32_t> folded_float16_params(Rounding mode) {
  switch (mode) {
    case Rounding::TowardZero: return float16_round_params<RoundKind::TowardZero>();
    case Rounding::Stochastic: return float16_round_params<RoundKind::Stochastic>();
    default: return float16_round_params<RoundKind::Nearest>();
  }
}

bool same_round_params(const RoundParams<uint32_t>& a, const RoundParams<uint32_t>& b) {
  return a.normal_drop == b.normal_drop && a.below_drop == b.below_drop && a.emin == b.emin &&
         a.below_step == b.below_step && a.max_bits == b.max_bits &&
         a.overflow_pos == b.overflow_pos && a.overflow_neg == b.overflow_neg &&
         a.inf_stays_inf == b.inf_stays_inf && a.no_negative_zero == b.no_negative_zero &&
         a.ties_away == b.ties_away && a.parity_bias == b.parity_bias &&
         a.parity_mask == b.parity_mask && a.away_pos == b.away_pos && a.away_neg == b.away_neg &&
         a.sr_shift == b.sr_shift && a.subnormal_exponent == b.subnormal_exponent &&
         a.fixed_drop == b.fixed_drop;
}

std::atomic<VectorSqrt> g_sqrt_fn{nullptr};
std::atomic<int64_t> g_sqrt_mode{0};

}  // namespace

void set_cpu_sqrt(CpuSqrt root) {
  g_sqrt_mode.store(root.mode);
  g_sqrt_fn.store(root.fn);
}

CpuSqrt cpu_sqrt() { return {g_sqrt_fn.load(), g_sqrt_mode.load()}; }

ExtraBitsParams make_extra_bits_params(DType weights, int32_t k, Rounding mode,
                                       const FormatSpec* grid) {
  if (weights != DType::Float16 && weights != DType::BFloat16)
    throw std::invalid_argument("extra bits need float16 or bfloat16 weights");
  const bool bf16 = weights == DType::BFloat16;
  const int32_t k_max = bf16 || grid != nullptr ? 16 : 13;  // (a weight format: checked below)
  if (k < 1 || k > k_max)
    throw std::invalid_argument("k must be between 1 and " + std::to_string(k_max) + " for " +
                                (bf16 ? "bfloat16" : "float16") + ", got " + std::to_string(k));
  if (mode != Rounding::TowardZero && mode != Rounding::Nearest && mode != Rounding::Stochastic)
    throw std::invalid_argument("extra-bits rounding must be toward_zero, nearest or stochastic");
  const FormatSpec spec = storage_spec(weights);
  // split_bits rounds by round_to_bfloat16_bits / round_to_float16_bits, which fold in the
  // parameters make_round_params gives (overflow to inf, 32 random bits): check that they agree.
  const RoundParams<uint32_t> general = make_round_params<uint32_t>(spec, Overflow::Inf, mode, 32);
  if (bf16 ? !general.fixed_drop : !same_round_params(general, folded_float16_params(mode)))
    throw std::logic_error("extra bits: the folded rounding parameters disagree with the format's");
  ExtraBitsParams e{};
  const FormatSpec& g = grid != nullptr ? *grid : spec;
  e.m16 = g.m;
  e.emin16 = min_exponent(g);
  e.emax16 = max_exponent(g);
  e.k = uint32_t(k);
  e.q = uint32_t(k) + (mode == Rounding::TowardZero ? 0u : 1u);
  e.bf16 = bf16;
  e.grid = grid != nullptr;
  e.below_ulp_exp = smallest_exponent(g);
  e.top_bits = bit_cast<uint32_t>(float(max_value(g))) + (1u << (23 - g.m));
  if (e.grid) {
    // F's values are the 16-bit type's (checked in Python); what the kernels assume of it:
    if (g.m + k > 23)
      throw std::invalid_argument("a weight format's fraction bits plus k must be at most 23");
    if (e.below_ulp_exp - k < -126)
      throw std::invalid_argument("a weight format's smallest step over 2^k must be at least "
                                  "2^-126: use fewer extra bits");
    e.f = make_round_params<uint32_t>(g, Overflow::Saturate, mode, 32);
    if (e.f.subnormal_exponent)
      throw std::invalid_argument("a weight format must have emin above float32's");
  }
  return e;
}

}  // namespace lowfp
