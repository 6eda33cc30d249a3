// The scaled-format loops (docs/design.md §9), compiled once per instruction-set level like
// quantize_kernels.cpp: the blocks' largest finite magnitudes, and the elements given their
// blocks' scales. The element math is cpp/include/lowfp/scaled.hpp's, in a float64 carrier.
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "philox_lanes.hpp"
#include "quantize_cpu.hpp"

#ifndef LOWFP_ISA_NS
#error "compile with -DLOWFP_ISA_NS=<namespace>"
#endif

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// The largest finite magnitude of each block in block rows [br0, br1), by the storage bits: the
// order of non-negative floats is that of their bit patterns, and a finite one's are below the
// exponent mask (NaN and ±inf drop out as 0), so an integer max over the sign-cleared bits
// vectorises whatever the storage type.
template <class U>
U finite_max(const U* v, int64_t n, U m, U exponent) {
  const U magnitude = U(U(~U(0)) >> 1);
  for (int64_t i = 0; i < n; ++i) {
    const U a = U(v[i] & magnitude);
    m = max_of(m, select(a < exponent, a, U(0)));
  }
  return m;
}

// Blocks of a fixed width kN (the MX and NVFP4 sizes): a fully unrolled loop per block.
template <int64_t kN, class U>
void row_block_max(const U* row, int64_t cols, U* top, U exponent) {
  const int64_t whole = cols / kN;
  for (int64_t j = 0; j < whole; ++j) top[j] = finite_max(row + j * kN, kN, top[j], exponent);
  if (whole * kN < cols)
    top[whole] = finite_max(row + whole * kN, cols - whole * kN, top[whole], exponent);
}

// Each block's largest finite magnitude into c.scales (scaled_scales_range turns them into the
// scales in place), for block rows [br0, br1).
template <class In>
void amax_rows(const ScaledCall& c, int64_t br0, int64_t br1) {
  using U = RawOf<In>;
  const U* x = static_cast<const U*>(c.x);
  const U exponent = U(exponent_mask(c.dtype));
  const int64_t gc = c.block_grid_cols(), bc = c.block_cols;
  constexpr int64_t kStack = 512;  // block columns kept on the stack (more: a heap buffer)
  U stack_top[kStack];
  std::vector<U> heap_top(static_cast<size_t>(gc > kStack ? gc : 0));
  U* top = gc > kStack ? heap_top.data() : stack_top;
  for (int64_t br = br0; br < br1; ++br) {
    for (int64_t j = 0; j < gc; ++j) top[j] = 0;
    const int64_t r1 = min_of(c.rows, (br + 1) * c.block_rows);
    for (int64_t r = br * c.block_rows; r < r1; ++r) {
      const U* row = x + r * c.cols;
      if (bc == 32) {
        row_block_max<32>(row, c.cols, top, exponent);
      } else if (bc == 16) {
        row_block_max<16>(row, c.cols, top, exponent);
      } else {
        for (int64_t j = 0, c0 = 0; c0 < c.cols; ++j, c0 += bc)
          top[j] = finite_max(row + c0, min_of(bc, c.cols - c0), top[j], exponent);
      }
    }
    for (int64_t j = 0; j < gc; ++j) {
      In v;
      std::memcpy(&v, &top[j], sizeof(U));
      c.scales[br * gc + j] = bit_cast<double>(Widen<uint64_t>::from(v));
    }
  }
}

// fn(std::true_type{}) or fn(std::false_type{}): a run-time flag as a template parameter.
template <class Fn>
void with_flag(bool v, Fn&& fn) {
  if (v) fn(std::true_type{});
  else fn(std::false_type{});
}

// The element pass walks each row in tiles of kTile elements that span many blocks (a block of
// 16 or 32 is too short a loop to vectorise well): a tile's per-element scales (and their
// inverses) are spread into buffers first, then one flat loop rounds the tile. Stochastic
// rounding finds element i's Philox word at rand[phase + i] (words by row-major index).
//
// Loads from the scale buffers stall behind the loop's stores to y when their addresses agree
// modulo 4 KB (4K aliasing: it slowed the MXFP8 pass by half, depending only on where the stack
// and y happened to lie), so each tile's float32 scales start half a page from its first output,
// modulo a page, inside buffers a page longer than a tile (place32).
struct TileScales {
  static constexpr int64_t kPage = 4096;
  alignas(64) double s[kTile];
  alignas(64) double inv[kTile];
  // The float32 carrier's: this tile's at s32_buf + at32 and inv32_buf + at32. (In the float64
  // carrier, 8-byte scales beside 4-byte outputs pass every offset within a tile anyway.)
  alignas(64) float s32_buf[kTile + kPage / 4];
  alignas(64) float inv32_buf[kTile + kPage / 4];  // (a page longer than s32_buf: same offset)
  alignas(64) uint32_t rand[kTile + 4];
  int64_t at32 = 0;
  void place32(const void* y) {
    const uintptr_t gap = (uintptr_t(y) + kPage / 2 - uintptr_t(s32_buf)) % kPage;
    at32 = int64_t(gap & ~uintptr_t(63)) / int64_t(sizeof(float));  // (64-byte aligned)
  }
};

