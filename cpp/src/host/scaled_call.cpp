#include "scaled_call.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

namespace lowfp {

namespace {

// rounds(v, ev): E's nearest rounding of v (p: E, nearest), its events in ev.
struct NearestOf {
  const RoundParams<uint64_t>& p;
  double operator()(double v, RoundEvents& ev) const {
    return bit_cast<double>(round_bits<RoundKind::Nearest, uint64_t, true>(bit_cast<uint64_t>(v), p, 0u, ev));
  }
};

// E's event points (EventPoints), each checked against round_bits on both sides of it; false
// when one is not where the midpoint rule puts it.
bool event_points(const FormatSpec& e, const RoundParams<uint64_t>& p, EventPoints& out) {
  const NearestOf rounds{p};
  RoundEvents below, above, at;
  const double smallest = std::ldexp(1.0, smallest_exponent(e));
  out.mu_zero = smallest / 2;
  if (rounds(std::nextafter(out.mu_zero, 0.0), below) != 0.0 ||
      rounds(std::nextafter(out.mu_zero, HUGE_VAL), above) != smallest)
    return false;
  out.up_zero = rounds(out.mu_zero, at) != 0.0;
  const double top = max_value(e);
  const double next = top + std::ldexp(1.0, floor_log2(top) - e.m);  // E's grid continued
  out.mu_over = (top + next) / 2;
  rounds(std::nextafter(out.mu_over, 0.0), below);
  rounds(std::nextafter(out.mu_over, HUGE_VAL), above);
  rounds(out.mu_over, at);
  if (below.above_max || !above.above_max) return false;
  out.up_over = at.above_max;
  return true;
}

// E's magnitudes and nearest rounding's decision points between them (p: E, nearest), each
// checked against round_bits on both sides of it; n = 0 when E has more than kFewMagnitudes
// magnitudes or a decision point is not where the midpoint rule puts it.
FewMagnitudes few_magnitudes(const FormatSpec& e, const RoundParams<uint64_t>& p) {
  FewMagnitudes f{};
  if (e.e + e.m > 3) return f;  // (at most 8 codes of each sign)
  const double top = max_value(e);
  int32_t n = 0;
  for (int32_t code = 0; code < (1 << (e.e + e.m)); ++code) {  // ascending values
    const int32_t ec = code >> e.m, mc = code & ((1 << e.m) - 1);
    double v;
    if (ec == 0) {
      if (!e.subnormals && mc != 0) continue;
      v = std::ldexp(double(mc), min_exponent(e) - e.m);
    } else {
      v = std::ldexp(double((1 << e.m) + mc), ec - exponent_bias(e) - e.m);
    }
    if (v > top) break;
    f.g[n++] = v;
  }
  const NearestOf rounds{p};
  RoundEvents ev;
  for (int32_t k = 0; k + 1 < kFewMagnitudes; ++k) {
    f.mu[k] = HUGE_VAL;
    if (k + 1 >= n) continue;
    const double mu = (f.g[k] + f.g[k + 1]) / 2;  // exact
    if (rounds(std::nextafter(mu, 0.0), ev) != f.g[k] || rounds(std::nextafter(mu, HUGE_VAL), ev) != f.g[k + 1])
      return FewMagnitudes{};
    f.mu[k] = mu;
    f.up[k] = rounds(mu, ev) == f.g[k + 1];
  }
  EventPoints points;
  if (!event_points(e, p, points)) return FewMagnitudes{};
  f.mu_over = points.mu_over;
  f.up_over = points.up_over;
  f.n = n;
  return f;
}

}  // namespace

ScaledCall prepare_scaled_call(const ScaledRequest& r) {
  auto in_range = [](int32_t v, int32_t lo, int32_t hi) { return v >= lo && v <= hi; };
  if (!in_range(int32_t(r.element.specials), 0, kSpecialsCodes - 1) ||
      !in_range(int32_t(r.scale_format.specials), 0, kSpecialsCodes - 1))
    throw std::invalid_argument("bad specials code");
  if (!in_range(int32_t(r.overflow), 0, 2)) throw std::invalid_argument("bad overflow code");
  if (!in_range(int32_t(r.mode), 0, 5)) throw std::invalid_argument("bad rounding code");
  if (!in_range(int32_t(r.dtype), 0, 3)) throw std::invalid_argument("bad dtype code");
  if (!in_range(int32_t(r.rule), 0, 4)) throw std::invalid_argument("bad scale rule code");
  if (!in_range(r.sr_bits, 1, 32))
    throw std::invalid_argument("sr_bits must be between 1 and 32, got " + std::to_string(r.sr_bits));
  for (const FormatSpec* f : {&r.element, &r.scale_format}) {
    if (f == &r.scale_format && r.rule != ScaleRule::Format) continue;
    const std::string bad = spec_error(*f);
    if (!bad.empty()) throw std::invalid_argument(bad);
    const std::string wide = fit_error(*f, DType::Float32);
    if (!wide.empty()) throw std::invalid_argument(wide);
  }
  if (r.element.m > kScaledMaxElementMantissa)
    throw std::invalid_argument("scaled formats take elements of at most " +
                                std::to_string(kScaledMaxElementMantissa) + " mantissa bits");
  ScaledCall c{};
  c.dtype = r.dtype;
  c.scale.rule = r.rule;
  c.scale.emax_e = max_exponent(r.element);
  c.scale.max_e = max_value(r.element);
  c.scale.m_e = r.element.m;
  if (r.rule == ScaleRule::Format) {
    c.scale.s = make_round_params<uint64_t>(r.scale_format, Overflow::Saturate, Rounding::Nearest, 32);
    c.scale.s_smallest = std::ldexp(1.0, smallest_exponent(r.scale_format));
    c.scale.s_max = max_value(r.scale_format);
    c.scale.s_cap = max_exponent(r.scale_format) + 1;
    c.scale.by_addition = nearest_by_addition(c.scale.s, c.scale.s_cap);
    // a: the input's bits; max_E · t: E's significand bits, and t's 24
    c.scale.divide_once = nearest_divides_once(r.scale_format.m, r.element.m + 1 + 24, r.dtype);
  }
  c.tensor_scale = r.tensor_scale;
  if (r.tensor_scale && r.rule != ScaleRule::Format)
    throw std::invalid_argument("a tensor scale goes with block scales in a format");
  c.p = make_round_params<uint64_t>(r.element, r.overflow, r.mode, r.sr_bits);
  if (r.dtype == DType::Float16 || r.dtype == DType::BFloat16) {
    const FormatSpec store = r.dtype == DType::Float16 ? FormatSpec{5, 10, 0, Specials::IEEE, true}
                                                       : FormatSpec{8, 7, 0, Specials::IEEE, true};
    c.out = make_round_params<uint64_t>(store, Overflow::Inf, Rounding::Nearest, 32);
  }
  c.narrow = r.rule != ScaleRule::Format && r.dtype != DType::Float64 &&
             smallest_exponent(r.element) >= -22;
  const FormatSpec& e = r.element;
  const FormatSpec& sf = r.scale_format;
  const bool exact_product =  // q · S: at most 24 significand bits, within float32's normal range
      !r.tensor_scale || (e.m + sf.m + 2 <= 24 && smallest_exponent(e) + smallest_exponent(sf) >= -126 &&
                          max_exponent(e) + max_exponent(sf) + 2 <= 127);
  c.checked = r.rule == ScaleRule::Format && r.dtype == DType::Float32 && r.mode == Rounding::Nearest &&
              smallest_exponent(e) >= -22 && e.m <= 18 && exact_product;
  if (c.narrow || c.checked) {
    c.p32 = make_round_params<uint32_t>(r.element, r.overflow, r.mode, r.sr_bits);
    if (r.dtype == DType::Float16 || r.dtype == DType::BFloat16) {
      const FormatSpec store = r.dtype == DType::Float16 ? FormatSpec{5, 10, 0, Specials::IEEE, true}
                                                         : FormatSpec{8, 7, 0, Specials::IEEE, true};
      c.out32 = make_round_params<uint32_t>(store, Overflow::Inf, Rounding::Nearest, 32);
    }
  }
  c.addition_cap = max_exponent(r.element) + 1;
  c.nearest_by_addition =
      r.mode == Rounding::Nearest && (c.narrow ? nearest_by_addition(c.p32, c.addition_cap)
                                               : nearest_by_addition(c.p, c.addition_cap));
  c.checked = c.checked && nearest_by_addition(c.p32, c.addition_cap);
  c.t = 1.0;
  // s = S · t: S's significand bits, and the float32 tensor scale's 24
  const int32_t scale_bits = r.scale_format.m + 1 + (r.tensor_scale ? 24 : 0);
  c.divide_once = round_kind(r.mode) == RoundKind::Nearest && r.rule == ScaleRule::Format &&
                  nearest_divides_once(r.element.m, scale_bits, r.dtype);
  const bool saturates = !c.p.inf_stays_inf && c.p.overflow_pos == c.p.max_bits;
  c.few = r.rule == ScaleRule::Format && r.dtype == DType::Float32 && r.mode == Rounding::Nearest &&
          saturates && !c.p.no_negative_zero && e.m + 2 + scale_bits <= 53;  // (mu: m + 2 bits)
  if (c.few) {
    c.magnitudes = few_magnitudes(e, c.p);
    c.few = c.magnitudes.n >= 2;
  }
  if (c.few) {
    c.few_key_shift = 52 - r.scale_format.m;
    c.few_key0 = int64_t(bit_cast<uint64_t>(c.scale.s_smallest) >> c.few_key_shift);
    c.few_keys = int64_t(bit_cast<uint64_t>(c.scale.s_max) >> c.few_key_shift) - c.few_key0 + 1;
    if (c.few_keys > kFewKeys) c.few_keys = 0;
  }
  // (mu: at most m + 2 significant bits; power-of-two scales add none)
  c.count_by_comparison = r.dtype == DType::Float32 && round_kind(r.mode) == RoundKind::Nearest &&
                          (r.rule != ScaleRule::Format || e.m + 2 + scale_bits <= 53) &&
                          event_points(e, c.p, c.events);
  c.mode = r.mode;
  return c;
}

ScaledCall with_buffers(ScaledCall c, const void* x, void* y, int64_t rows, int64_t cols,
                        int64_t block_rows, int64_t block_cols, uint64_t seed, uint64_t offset,
                        double* scales, float* q, int32_t counts_size) {
  if (rows < 0 || cols < 0 || block_rows < 1 || block_cols < 1)
    throw std::invalid_argument("bad shape or block");
  if (counts_size != 0 && counts_size != 4 && counts_size != 6)
    throw std::invalid_argument("a scaled rounding's counts buffer holds 4 or 6 counts");
  if (scales == nullptr) throw std::invalid_argument("scaled_quantize needs a scales buffer");
  c.x = x;
  c.y = y;
  c.rows = rows;
  c.cols = cols;
  c.block_rows = block_rows;
  c.block_cols = block_cols;
  c.seed = seed;
  c.offset = offset;
  c.scales = scales;
  c.q = q;
  c.count = counts_size != 0;
  c.count_blocks = counts_size == 6;
  return c;
}

}  // namespace lowfp
