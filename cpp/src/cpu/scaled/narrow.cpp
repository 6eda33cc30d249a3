// ScaledStrategy::Narrow: power-of-two scales and inputs of at most 32 bits in the float32
// carrier, where x · 2^-k is exact (or below 2^-126, where only its sign and being nonzero decide)
// and so is s · q; element by element, any rounding mode, q written if asked.
#include "half_lanes.hpp"
#include "scaled/tile.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// A 16-bit tile of x as float32 (the bits Widen<uint32_t> gives), into buffer.
template <class In>
void widen_tile(const In* x, float* buffer, int64_t n) {
  if constexpr (kF16cTiles<In>) {
    half_tile_to_float(x, buffer, n);
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = bit_cast<float>(Widen<uint32_t>::from(x[i]));
  }
}

// store_narrow<In> of a tile of float32 values: their nearest rounding to In's grid in the
// float32 carrier (ScaledCall::out32's, in the forms with its parameters folded in:
// round_to_bfloat16_bits, float16_round_params), then the exact conversion (F16C for float16
// where the kernel has it).
template <class In>
void store_tile(float* v, In* y, int64_t n) {
  RoundEvents ev;
  if constexpr (std::is_same_v<In, BFloat>) {
    for (int64_t i = 0; i < n; ++i)
      y[i] = Store<In>::from(round_to_bfloat16_bits<RoundKind::Nearest>(bit_cast<uint32_t>(v[i]), 0u, ev));
  } else {
    constexpr RoundParams<uint32_t> p16 = float16_round_params<RoundKind::Nearest>();
    for (int64_t i = 0; i < n; ++i)
      v[i] = bit_cast<float>(round_bits<RoundKind::Nearest, uint32_t, false>(bit_cast<uint32_t>(v[i]), p16, 0u, ev));
    if constexpr (kF16cTiles<In>) float_tile_to_half(v, y, n);
    else for (int64_t i = 0; i < n; ++i) y[i] = Store<In>::from(bit_cast<uint32_t>(v[i]));
  }
}

// One tile: every scale is 2^k. kFaster: narrow_element's (ScaledCpuForms::add32 for nearest,
// ScaledCall::steps32 for stochastic). kBlock: see for_tile_elements.
// A 16-bit tile is widened into a float32 buffer first and its results stored from another
// (three loops that vectorise, where the element loop on 16-bit storage did not).
template <class In, RoundKind Kind, bool kCount, bool kParts, bool kFaster, int64_t kBlock>
void run_tile(const ScaledCall& c, const Tile& k, const TileScales& t,
              EventCounts& counts) {
  constexpr bool kStaged = !std::is_same_v<In, float>;
  const In* x_in = static_cast<const In*>(c.x) + k.first;
  In* y_out = static_cast<In*>(c.y) + k.first;
  float* q_out = kParts ? c.q + k.first : nullptr;
  const int64_t n = k.len;
  alignas(64) float x_tile[kStaged ? kTile : 1];
  alignas(64) float y_tile[kStaged ? kTile : 1];
  const float* x;
  float* y;
  if constexpr (kStaged) {
    widen_tile(x_in, x_tile, n);
    x = x_tile;
    y = y_tile;
  } else {
    x = x_in;
    y = y_out;
  }
  const RoundParams<uint32_t> p = c.p32;
  constexpr int64_t kLanes = kBlock > 0 ? kBlock : 1;
  TileEvents<int32_t, kLanes> events;
  // (a quotient that underflowed to 0 kept nonzero except where only its rounding to nearest, a
  // signed 0, is wanted, not its underflow count)
  constexpr bool kKeep = kCount || Kind != RoundKind::Nearest;
  auto element = [&](int64_t i, int64_t l, float s32, float inv32) {
    RoundEvents ev;
    const uint32_t rw = Kind == RoundKind::Stochastic ? t.rand[i] : 0u;
    const float q = narrow_element<Kind, kKeep, kFaster>(bit_cast<uint32_t>(x[i]), inv32, p, rw, ev, c.addition_cap);
    if constexpr (kParts) q_out[i] = q;
    y[i] = q * s32;  // (exact: ScaledCall::narrow)
    if constexpr (kCount) events.add(l, ev);
  };
  for_tile_elements<kBlock>(n, t, element);
  if constexpr (kStaged) store_tile(y_tile, y_out, n);
  events.into(counts);
}

}  // namespace

void scaled_narrow(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                   int64_t r1, EventCounts& counts) {
  TileScales t;
  with_storage_type(c.dtype, [&](auto type) {
    using In = typename decltype(type)::type;
    if constexpr (!std::is_same_v<In, double>) {  // (ScaledCall::narrow)
      with_round_kind(c.mode, [&](auto kind) {
        constexpr RoundKind K = decltype(kind)::value;
        with_flag(c.count && !plan.count_by_comparison, [&](auto count) {
          with_flag(c.q != nullptr, [&](auto parts) {
            // (the faster forms: nearest by addition, stochastic by steps)
            const bool faster = K == RoundKind::Nearest ? f.add32 : K == RoundKind::Stochastic && c.steps32;
            with_flag(faster, [&](auto faster_c) {
              constexpr bool kCount = decltype(count)::value, kParts = decltype(parts)::value,
                             kFaster = decltype(faster_c)::value && K != RoundKind::Directed;
              const auto run = c.block_cols == 32 ? run_tile<In, K, kCount, kParts, kFaster, 32>
                                                  : run_tile<In, K, kCount, kParts, kFaster, 0>;
              for_each_tile(c, r0, r1, [&](const Tile& k) {
                round_tile(c, f, plan, k, t, counts, [&] {
                  t.place32(static_cast<In*>(c.y) + k.first);
                  block_forms<true>(k, 1.0, t);  // (2^±k: exact)
                  if (c.block_cols != 32) spread32(c, k, t);
                  if constexpr (K == RoundKind::Stochastic) draw_words(c, k, t);
                  run(c, k, t, counts);
                });
              });
            });
          });
        });
      });
    }
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