// A tile's rounding events, in counters of the loop's lane width (int32 beside 32-bit lanes keeps
// the float32 loop at 16 lanes), added to the call's totals at its end.
template <class T>
struct TileEvents {
  T above = 0, under = 0, nans = 0;
  void add(const RoundEvents& ev) {
    above += ev.above_max;
    under += ev.underflow;
    nans += ev.nan;
  }
  void into(int64_t& overflow, int64_t& underflow, int64_t& nan) const {
    overflow += int64_t(above) - int64_t(nans);  // see RoundEvents
    underflow += under;
    nan += nans;
  }
};

// One tile in the float64 carrier: n elements from index `first` (row-major). kPow2: every scale
// is a power of two, so x · (1 / s) is the exact quotient; else divide_nudged. kParts: write q.
// kAdd: nearest rounding by addition (ScaledCall::nearest_by_addition). kOnce: x / s rounded
// once (ScaledCall::divide_once).
template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kParts, bool kAdd,
          bool kOnce>
void run_tile(const ScaledCall& c, int64_t first, int64_t n, int64_t phase, const TileScales& t,
              int64_t& overflow, int64_t& underflow, int64_t& nan) {
  const In* x = static_cast<const In*>(c.x) + first;
  In* y = static_cast<In*>(c.y) + first;
  float* q_out = kParts ? c.q + first : nullptr;
  const RoundParams<uint64_t> p = c.p;
  const RoundParams<uint64_t> out = c.out;
  TileEvents<int64_t> events;
  for (int64_t i = 0; i < n; ++i) {
    const double xv = bit_cast<double>(Widen<uint64_t>::from(x[i]));
    RoundEvents ev;
    const uint32_t rw = Kind == RoundKind::Stochastic ? t.rand[phase + i] : 0u;
    const double q = scaled_element<Kind, kPow2, kSubExp, kAdd, kOnce>(xv, t.s[i], t.inv[i], p, rw,
                                                                      ev, c.addition_cap);
    if constexpr (kParts) q_out[i] = float(q);
    y[i] = store_scaled<In>(q * t.s[i], out);
    if constexpr (kCount) events.add(ev);
  }
  events.into(overflow, underflow, nan);
}

// run_tile in the float32 carrier (ScaledCall::narrow): every scale is 2^k. kAdd: nearest
// rounding by addition (ScaledCall::nearest_by_addition).
template <class In, RoundKind Kind, bool kCount, bool kParts, bool kAdd>
void run_tile_narrow(const ScaledCall& c, int64_t first, int64_t n, int64_t phase,
                     const TileScales& t, int64_t& overflow, int64_t& underflow, int64_t& nan) {
  const In* x = static_cast<const In*>(c.x) + first;
  In* y = static_cast<In*>(c.y) + first;
  float* q_out = kParts ? c.q + first : nullptr;
  const float* s32 = t.s32_buf + t.at32;
  const float* inv32 = t.inv32_buf + t.at32;
  const RoundParams<uint32_t> p = c.p32;
  const RoundParams<uint32_t> out = c.out32;
  TileEvents<int32_t> events;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t xb = Widen<uint32_t>::from(x[i]);
    const uint32_t qb = bit_cast<uint32_t>(bit_cast<float>(xb) * inv32[i]);
    // A quotient that underflowed to 0 stays nonzero (its sign and nonzero-ness are all E's
    // rounding sees below 2^-126).
    const bool lost = ((qb << 1) == 0u) & ((xb << 1) != 0u);
    const uint32_t quotient = select(lost, (xb & 0x80000000u) | 1u, qb);
    RoundEvents ev;
    const uint32_t rw = Kind == RoundKind::Stochastic ? t.rand[phase + i] : 0u;
    const float q = bit_cast<float>(
        kAdd ? round_nearest_by_addition(quotient, p, c.addition_cap, ev)
             : round_bits<Kind, uint32_t, false>(quotient, p, rw, ev));
    if constexpr (kParts) q_out[i] = q;
    const float v = q * s32[i];  // exact (ScaledCall::narrow)
    if constexpr (std::is_same_v<In, float>) {
      y[i] = v;
    } else {
      RoundEvents store_ev;
      y[i] = Store<In>::from(
          round_bits<RoundKind::Nearest, uint32_t, false>(bit_cast<uint32_t>(v), out, 0u, store_ev));
    }
    if constexpr (kCount) events.add(ev);
  }
  events.into(overflow, underflow, nan);
}

