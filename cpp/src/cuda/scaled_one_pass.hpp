// The per-thread math of the one-pass scaled kernels (scaled_rows.cu, scaled_columns.cu,
// scaled_tiles.cu), written for nvcc and for the host compiler: a block's scale in the forms its
// elements take (block_forms), an element's rounding in the call's carrier (round_in_carrier), a
// lane's turn of row_blocks_kernel in its two halves on either side of the block's shuffle
// (row_blocks_load, row_blocks_round), a thread's block of column_blocks_kernel (column_block), a
// thread's share of a block of tile_blocks_kernel in its two halves on either side of the block's
// maximum (tile_block_max, tile_block_round), which calls take which kernel, and the kernel
// instance a call takes (with_one_pass_instance). tests/cpp/scaled_one_pass_on_lanes.cpp runs them
// on the CPU in CI, warp by warp and lane by lane, against the float64 carrier's plain rounding of
// every block.
#pragma once
#include <cstring>
#include <type_traits>

#include "lowfp/philox.hpp"
#include "lowfp/scaled.hpp"
#include "row_blocks_schedule.hpp"
#include "scaled_call.hpp"
#include "thread_values.hpp"

namespace lowfp {

// The magnitude of an element's raw bits, 0 for infinities and NaNs: the raw bits of nonnegative
// floats order as their values do, so maxima are taken on them.
template <class U>
LOWFP_HD U finite_magnitude(U bits, U exponent) {
  const U a = U(bits & U(U(~U(0)) >> 1));
  return select(a < exponent, a, U(0));
}

template <class In>
LOWFP_HD double raw_value(RawOf<In> bits) {
  In v;
  memcpy(&v, &bits, sizeof(bits));
  return bit_cast<double>(Widen<uint64_t>::from(v));
}

// 1 / s: by its bits for power-of-two scales (kPow2: pow2_inverse), else a division.
template <bool kPow2>
LOWFP_HD double inverse_of(double s) {
  return kPow2 ? pow2_inverse(s) : 1.0 / s;
}

// One element's rounding given its block's scale s (inverse inv) and random word: q into c.q when
// asked, s · q returned in the storage type, its events into tc when kCount. kFaster, kOnce:
// scaled_element's faster forms (with_float64_forms).
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, bool kFaster = false, bool kOnce = false>
LOWFP_HD In round_scaled(const ScaledCall& c, In x, int64_t i, double s, double inv, uint32_t word,
                           ThreadCounts& tc) {
  RoundEvents ev;
  const double q = scaled_element<K, kPow2, kSubExp, kFaster, kOnce>(bit_cast<double>(Widen<uint64_t>::from(x)), s,
                                                                  inv, c.p, word, ev, c.addition_cap);
  if (c.q != nullptr) c.q[i] = float(q);
  if (kCount) tc.add(ev);
  return store_scaled<In>(q * s, c.out);
}

// round_scaled in the float32 carrier (ScaledCall::narrow), given the block's scale and inverse
// as float32 (2^±k: exact). kFaster32: narrow_element's faster form (nearest by addition where
// ScaledCall::add32 holds, stochastic by steps where ScaledCall::steps32 does).
template <class In, RoundKind K, bool kCount, bool kFaster32>
LOWFP_HD In round_narrow(const ScaledCall& c, In x, int64_t i, float s32, float inv32, uint32_t word,
                           ThreadCounts& tc) {
  // (a quotient that underflowed to 0 kept nonzero unless only its nearest rounding is wanted)
  constexpr bool kKeep = kCount || K != RoundKind::Nearest;
  RoundEvents ev;
  const float q = narrow_element<K, kKeep, kFaster32>(Widen<uint32_t>::from(x), inv32, c.p32, word, ev,
                                                    c.addition_cap);
  if (c.q != nullptr) c.q[i] = q;
  if (kCount) tc.add(ev);
  return store_narrow<In>(q * s32, c.out32);
}

// Where a one-pass kernel's elements are rounded: the float64 carrier (round_scaled), the float32
// carrier of power-of-two scales (round_narrow, ScaledCall::narrow), or the checked float32
// carrier of scales in a format (round_checked, ScaledCall::checked).
enum class Carrier { Float64, Narrow, Checked };

// One block's scale as its elements take it: s and 1 / s; for Narrow, s and 1 / s as float32 (2^±k:
// exact); for Checked, S = s / t, fl(1 / s) and t as float32, and whether fl(1 / s) is a normal
// float32 (checkable: else the block's elements take the float64 carrier, as on the CPU).
struct BlockForms {
  double s, inv;
  float s32, inv32, t32;
  bool checkable;
};

// The checked carrier's forms of a scale s = S · t (S its value in the scale format).
LOWFP_HD BlockForms checked_forms(double s, double big_s, double t) {
  BlockForms f{};
  f.s = s;
  f.inv = 1.0 / s;
  f.s32 = float(big_s);
  f.inv32 = float(f.inv);
  f.t32 = float(t);
  f.checkable = bit_cast<uint32_t>(f.inv32) - 0x00800000u <= 0x7e800000u;  // in [2^-126, 2^127]
  return f;
}

// The forms of the scale of a block with largest finite magnitude a (0: an empty block, whose
// scale is `empty`) under the tensor scale t; saturated as block_scale's.
template <Carrier kCarrier, bool kPow2>
LOWFP_HD BlockForms block_forms(const ScaledCall& c, double a, double t, double empty, bool& saturated) {
  if constexpr (kCarrier == Carrier::Checked) {
    const double big_s = a > 0.0 ? stored_scale(c.scale, a, t, saturated) : c.scale.s_smallest;
    return checked_forms(big_s * t, big_s, t);  // (block_scale's and empty_block_scale's s)
  } else {
    BlockForms f{};
    f.s = a > 0.0 ? block_scale(c.scale, a, t, saturated) : empty;
    f.inv = inverse_of<kPow2>(f.s);
    f.s32 = float(f.s);
    f.inv32 = float(f.inv);
    return f;
  }
}

// round_scaled in the checked float32 carrier (float32 inputs): checked_element, and where its
// check fails or the block is not checkable, the float64 carrier's exact rounding (E's finest
// step of at least 2^-22: no float64 subnormal needs its true exponent). s · q as (q · S) · t.
template <RoundKind K, bool kCount>
LOWFP_HD float round_checked(const ScaledCall& c, float x, int64_t i, const BlockForms& f, uint32_t word,
                               ThreadCounts& tc) {
  if (f.checkable) {
    RoundEvents ev;
    uint32_t near;
    const float q = checked_element<K, kCount>(bit_cast<uint32_t>(x), f.inv32, c.p32, c.addition_cap, word,
                                               c.checked_margin, ev, near);
    if (!near) {
      if (c.q != nullptr) c.q[i] = q;
      if (kCount) tc.add(ev);
      return (q * f.s32) * f.t32;
    }
  }
  return round_scaled<float, K, kCount, false, false>(c, x, i, f.s, f.inv, word, tc);
}

// One element of a one-pass kernel in its carrier (template parameters: row_blocks_kernel's).
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, Carrier kCarrier, bool kFaster, bool kOnce,
          bool kFaster32>
LOWFP_HD In round_in_carrier(const ScaledCall& c, In x, int64_t i, const BlockForms& f, uint32_t word,
                               ThreadCounts& tc) {
  if constexpr (kCarrier == Carrier::Narrow) return round_narrow<In, K, kCount, kFaster32>(c, x, i, f.s32, f.inv32, word, tc);
  else if constexpr (kCarrier == Carrier::Checked) return round_checked<K, kCount>(c, x, i, f, word, tc);
  else return round_scaled<In, K, kCount, kPow2, kSubExp, kFaster, kOnce>(c, x, i, f.s, f.inv, word, tc);
}

// Whether a call takes row_blocks_kernel: 1-D blocks along the rows of 4 · 2^k elements (at most
// 128: a warp's lanes hold a block) that cut each row evenly, one scale candidate, and x and y
// aligned for quads (of 16 bytes at most).
inline bool row_blocks(const ScaledCall& c) {
  const int64_t w = c.block_cols;
  const uintptr_t align = uintptr_t(min_of(16, 4 * dtype_size(c.dtype)));
  return c.block_rows == 1 && c.word_run == 0 && w >= 4 && w <= 128 && (w & (w - 1)) == 0 &&
         c.cols % w == 0 && c.scale.choice == BlockChoice::Fixed && reinterpret_cast<uintptr_t>(c.x) % align == 0 &&
         reinterpret_cast<uintptr_t>(c.y) % align == 0;
}

// The first half of a lane's turn in row_blocks_kernel: the quads of block b it holds (s), read
// into `in` where live (b is a block of the call), and their largest finite magnitude (raw bits;
// exponent: exponent_mask(c.dtype), found once a kernel). A quad not held reads as 0s, which
// leave the maximum.
template <class In>
LOWFP_HD RawOf<In> row_blocks_load(const ScaledCall& c, const RowBlocksSchedule& s, int64_t b, bool live,
                                   RawOf<In> exponent, Quad<In> (&in)[kRowBlocksQuads]) {
  using U = RawOf<In>;
  const Quad<In>* x = static_cast<const Quad<In>*>(c.x);
  LOWFP_UNROLL
  for (int q = 0; q < kRowBlocksQuads; ++q) {
    in[q] = Quad<In>{};
    if (live && q < s.quads) in[q] = x[s.quad(b, q)];
  }
  U m = 0;
  LOWFP_UNROLL
  for (int q = 0; q < kRowBlocksQuads; ++q)
    LOWFP_UNROLL
    for (int k = 0; k < 4; ++k) {
      U bits;
      memcpy(&bits, &in[q].v[k], sizeof(U));
      m = max_of(m, finite_magnitude(bits, exponent));
    }
  return m;
}

// The second half, for a live block b whose largest finite magnitude over all its lanes is a:
// its scale (written by the block's first lane, which counts it in `saturated` when it
// saturated), and the lane's quads rounded in the carrier and stored, quad g taking Philox block
// offset + g. t: the tensor scale (1 without one); empty: the scale of a block without a finite
// nonzero element. Template parameters: row_blocks_kernel's.
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, Carrier kCarrier, bool kFaster, bool kOnce,
          bool kFaster32>
LOWFP_HD void row_blocks_round(const ScaledCall& c, const RowBlocksSchedule& s, int64_t b,
                               const Quad<In> (&in)[kRowBlocksQuads], double a, double t, double empty,
                               ThreadCounts& tc, uint64_t& saturated) {
  Quad<In>* y = static_cast<Quad<In>*>(c.y);
  bool sat = false;
  const BlockForms f = block_forms<kCarrier, kPow2>(c, a, t, empty, sat);
  if (s.part == 0) {
    c.scales[b] = f.s;
    saturated += sat;
  }
  LOWFP_UNROLL
  for (int q = 0; q < kRowBlocksQuads; ++q) {
    if (q >= s.quads) break;
    const int64_t g = s.quad(b, q);
    Philox4x32Block r = {{0u, 0u, 0u, 0u}};
    if constexpr (K == RoundKind::Stochastic) r = philox_block(c.seed, c.offset + uint64_t(g));
    Quad<In> out;
    LOWFP_UNROLL
    for (int k = 0; k < 4; ++k)
      out.v[k] = round_in_carrier<In, K, kCount, kPow2, kSubExp, kCarrier, kFaster, kOnce, kFaster32>(
          c, in[q].v[k], 4 * g + k, f, r.w[k], tc);
    y[g] = out;
  }
}

// Whether a call takes column_blocks_kernel: blocks down the columns, one scale candidate.
inline bool column_blocks(const ScaledCall& c) {
  return c.block_cols == 1 && c.scale.choice == BlockChoice::Fixed;
}

// Block b of column_blocks_kernel (block_cols 1; b = block-grid row · cols + column), a thread's
// whole work: its block_rows elements read down the column for the largest finite magnitude
// (exponent: exponent_mask(c.dtype)) and again (from cache) to round them, its scale written and
// counted in `saturated` when it saturated. Stochastic: each row's word w, the next one along
// with a word_run (a block lies within one run: with_buffers) or cols further on, and each
// Philox block drawn once (with a word_run, four consecutive rows share one). Template
// parameters: row_blocks_kernel's.
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, Carrier kCarrier, bool kFaster, bool kOnce,
          bool kFaster32>
LOWFP_HD void column_block(const ScaledCall& c, int64_t b, RawOf<In> exponent, double t, double empty,
                           ThreadCounts& tc, uint64_t& saturated) {
  using U = RawOf<In>;
  const In* x = static_cast<const In*>(c.x);
  In* y = static_cast<In*>(c.y);
  const int64_t col = b % c.cols, r0 = (b / c.cols) * c.block_rows;
  const int64_t first = r0 * c.cols + col, last = min_of(c.rows, r0 + c.block_rows) * c.cols;
  U m = 0;
  for (int64_t i = first; i < last; i += c.cols) {
    U bits;
    memcpy(&bits, &x[i], sizeof(U));
    m = max_of(m, finite_magnitude(bits, exponent));
  }
  bool sat = false;
  const BlockForms f = block_forms<kCarrier, kPow2>(c, raw_value<In>(m), t, empty, sat);
  c.scales[b] = f.s;
  saturated += sat;
  Philox4x32Block words = {{0u, 0u, 0u, 0u}};
  uint64_t drawn = ~uint64_t(0);
  const uint64_t w_step = c.word_run != 0 ? 1u : uint64_t(c.cols);
  uint64_t w = c.word_index(r0, col);
  for (int64_t i = first; i < last; i += c.cols, w += w_step) {
    uint32_t word = 0u;
    if constexpr (K == RoundKind::Stochastic) {
      const uint64_t at = c.offset + w / 4;
      if (at != drawn) {
        words = philox_block(c.seed, at);
        drawn = at;
      }
      word = words.w[w % 4];
    }
    y[i] = round_in_carrier<In, K, kCount, kPow2, kSubExp, kCarrier, kFaster, kOnce, kFaster32>(c, x[i], i, f, word,
                                                                                          tc);
  }
}

// The most elements of a block that tile_blocks_kernel takes: a larger block would keep one
// multiprocessor busy alone for long (the passes over the maxima, the scales and the elements
// spread it over the grid).
constexpr int64_t kTileMost = int64_t(1) << 16;

// Whether a call takes tile_blocks_kernel, of `threads` threads a thread block (when neither
// row_blocks nor column_blocks does): one scale candidate, row-major words, at least two blocks,
// each of `threads` to kTileMost elements, rows and blocks of whole quads, an input of at most 32
// bits, x and y aligned for quads.
inline bool tile_blocks(const ScaledCall& c, int threads) {
  const int64_t h = min_of(c.rows, c.block_rows), w = min_of(c.cols, c.block_cols);
  const uintptr_t align = uintptr_t(4 * dtype_size(c.dtype));
  return c.scale.choice == BlockChoice::Fixed && c.word_run == 0 && c.block_grid_rows() * c.block_grid_cols() > 1 &&
         h * w >= threads && h * w <= kTileMost && c.cols % 4 == 0 && c.block_cols % 4 == 0 &&
         c.dtype != DType::Float64 && reinterpret_cast<uintptr_t>(c.x) % align == 0 &&
         reinterpret_cast<uintptr_t>(c.y) % align == 0;
}

// A thread's share of one block of `units` units a row (a unit: an element, or a quad of four
// consecutive ones): rows row0, row0 + down, ... of the block and, in each, units unit0,
// unit0 + across, ... Consecutive threads take consecutive units of a row (coalesced), as many
// rows at a time as the thread block covers; threads past across · down take none. (One division
// a thread and block, none an element.)
struct BlockShare {
  int64_t across, down, row0, unit0;
  // thread `thread` of a thread block of `threads`
  LOWFP_HD BlockShare(int64_t units, unsigned thread, unsigned threads) {
    across = min_of<int64_t>(units, threads);
    down = threads / unsigned(across);
    row0 = thread / unsigned(across);
    unit0 = thread % unsigned(across);
  }
  // fn(r, u) for this thread's units (r, u) of a block of h rows of `units` units
  template <class Fn>
  LOWFP_HD void each(int64_t h, int64_t units, Fn&& fn) const {
    if (row0 >= down) return;
    for (int64_t r = row0; r < h; r += down)
      for (int64_t u = unit0; u < units; u += across) fn(r, u);
  }
};

// tile_blocks_kernel's two halves of a thread's work on block `at` (its share of the block's
// quads), on either side of the block's maximum over the thread block: the largest finite
// magnitude of the quads it holds (raw bits; exponent: exponent_mask(c.dtype)), then, given the
// block's forms f, those quads read again, rounded and stored. Quad (r, u) of the block starts at
// element (at.r0 + r) · cols + at.c0 + 4u, and element i takes word i % 4 of Philox block
// offset + i / 4 (row-major words; rows and blocks of whole quads: i % 4 == 0). Template
// parameters: row_blocks_kernel's.
template <class In>
LOWFP_HD RawOf<In> tile_block_max(const ScaledCall& c, const ScaledBlock& at, const BlockShare& share,
                                  RawOf<In> exponent) {
  using U = RawOf<In>;
  const In* x = static_cast<const In*>(c.x);
  U m = 0;
  share.each(at.h, at.w / 4, [&](int64_t r, int64_t u) {
    const Quad<In> in = *reinterpret_cast<const Quad<In>*>(x + (at.r0 + r) * c.cols + at.c0 + 4 * u);
    LOWFP_UNROLL
    for (int k = 0; k < 4; ++k) {
      U bits;
      memcpy(&bits, &in.v[k], sizeof(U));
      m = max_of(m, finite_magnitude(bits, exponent));
    }
  });
  return m;
}
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, Carrier kCarrier, bool kFaster, bool kOnce,
          bool kFaster32>
LOWFP_HD void tile_block_round(const ScaledCall& c, const ScaledBlock& at, const BlockShare& share,
                               const BlockForms& f, ThreadCounts& tc) {
  const In* x = static_cast<const In*>(c.x);
  In* y = static_cast<In*>(c.y);
  share.each(at.h, at.w / 4, [&](int64_t r, int64_t u) {
    const int64_t i = (at.r0 + r) * c.cols + at.c0 + 4 * u;
    const Quad<In> in = *reinterpret_cast<const Quad<In>*>(x + i);
    Philox4x32Block words = {{0u, 0u, 0u, 0u}};
    if constexpr (K == RoundKind::Stochastic) words = philox_block(c.seed, c.offset + uint64_t(i / 4));
    Quad<In> out;
    LOWFP_UNROLL
    for (int k = 0; k < 4; ++k)
      out.v[k] = round_in_carrier<In, K, kCount, kPow2, kSubExp, kCarrier, kFaster, kOnce, kFaster32>(
          c, in.v[k], i + k, f, words.w[k], tc);
    *reinterpret_cast<Quad<In>*>(y + i) = out;
  });
}

// fn(type, kind, count, pow2, sub, carrier, faster, once, faster32): the instance of a one-pass
// kernel that a call takes (the kernels' template parameters as types: Type<In>, Kind<K>,
// Flag<...> and Carrier's std::integral_constant): its storage type, rounding kind and float64
// faster forms (with_float64_forms), in the float32 carrier where ScaledCall::narrow holds
// (power-of-two scales; nearest by addition where add32 holds, stochastic by steps where steps32
// does), the checked one where ScaledCall::checked does, else the float64 carrier.
template <class Fn>
void with_one_pass_instance(const ScaledCall& c, Fn&& fn) {
  with_float64_forms(c, [&](auto type, auto kind, auto faster_c, auto once_c) {
    using In = typename decltype(type)::type;
    constexpr RoundKind K = decltype(kind)::value;
    constexpr bool kWide = std::is_same_v<In, double>;
    using No = Flag<false>;
    with_flag(c.count, [&](auto count) {
      // (the float32 carriers: never for float64 inputs, whose kernels have no such instance)
      constexpr bool kHasFaster32 = !kWide && (K == RoundKind::Nearest || K == RoundKind::Stochastic);
      if constexpr (!kWide) {
        if (c.narrow) {  // (power-of-two scales, no subnormal exponents)
          const bool faster32 = K == RoundKind::Nearest ? c.add32 : K == RoundKind::Stochastic && c.steps32;
          with_flag(faster32, [&](auto faster) {
            fn(type, kind, count, Flag<true>{}, No{}, std::integral_constant<Carrier, Carrier::Narrow>{}, No{}, No{},
               Flag<decltype(faster)::value && kHasFaster32>{});
          });
          return;
        }
      }
      if constexpr (std::is_same_v<In, float> && kHasFaster32) {
        if (c.checked) {  // (scales in a format, E's finest step at least 2^-22)
          fn(type, kind, count, No{}, No{}, std::integral_constant<Carrier, Carrier::Checked>{}, No{}, No{}, No{});
          return;
        }
      }
      with_flag(c.scale.rule != ScaleRule::Format, [&](auto pow2) {
        with_flag(c.p.subnormal_exponent, [&](auto sub) {
          constexpr bool kPow2 = decltype(pow2)::value, kSub = decltype(sub)::value;
          // (the faster forms: no subnormal exponents; dividing once: scales in a format)
          fn(type, kind, count, pow2, sub, std::integral_constant<Carrier, Carrier::Float64>{},
             Flag<decltype(faster_c)::value && !kSub>{}, Flag<decltype(once_c)::value && !kPow2>{}, No{});
        });
      });
    });
  });
}

}  // namespace lowfp
