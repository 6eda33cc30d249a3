// ScaledStrategy::Float64: every element in the float64 carrier, by scaled.hpp's scaled_element
// (x / s rounded to odd, or once where nearest_divides_once holds; E's rounding in its faster
// forms where they give the same bits), s · q exact in float64 and stored as store_scaled does.
#include "scaled/tile.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// One tile, its per-element scales and inverses spread (spread64) and, stochastic, its words
// drawn. kPow2: every scale a power of two, so that x · (1 / s) is the exact quotient. kFaster:
// E's faster form (ScaledCall::add64, steps64). kOnce: x / s rounded once
// (ScaledCall::divide_once). q goes to c.q, or to a scratch tile when the call does not ask for
// it: one store more per element (to L1) in place of a second instantiation of every form.
template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kFaster, bool kOnce>
void run_tile(const ScaledCall& c, const Tile& k, const TileScales& t,
              EventCounts& counts) {
  const In* x = static_cast<const In*>(c.x) + k.first;
  In* y = static_cast<In*>(c.y) + k.first;
  alignas(64) float q_scratch[kTile];
  float* q_out = c.q != nullptr ? c.q + k.first : q_scratch;
  const RoundParams<uint64_t> p = c.p;
  const RoundParams<uint64_t> out = c.out;
  TileEvents<int64_t> events;
  for (int64_t i = 0; i < k.len; ++i) {
    const double xv = bit_cast<double>(Widen<uint64_t>::from(x[i]));
    RoundEvents ev;
    const uint32_t rw = Kind == RoundKind::Stochastic ? t.rand[i] : 0u;
    const double q = scaled_element<Kind, kPow2, kSubExp, kFaster, kOnce>(xv, t.s[i], t.inv[i], p, rw, ev,
                                                                      c.addition_cap);
    q_out[i] = float(q);
    y[i] = store_scaled<In>(q * t.s[i], out);
    if constexpr (kCount) events.add(0, ev);
  }
  events.into(counts);
}

// fn(a run_tile instantiation) for the call: its storage type, rounding kind and flags.
template <class Fn>
void with_run_tile(const ScaledCall& c, bool count, Fn&& fn) {
  with_float64_forms(c, [&](auto type, auto kind, auto faster_c, auto once_c) {
    using In = typename decltype(type)::type;
    constexpr RoundKind K = decltype(kind)::value;
    with_flag(count, [&](auto count_c) {
      with_flag(c.scale.rule != ScaleRule::Format, [&](auto pow2) {
        with_flag(c.p.subnormal_exponent, [&](auto sub) {
          constexpr bool kFaster = decltype(faster_c)::value && !decltype(sub)::value;
          constexpr bool kOnce = decltype(once_c)::value && !decltype(pow2)::value;
          fn(run_tile<In, K, decltype(count_c)::value, decltype(pow2)::value, decltype(sub)::value,
                      kFaster, kOnce>);
        });
      });
    });
  });
}

}  // namespace

void float64_tile(const ScaledCall& c, bool count, const Tile& k, TileScales& t,
                  EventCounts& counts) {
  spread64(c, k, t);
  with_run_tile(c, count, [&](auto run) { run(c, k, t, counts); });
}

void scaled_float64(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                    int64_t r1, EventCounts& counts) {
  TileScales t;
  with_run_tile(c, c.count && !plan.count_by_comparison, [&](auto run) {
    for_each_tile(c, r0, r1, [&](const Tile& k) {
      round_tile(c, f, plan, k, t, counts, [&] {
        block_forms(k, 1.0, t);
        spread64(c, k, t);
        if (round_kind(c.mode) == RoundKind::Stochastic) draw_words(c, k, t);
        run(c, k, t, counts);
      });
    });
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