template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kParts>
void elements(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  const int64_t gc = c.block_grid_cols(), bc = c.block_cols;
  constexpr bool kMayNarrow = kPow2 && !std::is_same_v<In, double>;
  constexpr bool kMayDivideOnce =
      Kind == RoundKind::Nearest && !kPow2 && !std::is_same_v<In, double>;
  const bool narrow = kMayNarrow && c.narrow;
  TileScales t;
  int64_t overflow = 0, underflow = 0, nan = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const double* scales = c.scales + (r / c.block_rows) * gc;
    for (int64_t t0 = 0; t0 < c.cols; t0 += kTile) {
      const int64_t len = min_of(kTile, c.cols - t0), first = r * c.cols + t0;
      if (narrow) t.place32(static_cast<In*>(c.y) + first);
      float* s32 = t.s32_buf + t.at32;
      float* inv32 = t.inv32_buf + t.at32;
      for (int64_t i = 0, j = t0 / bc; i < len; ++j) {  // spread each block's scale
        const int64_t stop = min_of(len, (j + 1) * bc - t0);
        const double s = scales[j], inv = 1.0 / s;
        if (narrow) {
          for (; i < stop; ++i) s32[i] = float(s), inv32[i] = float(inv);  // 2^±k: exact
        } else {
          for (; i < stop; ++i) t.s[i] = s, t.inv[i] = inv;
        }
      }
      const int64_t phase = first % 4;
      if constexpr (Kind == RoundKind::Stochastic)
        philox_fill(t.rand, c.seed, c.offset + uint64_t(first / 4), (phase + len + 3) / 4);
      if constexpr (kMayNarrow) {
        if (narrow) {
          if constexpr (Kind == RoundKind::Nearest) {
            if (c.nearest_by_addition) {
              run_tile_narrow<In, Kind, kCount, kParts, true>(c, first, len, phase, t, overflow,
                                                              underflow, nan);
              continue;
            }
          }
          run_tile_narrow<In, Kind, kCount, kParts, false>(c, first, len, phase, t, overflow,
                                                           underflow, nan);
          continue;
        }
      }
      bool add = false, once = false;  // (the float64 carrier's faster forms, where they hold)
      if constexpr (Kind == RoundKind::Nearest) {
        add = !kSubExp && c.nearest_by_addition;
        once = kMayDivideOnce && c.divide_once;
      }
      with_flag(add, [&](auto add_c) {
        with_flag(once, [&](auto once_c) {
          constexpr bool kAdd = decltype(add_c)::value && Kind == RoundKind::Nearest && !kSubExp;
          constexpr bool kOnce = decltype(once_c)::value && kMayDivideOnce;
          run_tile<In, Kind, kCount, kPow2, kSubExp, kParts, kAdd, kOnce>(c, first, len, phase, t,
                                                                        overflow, underflow, nan);
        });
      });
    }
  }
  counts.overflow += overflow;
  counts.underflow += underflow;
  counts.nan += nan;
}

}  // namespace

void scaled_amax_range(const ScaledCall& c, int64_t br0, int64_t br1) {
  with_storage_type(c.dtype, [&](auto p) {
    amax_rows<std::remove_const_t<std::remove_pointer_t<decltype(p)>>>(c, br0, br1);
  });
}

void scaled_scales_range(const ScaledCall& c, double t, int64_t b0, int64_t b1, int64_t& saturated) {
  double* v = c.scales;  // in place: each block's largest magnitude becomes its scale
  // A block without a finite nonzero element takes the smallest scale.
  const double empty = c.scale.rule == ScaleRule::Format ? c.scale.s_smallest * t : 0x1p-127;
  int64_t n = 0;
  if (c.scale.rule == ScaleRule::Format) {  // a loop of its own: it vectorises
    const ScaleSpec sp = c.scale;
    for (int64_t b = b0; b < b1; ++b) {
      const double a = v[b];
      bool sat;
      const double s = format_block_scale(sp, a > 0.0 ? a : 1.0, t, sat);
      v[b] = a > 0.0 ? s : empty;
      n += int64_t(sat & (a > 0.0));
    }
  } else {
    for (int64_t b = b0; b < b1; ++b) {
      bool sat = false;
      v[b] = v[b] > 0.0 ? block_scale(c.scale, v[b], t, sat) : empty;
      n += sat;
    }
  }
  saturated += n;
}

void scaled_elements_range(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  with_storage_type(c.dtype, [&](auto p) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    auto go = [&](auto kind) {
      constexpr RoundKind K = decltype(kind)::value;
      // x · (1 / s) is the exact quotient for E8M0's power-of-two scales.
      with_flag(c.count, [&](auto count) {
        with_flag(c.scale.rule != ScaleRule::Format, [&](auto pow2) {
          with_flag(c.p.subnormal_exponent, [&](auto sub) {
            with_flag(c.q != nullptr, [&](auto parts) {
              elements<In, K, decltype(count)::value, decltype(pow2)::value, decltype(sub)::value,
                       decltype(parts)::value>(c, r0, r1, counts);
            });
          });
        });
      });
    };
    switch (round_kind(c.mode)) {
      case RoundKind::Nearest: return go(std::integral_constant<RoundKind, RoundKind::Nearest>{});
      case RoundKind::Directed: return go(std::integral_constant<RoundKind, RoundKind::Directed>{});
      default: return go(std::integral_constant<RoundKind, RoundKind::Stochastic>{});
    }
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
