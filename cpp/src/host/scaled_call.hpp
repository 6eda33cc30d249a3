// One scaled-format rounding (docs/design.md §9) as the drivers see it: a buffer viewed as
// (rows, cols), row-major, cut into blocks of block_rows × block_cols (the last ones may be short),
// one scale per block.
#pragma once
#include <cstdint>
#include <type_traits>

#include "dispatch.hpp"
#include "lowfp/hadamard.hpp"
#include "lowfp/philox.hpp"
#include "lowfp/scaled.hpp"

namespace lowfp {

// Block b of a call (row-major over the block grid): its first row and column, and its rows and
// columns (the grid's last ones may be short).
struct ScaledBlock {
  int64_t r0, c0, h, w;
};

// Checked's stochastic rounding needs a margin of 2^(m + 13) of the 2^32 positions: beyond m = 5
// more than one element in 2^12 would be rounded twice.
constexpr int32_t kCheckedStochasticMaxM = 5;

struct ScaledCall {
  const void* x;
  void* y;                       // s · q in x's dtype (may be x)
  DType dtype;
  int64_t rows, cols, block_rows, block_cols;
  ScaleSpec scale;
  bool tensor_scale;             // a float32 second-level scale t = amax / (max_S · max_E)
  RoundParams<uint64_t> p;       // E, with the call's rounding mode and overflow policy
  RoundParams<uint64_t> out;     // nearest to dtype (16-bit outputs: s · q may be off its grid)
  double t;                      // the tensor scale (1 without one), known after the scales
  Rounding mode;
  bool count;
  bool count_blocks;             // the counts buffer holds the block counts too (6, not 4)
  uint64_t seed, offset;         // stochastic: element (r, c) takes word w % 4 of Philox block
                                 // offset + w / 4, w = word_index(r, c) (offset: a block offset)
  // 0: w = r·cols + c, the row-major index. Else the buffer is the tensor read where it lies
  // with its blocks down the columns (scaled.config.kernel_layout's column layout), each column
  // of each run of word_run rows one line of the axis holding the blocks, and w is the element's
  // index with that axis moved last (docs/design.md §9): ((r / word_run)·cols + c)·word_run +
  // r % word_run. A multiple of 4 (with_buffers), so that rows 4j .. 4j + 3 of a column take
  // the four words of one Philox block, and no block crosses a run.
  int64_t word_run;
  double* scales;                // per block, row-major over the block grid: s (t included)
  float* q;                      // optional (nullptr): the elements q, row-major (E fits float32)
  // The float32 carrier (scaled.hpp's narrow_element): power-of-two scales, an input of at most
  // 32 bits and E's finest step at least 2^-22, so that x · 2^-k is exact or below 2^-126 (where
  // only its sign and being nonzero decide E's rounding, with 32 random bits too) and s · q is
  // exact in float32. p32 and out32: E and, for 16-bit inputs, the storage type in that carrier
  // (p32 set whenever the input is not float64)
  bool narrow;
  RoundParams<uint32_t> p32, out32;
  // narrow, stochastic, and round.hpp's stochastic_by_steps(p32): the float32 carrier rounds E
  // by steps (round_stochastic_by_steps)
  bool steps32;
  // nearest, and round.hpp's nearest_by_addition(p32, addition_cap): E's nearest rounding in the
  // float32 carrier may take the addition (round_nearest_by_addition) wherever that carrier is
  // exact (narrow, or the CPU's checked quotient)
  bool add32;
  // The checked float32 carrier (scaled.hpp's checked_element): float32 inputs, scales in a
  // format, E's finest step at least 2^-22 and m <= 18, q · S exact in float32 when there is a
  // tensor scale, and E's rounding nearest by addition (add32) or stochastic by steps (m at most
  // kCheckedStochasticMaxM) in float32. checked_margin: its stochastic check's margin.
  bool checked;
  uint32_t checked_margin;
  // The float64 carrier's faster forms (scaled_element's kFaster and kOnce, with_float64_forms):
  // E's nearest rounding by addition where nearest_by_addition(p, addition_cap) holds (add64),
  // its stochastic rounding by steps where stochastic_by_steps(p) holds (steps64), x / s rounded
  // once where nearest_divides_once holds (divide_once: scales in a format); addition_cap: E's
  // largest exponent + 1
  int32_t addition_cap;
  bool add64, steps64, divide_once;
  LOWFP_HD int64_t block_grid_cols() const { return (cols + block_cols - 1) / block_cols; }
  LOWFP_HD int64_t block_grid_rows() const { return (rows + block_rows - 1) / block_rows; }
  LOWFP_HD ScaledBlock block(int64_t b) const {
    const int64_t gc = block_grid_cols(), r0 = (b / gc) * block_rows, c0 = (b % gc) * block_cols;
    return {r0, c0, min_of(rows, r0 + block_rows) - r0, min_of(cols, c0 + block_cols) - c0};
  }
  LOWFP_HD uint64_t word_index(int64_t r, int64_t c) const {
    if (word_run == 0) return uint64_t(r * cols + c);
    return uint64_t(((r / word_run) * cols + c) * word_run + r % word_run);
  }
};

// fn(type, kind, faster, once) for a call's float64-carrier rounding: its storage type (In =
// decltype(type)::type) and rounding kind, and, as std::integral_constant<bool>, whether E's
// rounding may take its faster form (kFaster: nearest by addition, stochastic by steps) and x / s
// be rounded once (kOnce), scaled_element's faster forms: neither faster form finds subnormal
// exponents, x / s rounded once needs an input of at most 24 bits and scales in a format.
template <class Fn>
void with_float64_forms(const ScaledCall& c, Fn&& fn) {
  with_storage_type(c.dtype, [&](auto type) {
    using In = typename decltype(type)::type;
    with_round_kind(c.mode, [&](auto kind) {
      constexpr bool kNearest = decltype(kind)::value == RoundKind::Nearest;
      constexpr bool kStochastic = decltype(kind)::value == RoundKind::Stochastic;
      constexpr bool kNarrowInput = !std::is_same_v<In, double>;
      const bool faster = !c.p.subnormal_exponent && ((kNearest && c.add64) || (kStochastic && c.steps64));
      const bool once = kNearest && c.scale.rule == ScaleRule::Format && kNarrowInput && c.divide_once;
      with_flag(faster, [&](auto faster_c) {
        with_flag(once, [&](auto once_c) {
          fn(type, kind, std::integral_constant<bool, decltype(faster_c)::value && (kNearest || kStochastic)>{},
             std::integral_constant<bool, decltype(once_c)::value && kNearest && kNarrowInput>{});
        });
      });
    });
  });
}

// 4over6 (BlockChoice): the scale of block b (block-grid row-major) whose largest finite magnitude
// is a > 0, under the tensor scale t: the map-to-6 candidate (the rule's) unless the map-to-4 one
// leaves a smaller error. Each candidate's elements are rounded as the element pass rounds them
// (the call's rounding, overflow and random words, scaled_element in the float64 carrier; kFaster
// and kOnce its faster forms where they hold, the same bits), so the chosen candidate's q are the
// ones the call then writes. saturated: the chosen scale's.
template <class In, RoundKind Kind, bool kFaster = false, bool kOnce = false>
LOWFP_HD double four_over_six_scale(const ScaledCall& c, int64_t b, double a, double t, bool& saturated) {
  bool sat6, sat4;
  const double s6 = format_block_scale(c.scale, a, t, sat6);
  const double s4 = map_to_four_scale(c.scale, a, t, sat4);
  const ScaledBlock at = c.block(b);
  const int64_t r0 = at.r0, c0 = at.c0, r1 = r0 + at.h, c1 = c0 + at.w;
  const In* x = static_cast<const In*>(c.x);
  const int32_t e_cap = c.addition_cap;
  // Each run of up to kChunk elements of a row: the shares of the error side by side (a loop
  // without branches, which the CPU's compiler vectorises), then added in order.
  constexpr int64_t kChunk = 16;
  double e6 = 0.0, e4 = 0.0;
  // Stochastic: the Philox block last drawn, which the next elements take while their words
  // (word_index) lie in it: consecutive elements of a row, or a column's rows with a word_run.
  Philox4x32Block words = {{0u, 0u, 0u, 0u}};
  uint64_t drawn = ~uint64_t(0);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i0 = r * c.cols + c0; i0 < r * c.cols + c1; i0 += kChunk) {
      const int64_t n = min_of(kChunk, r * c.cols + c1 - i0);
      uint32_t rw[kChunk] = {};
      if constexpr (Kind == RoundKind::Stochastic)
        for (int64_t j = 0; j < n; ++j) {
          const uint64_t w = c.word_index(r, i0 + j - r * c.cols), at = c.offset + w / 4;
          if (at != drawn) {
            words = philox_block(c.seed, at);
            drawn = at;
          }
          rw[j] = words.w[w % 4];
        }
      double d6[kChunk], d4[kChunk];
      for (int64_t j = 0; j < n; ++j) {
        const double xv = bit_cast<double>(Widen<uint64_t>::from(x[i0 + j]));
        // inf and NaN, which any scale leaves, add nothing: they are rounded as 0
        const double xf = xv - xv == 0.0 ? xv : 0.0;
        RoundEvents ev;
        const double q6 = scaled_element<Kind, false, true, kFaster, kOnce>(xf, s6, 1.0 / s6, c.p, rw[j], ev, e_cap);
        const double q4 = scaled_element<Kind, false, true, kFaster, kOnce>(xf, s4, 1.0 / s4, c.p, rw[j], ev, e_cap);
        d6[j] = choice_error(c.scale.choice, xf, q6 * s6);
        d4[j] = choice_error(c.scale.choice, xf, q4 * s4);
      }
      for (int64_t j = 0; j < n; ++j) {
        e6 += d6[j];
        e4 += d4[j];
      }
    }
  const bool four = e4 < e6;
  saturated = four ? sat4 : sat6;
  return four ? s4 : s6;
}

