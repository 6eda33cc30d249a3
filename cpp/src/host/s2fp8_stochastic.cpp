// Builds the fast form of stochastic S2FP8 (lowfp/s2fp8_stochastic.hpp) for one call: the grid,
// the clamps, the ambiguity band and the table of x' per grid value.
//
// The band. Let t = alpha log2|x| + beta as the float64 path computes it and t~ the float32
// value s2fp8_fast_log_y computes. With d = log2|x| - c (c = -beta/alpha):
// - log2 f: absolute error below 2^-21 (s2fp8_log2_f32); c_frac rounded to float32: 2^-26;
//   (log2 f - c_frac), at most 1 in magnitude, rounded: 2^-25; the integer part added: |d| 2^-24.
//   So |d~ - d| <= eps_d = 2^-21 + 2^-25 + 2^-24 + |d| 2^-24 (rounded up), and |d| <= T / alpha where T bounds |t| on the
//   lanes not clamped (clamped lanes are certain, see t_min/t_max).
// - t~ = float(alpha) d~: alpha's rounding and the product's, 2^-24 |t| each.
// - The float64 path's own t: log2_det (a few ulp of |log2 x| <= 150), the two operations and c's
//   rounding: below 2^-48 (alpha 150 + |beta| + T).
// So |t~ - t| <= dt = alpha eps_d + 2^-23 T + that. g = 2^(t - binade + m) then has relative error
// ln 2 dt (1 + 2^-10) plus 2^-21 (s2fp8_exp2_f32) plus 2^-49 (exp2_det); g < 2^(m+1). w = g + r'
// adds r' truncated to its top 24 bits (below 2^-24) and its own rounding (half an ulp of
// w < 2^(m+2): 2^(m+1-24)). band_w is twice the sum, 2 dw.
//
// The binade. Where t is within dt of an integer B, floor(t~) may differ from the binade of the
// float64 path's Y, and g~ is then measured in the steps of the binade on the other side of 2^B.
// Before the floor, the index is (binade - emin) 2^m + g: one continuous function of Y across
// 2^B (both sides give (B - emin + 1) 2^m there), linear on each side with slope one per step.
// Measured on the other side's line, the index errs by at most dg (Y~'s error, in the smaller
// step 2^(B-1-m)) plus Y's distance to 2^B times the difference of the slopes, 2^B ln 2 dt
// (1 + 2^-10) / 2^(B-m) <= dg / 2: below 1.5 dg, inside band_w. The same holds at 2^emin, where
// the step below may be 2^low_shift times coarser (the slopes there are equal). So outside band_w
// the index is the float64 path's whichever binade g~ was measured in, and t needs no band of
// its own (test_stochastic_fast_form_at_binade_boundaries places elements there).
#include <cmath>

#include "dispatch.hpp"
#include "s2fp8_thresholds.hpp"

