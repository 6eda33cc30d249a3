// ScaledStrategy::Checked: float32 inputs, scales in a format, nearest or stochastic rounding,
// in the float32 carrier with the quotient checked against E's decision points; a tile where a
// check fails runs again in the float64 carrier.
#include "scaled/tile.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// A tile of float32 inputs with scales s = S · t in a format (ScaledCpuForms::checked), in the
// float32 carrier: the quotient approximated as a = x · fl(1 / s) (two roundings: within 2^-22.9
// of x / s), rounded to E in its faster form, and s · q as (q · S) · t (q · S exact: the one
// rounding of the float64 path's float(q · s)). Where the exact quotient might round otherwise,
// it returns false, its outputs and counts not to be used, and the tile runs exactly in float64.
// Otherwise a and the exact quotient lie strictly on the same side of every point where the
// rounding decides: the same q and events. Such near cases are rare on real data, so a rerun is
// rare.
// - Nearest (by addition): a within 2^-21 of one of E's decision points (a midpoint of its grid;
//   past E's range, of the grid continued, which may flag overflowing elements needlessly).
// - Stochastic (by steps): the decision for word r' (its low sr_shift bits set) changes where
//   a's steps_position X passes r' + 1, and at a grid point, where X wraps from 2^32 to 0. a lies
//   below 2^(m + 1) of its steps (one step: E's smallest below 2^emin), so the exact quotient's
//   position differs from a's by less than 2^(m + 10.1) of the 2^32, and by less than three
//   times that measured circularly across a grid point into a binade of half or twice the step:
//   a tile reruns where X - (r' + 1), circularly, lies within checked_margin, 2^(m + 13).
// kBlock: see for_tile_elements. y: where the tile's results go (not x's memory: a tile that
// runs twice must read its inputs again).
template <RoundKind Kind, bool kCount, bool kParts, int64_t kBlock>
bool run_tile(const ScaledCall& c, const ScaledCpuForms& f, const Tile& k, const TileScales& t, float* y,
              EventCounts& counts) {
  static_assert(Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic, "no checked form");
  const float* x = static_cast<const float*>(c.x) + k.first;
  float* q_out = kParts ? c.q + k.first : nullptr;
  const int64_t n = k.len;
  const float ts = float(c.t);
  const RoundParams<uint32_t> p = c.p32;
  const int32_t e_cap = c.addition_cap;
  const uint32_t low_bits = (1u << p.sr_shift) - 1u, margin = f.checked_margin;
  // Per lane of a block, so that the block loop keeps them in vector registers
  constexpr int64_t kLanes = kBlock > 0 ? kBlock : 1;
  TileEvents<int32_t, kLanes> events;
  uint32_t near[kLanes] = {};
  // element i (lane l), given S and fl(1 / s)
  auto element = [&](int64_t i, int64_t l, float big_s, float inv) {
    const uint32_t xb = bit_cast<uint32_t>(x[i]);
    const uint32_t qb = bit_cast<uint32_t>(x[i] * inv);
    // (a product that underflowed to 0 stays nonzero when counting: nonzero_quotient)
    const uint32_t quotient = kCount ? nonzero_quotient(qb, xb) : qb;
    const uint32_t ab = quotient & 0x7fffffffu;
    RoundEvents ev;
    float q;
    if constexpr (Kind == RoundKind::Nearest) {
      const float a = bit_cast<float>(ab);
      float step_c;  // 2^23 times E's step at a
      const float mag = magnitude_by_addition(ab, p, e_cap, step_c);
      // distance to the nearer decision point: |a - mag| is exact and at most half a step
      const float off = std::fabs(std::fabs(a - mag) - step_c * 0x1p-24f);
      near[l] |= uint32_t(off <= a * 0x1p-21f);
      q = bit_cast<float>(rounded_result(quotient, bit_cast<uint32_t>(mag), p, ev));
    } else {
      const uint32_t rw = t.rand[i];
      const uint32_t from_change = steps_position(ab, p) - ((rw | low_bits) + 1u);  // (mod 2^32)
      near[l] |= uint32_t(from_change + margin <= 2u * margin) & uint32_t(ab < 0x7f800000u);
      q = bit_cast<float>(round_stochastic_by_steps<false>(quotient, p, rw, ev));
    }
    if constexpr (kParts) q_out[i] = q;
    y[i] = (q * big_s) * ts;
    if constexpr (kCount) events.add(l, ev);
  };
  for_tile_elements<kBlock>(n, t, element);
  uint32_t any_near = 0;
  for (int64_t l = 0; l < kLanes; ++l) any_near |= near[l];
  if (any_near != 0) return false;
  events.into(counts);
  return true;
}

}  // namespace

void scaled_checked(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                    int64_t r1, EventCounts& counts) {
  TileScales t;
  const bool count = c.count && !plan.count_by_comparison;
  const bool stochastic = round_kind(c.mode) == RoundKind::Stochastic;
  with_flag(stochastic, [&](auto stochastic_c) {
    with_flag(count, [&](auto count_c) {
      with_flag(c.q != nullptr, [&](auto parts) {
        constexpr RoundKind K = decltype(stochastic_c)::value ? RoundKind::Stochastic : RoundKind::Nearest;
        constexpr bool kCount = decltype(count_c)::value, kParts = decltype(parts)::value;
        const auto run = c.block_cols == 16   ? run_tile<K, kCount, kParts, 16>
                         : c.block_cols == 32 ? run_tile<K, kCount, kParts, 32>
                                              : run_tile<K, kCount, kParts, 0>;
        for_each_tile(c, r0, r1, [&](const Tile& k) {
          round_tile(c, f, plan, k, t, counts, [&] {
            t.place32(static_cast<float*>(c.y) + k.first);
            // (S and fl(1 / s), every fl(1 / s) a normal float32, or no check holds)
            const bool checkable = block_forms(k, c.t, t);
            if (c.block_cols != 16 && c.block_cols != 32) spread32(c, k, t);
            if (stochastic) draw_words(c, k, t);  // (the float64 rerun reads them too)
            // (in place, the results wait in a buffer until the tile is done)
            float* const y = static_cast<float*>(c.y) + k.first;
            float* const dst = plan.in_place ? t.checked_out : y;
            if (checkable && run(c, f, k, t, dst, counts)) {
              if (dst != y) std::memcpy(y, dst, sizeof(float) * size_t(k.len));
            } else {
              float64_tile(c, count, k, t, counts);
            }
          });
        });
      });
    });
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