// The random Hadamard transform (lowfp/hadamard.hpp) of each group of 16 consecutive elements of
// x, a contiguous buffer of `groups` groups of dtype, into y: float64 for float64 x, float32 for
// the others (16-bit inputs widened exactly).
struct HadamardCall {
  const void* x;
  DType dtype;
  void* y;
  int64_t groups;
  double signs[kHadamardSize];  // (each converted to y's type)
  bool inverse;
};

// An input element in the transform's type T (float64 for float64 inputs, float32 for the
// others; exact).
template <class T, class In>
LOWFP_HD T widen_to(In x) {
  if constexpr (sizeof(T) == 8)
    return x;
  else
    return bit_cast<float>(Widen<uint32_t>::from(x));
}

// The transform of group g of c, T the type of c.y, In the storage type of c.dtype.
template <class In, class T>
LOWFP_HD void hadamard_group(const HadamardCall& c, const T (&signs)[kHadamardSize], int64_t g) {
  const In* x = static_cast<const In*>(c.x) + g * kHadamardSize;
  T v[kHadamardSize];
  for (int i = 0; i < kHadamardSize; ++i) v[i] = widen_to<T>(x[i]);
  hadamard16(v, signs, c.inverse);
  T* y = static_cast<T*>(c.y) + g * kHadamardSize;
  for (int i = 0; i < kHadamardSize; ++i) y[i] = v[i];
}

