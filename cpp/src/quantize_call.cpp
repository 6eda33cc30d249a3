#include "quantize_call.hpp"

#include <stdexcept>

namespace lowfp {

QuantizeCall make_quantize_call(const QuantizeRequest& r, const void* x, void* y, int64_t n,
                                bool count) {
  auto in_range = [](int32_t v, int32_t lo, int32_t hi) { return v >= lo && v <= hi; };
  if (!in_range(int32_t(r.spec.specials), 0, 3)) throw std::invalid_argument("bad specials code");
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
  c.mode = r.mode;
  c.seed = r.seed;
  c.offset = r.offset;
  c.count = count;
  return c;
}

}  // namespace lowfp
