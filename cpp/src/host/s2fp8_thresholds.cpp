// The threshold form of the S2FP8 element transform (S2fp8Thresholds), built once per call.
//
// Why it gives the float64 path's bits exactly. For a finite nonzero x of a given sign, x' and the
// rounding events depend on x only through |Y| = |s2fp8_squeeze(x)|, and rounding is monotone in
// |Y|, so they form a step function of |Y| whose steps ("changes") are found here by bisection on
// round_bits itself. Over the values of a float32 or 16-bit dtype, |Y| does not decrease as |x|
// grows: one step of x moves log2|x| by at least 2^-24 / ln 2 ~ 8.6e-8, far more than the errors
// of log2_det and exp2_det (a few ulp: below 1e-12 in log2 for these magnitudes), and the
// products and sums between them round monotonically. So change c takes effect at the smallest
// magnitude whose |Y| reaches c, found by a short search around the value the exact equations give.
// (float64 x has no such margin between neighbours and stays on the float64 path.)
#include "s2fp8_thresholds.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

#include "dispatch.hpp"

namespace lowfp {
namespace {

// What rounding one |Y| of one sign does.
struct Behaviour {
  uint64_t rounded;
  bool underflow, above_max;
  bool operator==(const Behaviour& o) const {
    return rounded == o.rounded && underflow == o.underflow && above_max == o.above_max;
  }
  bool operator!=(const Behaviour& o) const { return !(*this == o); }
};

class YRounding {
 public:
  YRounding(const RoundParams<uint64_t>& p, RoundKind kind, uint64_t sign)
      : p_(p), kind_(kind), sign_(sign) {}
  Behaviour at(uint64_t y_abs) const {
    RoundEvents ev;
    const uint64_t y = y_abs | sign_;
    uint64_t r;
    if (kind_ == RoundKind::Nearest)
      r = p_.subnormal_exponent ? round_bits<RoundKind::Nearest, uint64_t, true>(y, p_, 0u, ev)
                                : round_bits<RoundKind::Nearest, uint64_t, false>(y, p_, 0u, ev);
    else
      r = p_.subnormal_exponent ? round_bits<RoundKind::Directed, uint64_t, true>(y, p_, 0u, ev)
                                : round_bits<RoundKind::Directed, uint64_t, false>(y, p_, 0u, ev);
    return {r, ev.underflow, ev.above_max};
  }