// A scaled rounding as the caller asks for it, without its buffers: lowfp prepares one per
// (format, rounding, overflow, sr_bits, dtype) and reuses it for every tensor.
struct ScaledRequest {
  FormatSpec element;
  Overflow overflow;
  Rounding mode;
  int32_t sr_bits;
  ScaleRule rule;
  FormatSpec scale_format;  // rule Format: S (float32 scales: fp(8,23,0,ieee)); else unused
  bool tensor_scale;
  BlockChoice choice;       // not Fixed: scales in a format, a tensor scale, E2M1 elements
  DType dtype;
};

// Checks r (std::invalid_argument: pybind11's ValueError) and builds the call, its buffers,
// shape, blocks, seed and offset left for with_buffers.
ScaledCall prepare_scaled_call(const ScaledRequest& r);

// A prepared call on x (rows × cols, row-major, in blocks of block_rows × block_cols) into y,
// writing one scale per block into scales (required), the elements into q when not null,
// counting when counts_size is 4 (element counts) or 6 (block counts too), not when it is 0;
// word_run, seed and offset as ScaledCall's. Throws std::invalid_argument on a negative shape,
// an empty block, a word_run that is not 0 or a multiple of 4 dividing rows (and of block_rows,
// unless it is rows), a missing scales buffer or another counts size.
ScaledCall with_buffers(ScaledCall c, const void* x, void* y, int64_t rows, int64_t cols,
                        int64_t block_rows, int64_t block_cols, int64_t word_run, uint64_t seed,
                        uint64_t offset, double* scales, float* q, int32_t counts_size);

}  // namespace lowfp
