// ScaledStrategy::Checked: float32 inputs, scales in a format, nearest rounding, in the float32
// carrier with the quotient checked against E's decision points; a tile where a check fails runs
// again in the float64 carrier.
#include "scaled/tile.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// A tile of float32 inputs with scales s = S · t in a format, nearest (ScaledCpuForms::checked), in
// the float32 carrier: the quotient approximated as x · fl(1 / s) (two roundings: within 2^-22.9
// of x / s), rounded to E by addition, and s · q as (q · S) · t (q · S exact: the one rounding
// of the float64 path's float(q · s)). Where the approximation lies within 2^-21 of one of E's
// decision points (a midpoint of its grid; past E's range, of the grid continued, which may flag
// overflowing elements needlessly) the exact quotient might round otherwise: then it returns
// false, its outputs and counts not to be used, and the tile runs exactly in float64. Otherwise
// the approximation and the exact quotient lie strictly on the same side of every decision
// point: the same q and events. Such near-ties are rare on real data, so a rerun is rare.
// kBlock: see for_tile_elements. y: where the tile's results go (not x's memory: a tile that
// runs twice must read its inputs again).
template <bool kCount, bool kParts, int64_t kBlock>
bool run_tile(const ScaledCall& c, const Tile& k, const TileScales& t, float* y,
              EventCounts& counts) {
  const float* x = static_cast<const float*>(c.x) + k.first;
  float* q_out = kParts ? c.q + k.first : nullptr;
  const int64_t n = k.len;
  const float ts = float(c.t);
  const RoundParams<uint32_t> p = c.p32;
  const int32_t e_cap = c.addition_cap;
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
    const float a = bit_cast<float>(quotient & 0x7fffffffu);
    float step_c;  // 2^23 times E's step at a
    const float mag = magnitude_by_addition(bit_cast<uint32_t>(a), p, e_cap, step_c);
    // distance to the nearer decision point: |a - mag| is exact and at most half a step
    const float off = std::fabs(std::fabs(a - mag) - step_c * 0x1p-24f);
    near[l] |= uint32_t(off <= a * 0x1p-21f);
    RoundEvents ev;
    const float q = bit_cast<float>(rounded_result(quotient, bit_cast<uint32_t>(mag), p, ev));
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
  with_flag(count, [&](auto count_c) {
    with_flag(c.q != nullptr, [&](auto parts) {
      constexpr bool kCount = decltype(count_c)::value, kParts = decltype(parts)::value;
      const auto run = c.block_cols == 16   ? run_tile<kCount, kParts, 16>
                       : c.block_cols == 32 ? run_tile<kCount, kParts, 32>
                                            : run_tile<kCount, kParts, 0>;
      for_each_tile(c, r0, r1, [&](const Tile& k) {
        round_tile(c, f, plan, k, t, counts, [&] {
          t.place32(static_cast<float*>(c.y) + k.first);
          // (S and fl(1 / s), every fl(1 / s) a normal float32, or no check holds)
          const bool checkable = block_forms(k, c.t, t);
          if (c.block_cols != 16 && c.block_cols != 32) spread32(c, k, t);
          // (in place, the results wait in a buffer until the tile is done)
          float* const y = static_cast<float*>(c.y) + k.first;
          float* const dst = plan.in_place ? t.checked_out : y;
          if (checkable && run(c, k, t, dst, counts)) {
            if (dst != y) std::memcpy(y, dst, sizeof(float) * size_t(k.len));
          } else {
            float64_tile(c, count, k, t, counts);
          }
        });
      });
    });
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
