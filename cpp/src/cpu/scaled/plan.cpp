#include "scaled/plan.hpp"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

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

const char* const kNames[kScaledStrategies] = {"float64", "checked", "narrow", "lanes", "few"};

std::atomic<int32_t>& forced() {
  static std::atomic<int32_t> s{[] {
    ScaledStrategy named;
    const char* want = std::getenv("LOWFP_SCALED_STRATEGY");
    return want != nullptr && scaled_strategy_named(want, named) ? int32_t(named) : -1;
  }()};
  return s;
}

uint32_t bit(ScaledStrategy s) { return uint32_t(1) << int32_t(s); }

}  // namespace

const char* scaled_strategy_name(ScaledStrategy s) { return kNames[int32_t(s)]; }

bool scaled_strategy_named(const char* name, ScaledStrategy& s) {
  for (int32_t i = 0; i < kScaledStrategies; ++i)
    if (std::strcmp(name, kNames[i]) == 0) {
      s = ScaledStrategy(i);
      return true;
    }
  return false;
}

void force_scaled_strategy(int32_t s) { forced().store(s >= 0 && s < kScaledStrategies ? s : -1); }

int32_t forced_scaled_strategy() { return forced().load(std::memory_order_relaxed); }

ScaledCpuForms prepare_scaled_cpu(const ScaledRequest& r, const ScaledCall& c) {
  ScaledCpuForms f{};
  const FormatSpec& e = r.element;
  const FormatSpec& sf = r.scale_format;
  const bool format_scales = r.rule == ScaleRule::Format;
  const bool nearest = r.mode == Rounding::Nearest;
  f.add32 = c.add32 && (c.narrow || c.checked);
  // s = S · t: S's significand bits, and the float32 tensor scale's 24
  const int32_t scale_bits = sf.m + 1 + (r.tensor_scale ? 24 : 0);
  const bool saturates = !c.p.inf_stays_inf && c.p.overflow_pos == c.p.max_bits;
  f.few = format_scales && r.dtype == DType::Float32 && nearest && saturates && !c.p.no_negative_zero &&
          e.m + 2 + scale_bits <= 53;  // (mu: m + 2 bits)
  if (f.few) {
    f.magnitudes = few_magnitudes(e, c.p);
    f.few = f.magnitudes.n >= 2;
  }
  if (f.few) {
    f.few_key_shift = 52 - sf.m;
    f.few_key0 = int64_t(bit_cast<uint64_t>(c.scale.s_smallest) >> f.few_key_shift);
    f.few_keys = int64_t(bit_cast<uint64_t>(c.scale.s_max) >> f.few_key_shift) - f.few_key0 + 1;
    if (f.few_keys > kFewKeys) f.few_keys = 0;
  }
  // (mu: at most m + 2 significant bits; power-of-two scales add none)
  f.count_by_comparison = r.dtype == DType::Float32 && round_kind(r.mode) == RoundKind::Nearest &&
                          (!format_scales || e.m + 2 + scale_bits <= 53) && event_points(e, c.p, f.events);
  return f;
}

uint32_t scaled_strategies(const ScaledCall& c, const ScaledCpuForms& f) {
  const bool float32_whole = c.dtype == DType::Float32 && c.q == nullptr;  // (no q to write)
  const RoundKind kind = round_kind(c.mode);
  uint32_t allowed = bit(ScaledStrategy::Float64);
  if (c.checked) allowed |= bit(ScaledStrategy::Checked);
  if (c.narrow) allowed |= bit(ScaledStrategy::Narrow);
  // (the vector loops round to nearest by addition, or stochastically by steps)
  if (c.narrow && float32_whole && ((kind == RoundKind::Stochastic && c.steps32) || f.add32))
    allowed |= bit(ScaledStrategy::Lanes);
  // (a block a whole number of vectors; the comparisons count as they round)
  if (f.few && f.count_by_comparison && float32_whole && (c.block_cols == 16 || c.block_cols == 32))
    allowed |= bit(ScaledStrategy::Few);
  return allowed;
}

ScaledPlan plan_scaled(const ScaledCall& c, const ScaledCpuForms& f) {
  const uint32_t allowed = scaled_strategies(c, f);
  const uintptr_t bytes = uintptr_t(c.rows * c.cols) * uintptr_t(dtype_size(c.dtype));
  ScaledPlan plan{};
  plan.in_place = !(uintptr_t(c.x) + bytes <= uintptr_t(c.y) || uintptr_t(c.y) + bytes <= uintptr_t(c.x));
  const int32_t want = forced_scaled_strategy();
  if (want >= 0 && (allowed & bit(ScaledStrategy(want)))) {
    plan.strategy = ScaledStrategy(want);
    return plan;
  }
  // The fastest first: no division at all (Few), then the float32 carrier in vectors, element by
  // element, checked; the float64 carrier where nothing else holds.
  for (ScaledStrategy s : {ScaledStrategy::Few, ScaledStrategy::Lanes, ScaledStrategy::Narrow,
                           ScaledStrategy::Checked, ScaledStrategy::Float64})
    if (allowed & bit(s)) {
      plan.strategy = s;
      break;
    }
  plan.count_by_comparison = c.count && f.count_by_comparison && plan.strategy != ScaledStrategy::Few &&
                             plan.strategy != ScaledStrategy::Lanes;
  return plan;
}

}  // namespace lowfp