 private:
  const RoundParams<uint64_t>& p_;
  RoundKind kind_;
  uint64_t sign_;
};

struct Change {
  uint64_t y_abs;  // the smallest |Y| (float64 bits) with this behaviour
  Behaviour b;
};

// The smallest |Y| in (lo, hi] that does not behave as lo, given that hi does not: bisection
// over bit patterns (ordered like the values), after candidates that settle the usual cases at
// once: just above lo (directed away from zero), the midpoint and its neighbours (nearest, ties
// either way), just below hi (toward zero).
uint64_t first_change(const YRounding& f, uint64_t lo, uint64_t hi, const Behaviour& b_lo) {
  uint64_t below = lo, above = hi;  // at(below) == b_lo, at(above) != b_lo
  const uint64_t mid = bit_cast<uint64_t>((bit_cast<double>(lo) + bit_cast<double>(hi)) * 0.5);
  for (const uint64_t c : {lo + 1, mid - 1, mid, mid + 1, hi - 1}) {
    if (c <= below || c >= above) continue;
    if (f.at(c) == b_lo) {
      below = c;
    } else {
      above = c;
      break;
    }
  }
  while (above - below > 1) {
    const uint64_t m = below + (above - below) / 2;
    (f.at(m) == b_lo ? below : above) = m;
  }
  return above;
}

// Formats whose grid in the float64 carrier has more points than this stay on the float64 path.
constexpr uint64_t kMaxAnchors = 4096;

// Every change over |Y| in [0, inf], ascending, the first being {0, at(0)}; empty when the format
// is too fine. Anchors are the format's grid in the float64 carrier (a step of its last binade
// throughout), so most gaps between anchors hold one change and cost a few evaluations.
std::vector<Change> y_changes(const YRounding& f, const RoundParams<uint64_t>& p) {
  const uint32_t shift = uint32_t(p.normal_drop);
  const uint64_t first = p.below_step >> shift, last = p.max_bits >> shift;
  std::vector<Change> out;
  if (last - first > kMaxAnchors) return out;
  std::vector<uint64_t> anchors{0};
  for (uint64_t k = first; k <= last; ++k) anchors.push_back(k << shift);
  anchors.push_back(kF64ExpMask);  // +inf
  Behaviour b = f.at(0);
  out.push_back({0, b});
  for (size_t i = 0; i + 1 < anchors.size(); ++i) {
    const uint64_t hi = anchors[i + 1];
    const Behaviour b_hi = f.at(hi);
    uint64_t lo = anchors[i];
    while (b != b_hi) {
      lo = first_change(f, lo, hi, b);
      b = f.at(lo);
      out.push_back({lo, b});
    }
  }
  return out;
}

// |Y| as the element transform computes it, for the magnitude bits a of x's dtype and one sign.
template <class T>
struct XSqueeze {
  const S2fp8Stats& s;
  uint32_t sign;
  uint64_t y_abs(uint32_t a) const {
    return s2fp8_squeeze(Widen<uint64_t>::from(bit_cast<T>(RawOf<T>(a | sign))), s) & ~kF64SignBit;
  }
};

// The smallest magnitude a in [1, inf] whose |Y| reaches c (x = inf passes its own bits through,
// so it always does). Gallops from the magnitude the exact equations give to a bracket, then
// bisects: a few squeezes per threshold.
template <class T>
uint32_t x_threshold(const XSqueeze<T>& sq, uint64_t c, const S2fp8Stats& s) {
  constexpr uint32_t inf = kInfRaw<T>;
  if (c >= kF64ExpMask) return inf;
  const auto reaches = [&](uint32_t a) { return a >= inf || sq.y_abs(a) >= c; };
  const double x_est = exp2_det((log2_det(bit_cast<double>(c)) - s.beta) / s.alpha);
  const uint32_t guess =
      min_of(max_of(uint32_t(bit_cast<RawOf<T>>(Store<T>::from(bit_cast<uint64_t>(x_est)))) & (kSignRaw<T> - 1), 1u), inf);
  uint32_t below, above;  // !reaches(below) (0: nothing below 1 counts), reaches(above)
  if (reaches(guess)) {
    above = guess;
    for (uint32_t step = 1;; step *= 2) {
      if (above <= step) {
        below = 0;
        break;
      }
      if (!reaches(above - step)) {
        below = above - step;
        break;
      }
      above -= step;
    }
  } else {
    below = guess;
    for (uint32_t step = 1;; step *= 2) {
      const uint32_t next = min_of(below + step, inf);
      if (reaches(next)) {
        above = next;
        break;
      }
      below = next;
    }
  }
  while (above - below > 1) {
    const uint32_t m = below + (above - below) / 2;
    (reaches(m) ? above : below) = m;
  }
  return above;
}

// One sign's intervals of magnitude bits: values[k] holds on [starts[k], starts[k + 1]), starts[0]
// = 1; and its event ranges.
struct SignIntervals {
  std::vector<uint32_t> starts, values;
  uint32_t under_lo = 0, under_hi = 0, above = ~0u;
};

// start_of: the thresholds found so far, by |Y| (|Y| of -x is that of x, so the two signs share
// them wherever their changes coincide, as in every mode but up and down).
template <class T>
bool sign_intervals(const S2fp8Call& call, const S2fp8Stats& s, bool negative, SignIntervals& out,
                    std::map<uint64_t, uint32_t>& start_of) {
  constexpr uint32_t inf = kInfRaw<T>;
  const uint64_t y_sign = negative ? kF64SignBit : 0;
  const YRounding f(call.q.p64, round_kind(call.q.mode), y_sign);
  const std::vector<Change> changes = y_changes(f, call.q.p64);
  if (changes.empty()) return false;
  const XSqueeze<T> sq{s, negative ? kSignRaw<T> : 0u};
  const double inv_alpha = 1.0 / s.alpha;  // as the float64 path computes it
  bool under_open = false, under_seen = false, above_seen = false;
  for (const Change& ch : changes) {
    const auto known = start_of.find(ch.y_abs);
    const uint32_t start = ch.y_abs == 0             ? 1u
                           : known != start_of.end() ? known->second
                                                     : start_of[ch.y_abs] = x_threshold(sq, ch.y_abs, s);
    // Events (the first change is at(0): neither).
    if (ch.b.underflow != under_open) {
      if (ch.b.underflow) {
        if (under_seen) return false;  // not one range
        out.under_lo = start;
        out.under_hi = inf;
        under_seen = true;
      } else {
        out.under_hi = start;
      }
      under_open = ch.b.underflow;
    }
    if (ch.b.above_max != above_seen) {
      if (!ch.b.above_max) return false;  // not monotone
      out.above = start;
      above_seen = true;
    }
    if (start >= inf) continue;  // no finite magnitude gets here
    const uint32_t value = bit_cast<RawOf<T>>(
        s2fp8_store<T>(s2fp8_unsqueeze(kOneBits | y_sign, ch.b.rounded, s, inv_alpha), call.p_store));
    if (!out.starts.empty() && out.starts.back() == start) {  // the previous interval is empty
      out.starts.pop_back();
      out.values.pop_back();
    }
    if (!out.values.empty() && out.values.back() == value) continue;  // the same x'
    out.starts.push_back(start);
    out.values.push_back(value);
  }
  return true;
}

// Whether the negative sign's intervals are the positive sign's with x' negated (its sign bit set),
// with the same event ranges.
template <class T>
bool is_mirror(const SignIntervals& pos, const SignIntervals& neg) {
  return pos.starts == neg.starts && pos.values.size() == neg.values.size() &&
         pos.under_lo == neg.under_lo && pos.under_hi == neg.under_hi && pos.above == neg.above &&
         mirrored_tables(pos.values.data(), neg.values.data(), pos.values.size(), kSignRaw<T>,
                         [](size_t) { return true; });
}

int top_bit(uint32_t v) { return 31 - __builtin_clz(v); }

template <class T>
bool build(const S2fp8Call& call, const S2fp8Stats& s, S2fp8Thresholds& t,
           std::vector<uint32_t>& storage) {
  SignIntervals sign[2];
  std::map<uint64_t, uint32_t> start_of;
  for (int neg = 0; neg < 2; ++neg)
    if (!sign_intervals<T>(call, s, neg != 0, sign[neg], start_of)) return false;
  const bool mirrored = is_mirror<T>(sign[0], sign[1]);
  const int n_signs = mirrored ? 1 : 2;  // signs with entries and values of their own
  // The largest shift that leaves at most one threshold per bucket, and (v << shift) < 2^32.
  uint32_t n_values = 0;
  for (int neg = 0; neg < n_signs; ++neg) n_values += uint32_t(sign[neg].values.size());
  int shift = min_of(32 - (top_bit(n_values) + 1), int(8 * sizeof(RawOf<T>)) - 1);
  uint32_t top = 0;
  for (const SignIntervals& si : sign)
    for (size_t j = 1; j < si.starts.size(); ++j) {
      if (j + 1 < si.starts.size()) shift = min_of(shift, top_bit(si.starts[j] ^ si.starts[j + 1]));
      top = max_of(top, si.starts[j]);
    }
  if (shift < 0) return false;
  // Buckets start at base, a multiple of 2^shift strictly below the first threshold of either
  // sign: the magnitudes below it (often most of the bit range) share one x' and need no entries.
  uint32_t first = top;
  for (const SignIntervals& si : sign)
    if (si.starts.size() > 1) first = min_of(first, si.starts[1]);
  const uint32_t base = first > 0 ? ((first - 1) >> shift) << shift : 0;
  const uint64_t buckets = (uint64_t(top - base) >> shift) + 2;
  if (buckets > (uint64_t(1) << 16)) return false;
  storage.assign(n_signs * buckets + n_values, 0);
  uint32_t* entries = storage.data();
  uint32_t* values = entries + n_signs * buckets;
  const uint32_t low = (uint32_t(1) << shift) - 1;
  uint32_t value_base = 0;
  for (int neg = 0; neg < 2; ++neg) {
    const SignIntervals& si = sign[neg];
    t.under_lo[neg] = si.under_lo;
    t.under_hi[neg] = si.under_hi;
    t.above[neg] = si.above;
    if (neg >= n_signs) break;
    std::copy(si.values.begin(), si.values.end(), values + value_base);
    size_t j = 1;  // the first threshold (starts[j]) not in an earlier bucket
    for (uint64_t b = 0; b < buckets; ++b) {
      uint32_t& e = entries[neg * buckets + b];
      const uint32_t v = value_base + uint32_t(j - 1);  // x' below any threshold of bucket b
      if (j < si.starts.size() && ((si.starts[j] - base) >> shift) == b) {
        e = ((v + 1) << shift) | (si.starts[j] & low);
        ++j;
      } else {
        e = v << shift;
      }
    }
    value_base += uint32_t(si.values.size());
  }
  t.entries = entries;
  t.values = values;
  t.n_values = n_values;
  t.base = base;
  t.shift = uint32_t(shift);
  t.buckets = uint32_t(buckets);
  t.sign_entries = mirrored ? 0 : uint32_t(buckets);
  t.mirror_sign = mirrored ? kSignRaw<T> : 0;
  return true;
}

}  // namespace

bool s2fp8_float64_forced() {
  const char* force_float64 = std::getenv("LOWFP_S2FP8_FLOAT64");
  return force_float64 != nullptr && std::strcmp(force_float64, "1") == 0;
}

bool s2fp8_threshold_form_allowed(const S2fp8Call& call) {
  return call.q.mode != Rounding::Stochastic && call.q.x_dtype != DType::Float64 &&
         !s2fp8_float64_forced();
}

bool s2fp8_stochastic_form_allowed(const S2fp8Call& call) {
  return call.q.mode == Rounding::Stochastic && call.q.x_dtype != DType::Float64 &&
         !s2fp8_float64_forced();
}

bool s2fp8_build_thresholds(const S2fp8Call& call, const S2fp8Stats& s, S2fp8Thresholds& t,
                            std::vector<uint32_t>& storage) {
  if (!s2fp8_threshold_form_allowed(call)) return false;
  // Building costs 150-250 us (bench/RESULTS.md); the float64 path ~50 ns an element.
  if (call.q.n < 4096) return false;
  return dispatch_narrow(call.q.x_dtype, false, [&](auto type) {
    return build<typename decltype(type)::type>(call, s, t, storage);
  });
}

}  // namespace lowfp
