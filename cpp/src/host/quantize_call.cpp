#include "quantize_call.hpp"

#include "lowfp/round.hpp"

#include <stdexcept>

namespace lowfp {

QuantizeCall make_quantize_call(const QuantizeRequest& r, const void* x, void* y, int64_t n,
                                bool count) {
  auto in_range = [](int32_t v, int32_t lo, int32_t hi) { return v >= lo && v <= hi; };
  if (!in_range(int32_t(r.spec.specials), 0, kSpecialsCodes - 1)) throw std::invalid_argument("bad specials code");
  if (!in_range(int32_t(r.overflow), 0, 2)) throw std::invalid_argument("bad overflow code");
  if (!in_range(int32_t(r.mode), 0, 5)) throw std::invalid_argument("bad rounding code");
  if (!in_range(int32_t(r.x_dtype), 0, 3) || !in_range(int32_t(r.y_dtype), 0, 3))
    throw std::invalid_argument("bad dtype code");
  if (!in_range(r.sr_bits, 1, 32))
    throw std::invalid_argument("sr_bits must be between 1 and 32, got " + std::to_string(r.sr_bits));
  if (n < 0) throw std::invalid_argument("negative element count");
  const std::string bad = spec_error(r.spec);
  if (!bad.empty()) throw std::invalid_argument(bad);

  QuantizeCall c{};
  c.x = x;
  c.y = y;
  c.n = n;
  c.x_dtype = r.x_dtype;
  c.y_dtype = r.y_dtype;
  c.wide = r.x_dtype == DType::Float64 || r.y_dtype == DType::Float64;
  const DType carrier = c.wide ? DType::Float64 : DType::Float32;
  for (DType t : {carrier, r.y_dtype}) {
    const std::string e = fit_error(r.spec, t);
    if (!e.empty()) throw std::invalid_argument(e);
  }
  if (c.wide)
    c.p64 = make_round_params<uint64_t>(r.spec, r.overflow, r.mode, r.sr_bits);
  else
    c.p32 = make_round_params<uint32_t>(r.spec, r.overflow, r.mode, r.sr_bits);
  c.addition_cap = max_exponent(r.spec) + 1;
  c.nearest_by_addition = !c.wide && r.mode == Rounding::Nearest &&
                          nearest_by_addition(c.p32, c.addition_cap);
  c.symmetric_overflow = c.wide ? symmetric_overflow(c.p64) : symmetric_overflow(c.p32);
  c.stochastic_by_steps = r.mode == Rounding::Stochastic && c.symmetric_overflow &&
                          (c.wide ? stochastic_by_steps(c.p64) : stochastic_by_steps(c.p32));
  const FormatSpec bf16 = storage_spec(DType::BFloat16);
  c.bfloat16_by_bits = !c.wide && r.x_dtype == DType::Float32 &&
                       (r.y_dtype == DType::Float32 || r.y_dtype == DType::BFloat16) &&
                       r.spec.e == bf16.e && r.spec.m == bf16.m && r.spec.b == bf16.b &&
                       r.spec.specials == bf16.specials && r.spec.subnormals == bf16.subnormals &&
                       r.overflow == Overflow::Inf && c.p32.fixed_drop &&
                       (r.mode == Rounding::Nearest || (r.mode == Rounding::Stochastic && r.sr_bits == 32));
  c.mode = r.mode;
  c.seed = r.seed;
  c.offset = r.offset;
  c.count = count;
  return c;
}

S2fp8Call make_s2fp8_call(const QuantizeRequest& r, double log_max, const void* x, void* y,
                          int64_t n, bool count) {
  if (r.x_dtype != r.y_dtype) throw std::invalid_argument("S2FP8 writes x's own dtype");
  if (!(log_max > 0 && log_max < 1e300)) throw std::invalid_argument("log_max must be finite and > 0");
  QuantizeRequest wide = r;  // Y is rounded in float64 whatever x's dtype
  wide.x_dtype = wide.y_dtype = DType::Float64;
  S2fp8Call c{make_quantize_call(wide, x, y, n, count), log_max, {}};
  c.q.x_dtype = c.q.y_dtype = r.x_dtype;
  if (r.x_dtype == DType::Float16 || r.x_dtype == DType::BFloat16) {
    c.p_store = make_round_params<uint64_t>(storage_spec(r.x_dtype), Overflow::Inf, Rounding::Nearest, 32);
  }
  return c;
}

}  // namespace lowfp
