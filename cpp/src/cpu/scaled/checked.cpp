// ScaledStrategy::Checked: float32 inputs, scales in a format, nearest or stochastic rounding, in
// the float32 carrier with the quotient checked against E's decision points; an element where a
// check fails is rounded again exactly in the float64 carrier.
#include "scaled/tile.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// A tile of float32 inputs with scales s = S · t in a format (ScaledCall::checked), in the float32
// carrier: each element by scaled.hpp's checked_element, and each element whose check fails
// rounded again exactly in float64 (`again`).
// s · q into y as (q · S) · t (q · S exact: the one rounding of the float64 path's float(q · s));
// q into c.q + k.first (kParts). kBlock: see for_tile_elements. y: not x's memory (rounding in
// place, the caller passes a buffer: the elements rounded again read x after the loop).
template <RoundKind Kind, bool kCount, bool kParts, int64_t kBlock>
void run_tile(const ScaledCall& c, const Tile& k, const TileScales& t, float* y,
              EventCounts& counts) {
  static_assert(Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic, "no checked form");
  const int64_t n = k.len;
  alignas(64) uint32_t again[kTile];  // 1: rounded again exactly (32-bit lanes, as the loop's)
  const float* x = static_cast<const float*>(c.x) + k.first;
  float* q_out = kParts ? c.q + k.first : nullptr;
  const float ts = float(c.t);
  const RoundParams<uint32_t> p = c.p32;
  const int32_t e_cap = c.addition_cap;
  const uint32_t margin = c.checked_margin;
  // Per lane of a block, so that the block loop keeps them in vector registers
  constexpr int64_t kLanes = kBlock > 0 ? kBlock : 1;
  TileEvents<int32_t, kLanes> events;
  uint32_t any_again[kLanes] = {};
  // element i (lane l), given S and fl(1 / s)
  auto element = [&](int64_t i, int64_t l, float big_s, float inv) {
    RoundEvents ev;
    uint32_t near;
    const float q = checked_element<Kind, kCount>(bit_cast<uint32_t>(x[i]), inv, p, e_cap,
                                                  Kind == RoundKind::Stochastic ? t.rand[i] : 0u, margin, ev, near);
    if constexpr (kParts) q_out[i] = q;
    y[i] = (q * big_s) * ts;
    again[i] = near;
    any_again[l] |= near;
    if constexpr (kCount) events.add_unless(l, ev, near);
  };
  for_tile_elements<kBlock>(n, t, element);
  uint32_t rounded_again = 0;
  for (int64_t l = 0; l < kLanes; ++l) rounded_again |= any_again[l];
  if (rounded_again != 0) {
    for (int64_t i = 0; i < n; ++i) {
      if (again[i] == 0) continue;
      // element i's block: the tile starts at column t0 in block j0 (a block per element for
      // blocks down the columns, where j0 = t0)
      const int64_t b = (k.t0 + i) / c.block_cols - k.j0;
      const double s = k.bs[b];
      RoundEvents ev;
      // (E's finest step of at least 2^-22: no float64 subnormal needs its true exponent)
      const double q = scaled_element<Kind, false, false>(double(x[i]), s, t.block_inv[b], c.p,
                                                          Kind == RoundKind::Stochastic ? t.rand[i] : 0u, ev);
      if constexpr (kParts) q_out[i] = float(q);
      y[i] = float(q * s);  // (store_scaled<float>)
      if constexpr (kCount) events.add(0, ev);
    }
  }
  if constexpr (kCount) events.into(counts);
}

}  // namespace

void scaled_checked(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                    int64_t r1, EventCounts& counts) {
  TileScales t;
  const bool count = c.count && !plan.count_by_comparison;
  const bool stochastic = round_kind(c.mode) == RoundKind::Stochastic;
  // fn(the block width for run_tile: 16 or 32, 0 for any other; see for_tile_elements)
  auto with_block = [&](auto fn) {
    if (c.block_cols == 16) fn(std::integral_constant<int64_t, 16>{});
    else if (c.block_cols == 32) fn(std::integral_constant<int64_t, 32>{});
    else fn(std::integral_constant<int64_t, 0>{});
  };
  with_flag(stochastic, [&](auto stochastic_c) {
    with_flag(count, [&](auto count_c) {
      with_flag(c.q != nullptr, [&](auto parts) {
        with_block([&](auto block) {
          constexpr RoundKind K = decltype(stochastic_c)::value ? RoundKind::Stochastic : RoundKind::Nearest;
          constexpr bool kCount = decltype(count_c)::value, kParts = decltype(parts)::value;
          constexpr int64_t kBlock = decltype(block)::value;
          for_each_tile(c, r0, r1, [&](const Tile& k) {
            round_tile(c, f, plan, k, t, counts, [&] {
              float* const y = static_cast<float*>(c.y) + k.first;
              t.place32(y);
              // (S and fl(1 / s), every fl(1 / s) a normal float32, or no check holds)
              const bool checkable = block_forms(k, c.t, t);
              if (kBlock == 0) spread32(c, k, t);
              if (stochastic) draw_words(c, k, t);
              if (!checkable) {
                float64_tile(c, count, k, t, counts);
              } else if (plan.in_place) {  // (the results wait in a buffer until the tile is done)
                run_tile<K, kCount, kParts, kBlock>(c, k, t, t.checked_out, counts);
                std::memcpy(y, t.checked_out, sizeof(float) * size_t(k.len));
              } else {
                run_tile<K, kCount, kParts, kBlock>(c, k, t, y, counts);
              }
            });
          });
        });
      });
    });
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