namespace lowfp {
namespace {

// Largest band_w taken: beyond it (very large alpha, fine formats) too many elements would take
// the float64 path for the form to pay.
constexpr double kMaxBandW = 0x1p-7;
constexpr uint32_t kMaxPerSign = 2048;

// The grid value (float64) at index i of a grid with emin, m (see S2fp8FastStochastic).
double grid_value(uint32_t i, int32_t emin, int32_t m) {
  const uint32_t per_binade = uint32_t(1) << m;
  if (i < per_binade) return std::ldexp(double(i), emin - m);
  const int32_t e = emin + int32_t(i >> m) - 1;
  return std::ldexp(double(per_binade + (i & (per_binade - 1))), e - m);
}

template <class T>
bool build(const S2fp8Call& call, const S2fp8Stats& s, S2fp8StochasticForm& form,
           std::vector<uint32_t>& storage) {
  const RoundParams<uint64_t>& p = call.q.p64;
  if (p.subnormal_exponent) return false;
  const int32_t m = 52 - p.normal_drop, m_low = 52 - p.below_drop;
  if (m > 10) return false;
  const double alpha = s.alpha, beta = s.beta;
  if (!(alpha > 0 && alpha <= 1024 && std::isfinite(beta))) return false;
  const double c = -beta / alpha;
  if (!(std::fabs(c) < 0x1p20)) return false;

  S2fp8FastStochastic& k = form.k;
  k.emin = p.emin;
  k.m = m;
  k.low_shift = m - m_low;
  // The largest finite value's index; the next grid value (in the format extended upward) is
  // above max.
  const double max_value = bit_cast<double>(p.max_bits);
  int32_t max_exp;
  std::frexp(max_value, &max_exp);
  const int32_t e_max = max_exp - 1;  // max is in the binade of 2^e_max
  if (e_max < p.emin) return false;
  const uint32_t steps_max = uint32_t(std::ldexp(max_value, m - e_max));
  k.over = uint32_t((e_max - p.emin) << m) + steps_max + 1;
  k.per_sign = k.over + 1;
  if (k.per_sign > kMaxPerSign) return false;
  if (grid_value(k.over - 1, k.emin, m) != max_value) return false;

  // Clamps. Below t_min, g < 2^-40 and g + r' stays below 1 unless r' is within band_w of 1;
  // above t_max, |Y| > 2^(e_max + 1) > max.
  k.t_min = float(k.emin - m_low - 40) - 0.25f;
  k.t_max = float(e_max + 2) + 0.25f;
  // Where the float64 path's Y is subnormal or 0 (t below -1022), it counts no underflow for
  // a Y of 0: such elements are left to it. (Above, a Y of inf rounds as any Y above max.)
  k.t_deep = -1000.0f;
  const double t_bound = std::max(std::fabs(double(k.t_min)), std::fabs(double(k.t_max)));

  k.alpha = float(alpha);
  k.c_int = int32_t(std::nearbyint(c));
  k.c_frac = float(c - double(k.c_int));
  const double eps_d = 0x1p-21 + 0x1p-25 + 0x1p-24 + (t_bound / alpha + 1) * 0x1p-24;
  const double dt = alpha * eps_d + 0x1p-23 * t_bound + 0x1p-48 * (alpha * 150 + std::fabs(beta) + t_bound);
  const double dg = std::ldexp(std::log(2.0) * dt * (1 + 0x1p-10) + 0x1p-21 + 0x1p-49, m + 1);
  const double dw = dg + 0x1p-24 + std::ldexp(1.0, m + 1 - 24);
  if (2 * dw > kMaxBandW) return false;
  k.band_w = float(2 * dw);

  k.r_shift = std::max<uint32_t>(p.sr_shift, 8);
  k.r_scale = std::ldexp(1.0f, -(32 - int32_t(k.r_shift)));

  // x' per grid value and sign: Y rounded as the float64 path would round that exact grid value
  // (itself, or the overflow policy's result at index over; +-0 at index 0), then unsqueezed.
  storage.assign(2 * k.per_sign, 0);
  const double inv_alpha = 1.0 / alpha;  // as the float64 path computes it
  const auto reachable = [&](uint32_t i) {
    return i == 0 || i >= (uint32_t(1) << m) || k.low_shift == 0;
  };
  for (uint32_t neg = 0; neg < 2; ++neg) {
    const uint64_t sign = neg ? kF64SignBit : 0;
    for (uint32_t i = 0; i <= k.over; ++i) {
      if (!reachable(i)) continue;
      const uint64_t v = bit_cast<uint64_t>(grid_value(i, k.emin, m)) | sign;
      RoundEvents ev;
      const uint64_t y = round_bits<RoundKind::Stochastic, uint64_t, false>(v, p, ~0u, ev);
      // The grid must be the format's: every value between 0 and over rounds to itself, over
      // overflows.
      if (i == k.over ? !ev.above_max : i > 0 && (y != v || ev.above_max)) return false;
      storage[neg * k.per_sign + i] = bit_cast<RawOf<T>>(
          s2fp8_store<T>(s2fp8_unsqueeze(kOneBits | sign, y, s, inv_alpha), call.p_store));
    }
  }
  const bool mirrored = mirrored_tables(storage.data(), storage.data() + k.per_sign, k.per_sign,
                                       kSignRaw<T>, [&](size_t i) { return reachable(uint32_t(i)); });
  if (mirrored) storage.resize(k.per_sign);
  k.sign_offset = mirrored ? 0 : k.per_sign;
  k.mirror_sign = mirrored ? kSignRaw<T> : 0;
  k.plain = k.low_shift == 0 && mirrored;
  // |x| >= 2^log_deep has t = alpha (log2|x| - c) >= t_deep + 8, so t~ > t_deep (t~'s error near
  // t_deep is below 2^-10). Rounded up to a float32 magnitude: inf where every finite x may reach
  // t_deep, the smallest subnormal (bits 1) where none can.
  const double log_deep = (double(k.t_deep) + 8) / alpha + c;
  k.deep_abs = bit_cast<uint32_t>(std::nextafter(float(std::exp2(log_deep)), INFINITY));
  form.values = storage.data();
  return true;
}

}  // namespace

bool s2fp8_build_stochastic(const S2fp8Call& call, const S2fp8Stats& s, S2fp8StochasticForm& form,
                            std::vector<uint32_t>& storage) {
  if (!s2fp8_stochastic_form_allowed(call)) return false;
  if (call.q.n < 1024) return false;  // building the form costs more than it saves
  return dispatch_narrow(call.q.x_dtype, false, [&](auto type) {
    return build<typename decltype(type)::type>(call, s, form, storage);
  });
}

}  // namespace lowfp
