// The scaled-format kernels (docs/design.md §9), compiled once per instruction-set level like
// quantize_kernels.cpp: the blocks' largest finite magnitudes, their scales, and the elements
// given their blocks' scales by the call's strategy (scaled/plan.hpp, one file each in scaled/).
#include <cstring>
#include <type_traits>
#include <vector>

#include "scaled/tile.hpp"

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

// Lane j of the result: the largest lane of v[j], by a tree of half exchanges (each level pairs
// the vectors and halves the lanes each keeps): 45 operations for 16 vectors, where reducing each
// vector on its own takes about 8.
inline Lanes16 lane_max_16(const Lanes16 (&v)[16]) {
  Lanes16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // [a8 | b8]
    w[i] = lanes_max(
        __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
        __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  for (int i = 0; i < 4; ++i)  // [a4 | b4 | c4 | d4]
    x[i] = lanes_max(
        __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
        __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
  for (int i = 0; i < 2; ++i)  // [a2 | b2 | ... | h2]
    y[i] = lanes_max(
        __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
        __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
  return lanes_max(
      __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
      __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}

// Blocks of a fixed width kN (the MX and NVFP4 sizes): a fully unrolled loop per block, except
// 32-bit elements in blocks of 16, 16 blocks at a time (lane_max_16).
template <int64_t kN, class U>
void row_block_max(const U* row, int64_t cols, U* top, U exponent) {
  const int64_t whole = cols / kN;
  int64_t j = 0;
  if constexpr (sizeof(U) == 4 && kN == 16) {
    const Lanes16 magnitude = Lanes16{} + 0x7fffffffu, exp_mask = Lanes16{} + uint32_t(exponent);
    auto finite = [&](const U* p) {
      Lanes16 v;
      std::memcpy(&v, p, sizeof v);
      v &= magnitude;
      return v < exp_mask ? v : Lanes16{};
    };
    for (; j + 16 <= whole; j += 16) {
      Lanes16 v[16];
      for (int k = 0; k < 16; ++k) v[k] = finite(row + (j + k) * kN);
      Lanes16 t;
      std::memcpy(&t, top + j, sizeof t);
      t = lanes_max(t, lane_max_16(v));
      std::memcpy(top + j, &t, sizeof t);
    }
  }
  for (; j < whole; ++j) top[j] = finite_max(row + j * kN, kN, top[j], exponent);
  if (whole * kN < cols)
    top[whole] = finite_max(row + whole * kN, cols - whole * kN, top[whole], exponent);
}

// Each block's largest finite magnitude into c.scales (scaled_scales_range turns them into the
// scales in place), for block rows [br0, br1); returns the largest of them.
template <class In>
double amax_rows(const ScaledCall& c, int64_t br0, int64_t br1) {
  using U = RawOf<In>;
  const U* x = static_cast<const U*>(c.x);
  const U exponent = U(exponent_mask(c.dtype));
  const int64_t gc = c.block_grid_cols(), bc = c.block_cols;
  constexpr int64_t kStack = 512;  // block columns kept on the stack (more: a heap buffer)
  U stack_top[kStack];
  std::vector<U> heap_top(static_cast<size_t>(gc > kStack ? gc : 0));
  U* top = gc > kStack ? heap_top.data() : stack_top;
  U most = 0;
  for (int64_t br = br0; br < br1; ++br) {
    for (int64_t j = 0; j < gc; ++j) top[j] = 0;
    const int64_t r1 = min_of(c.rows, (br + 1) * c.block_rows);
    for (int64_t r = br * c.block_rows; r < r1; ++r) {
      const U* row = x + r * c.cols;
      if (bc == 32) {
        row_block_max<32>(row, c.cols, top, exponent);
      } else if (bc == 16) {
        row_block_max<16>(row, c.cols, top, exponent);
      } else if (bc == 1) {  // blocks down the columns (kernel_layout's column layout)
        const U magnitude = U(U(~U(0)) >> 1);
        for (int64_t j = 0; j < c.cols; ++j) {
          const U a = U(row[j] & magnitude);
          top[j] = max_of(top[j], select(a < exponent, a, U(0)));
        }
      } else {
        for (int64_t j = 0, c0 = 0; c0 < c.cols; ++j, c0 += bc)
          top[j] = finite_max(row + c0, min_of(bc, c.cols - c0), top[j], exponent);
      }
    }
    for (int64_t j = 0; j < gc; ++j) {
      In v;
      std::memcpy(&v, &top[j], sizeof(U));
      c.scales[br * gc + j] = bit_cast<double>(Widen<uint64_t>::from(v));
      most = max_of(most, top[j]);  // (non-negative: the bits order them)
    }
  }
  In v;
  std::memcpy(&v, &most, sizeof(U));
  return bit_cast<double>(Widen<uint64_t>::from(v));
}

}  // namespace

double scaled_amax_range(const ScaledCall& c, int64_t br0, int64_t br1) {
  double most = 0.0;
  with_storage_type(c.dtype, [&](auto type) {
    most = amax_rows<typename decltype(type)::type>(c, br0, br1);
  });
  return most;
}

void scaled_scales_range(const ScaledCall& c, double t, int64_t b0, int64_t b1, int64_t& saturated) {
  double* v = c.scales;  // in place: each block's largest magnitude becomes its scale
  const double empty = empty_block_scale(c.scale, t);
  int64_t n = 0;
  if (c.scale.rule == ScaleRule::Format) {  // a loop of its own: it vectorises
    const ScaleSpec sp = c.scale;
    with_flag(sp.divide_once, [&](auto once) {
      with_flag(sp.by_addition, [&](auto add) {
        for (int64_t b = b0; b < b1; ++b) {
          const double a = v[b];
          bool sat;
          const double s = format_block_scale<decltype(once)::value, decltype(add)::value>(
              sp, a > 0.0 ? a : 1.0, t, sat);
          v[b] = a > 0.0 ? s : empty;
          n += int64_t(sat & (a > 0.0));
        }
      });
    });
  } else {  // a loop per rule: it vectorises
    auto loop = [&](auto rule) {
      constexpr ScaleRule R = decltype(rule)::value;
      const ScaleSpec sp = c.scale;
      for (int64_t b = b0; b < b1; ++b) {
        const double a = v[b];
        bool sat;
        const double s = pow2_block_scale<R>(sp, a > 0.0 ? a : 1.0, sat);
        v[b] = a > 0.0 ? s : empty;
        n += int64_t(sat & (a > 0.0));
      }
    };
    switch (c.scale.rule) {
      case ScaleRule::Floor: loop(std::integral_constant<ScaleRule, ScaleRule::Floor>{}); break;
      case ScaleRule::Ceil: loop(std::integral_constant<ScaleRule, ScaleRule::Ceil>{}); break;
      case ScaleRule::RCeil: loop(std::integral_constant<ScaleRule, ScaleRule::RCeil>{}); break;
      default: loop(std::integral_constant<ScaleRule, ScaleRule::Even>{}); break;
    }
  }
  saturated += n;
}

void scaled_elements_range(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                           int64_t r1, EventCounts& counts) {
  switch (plan.strategy) {
    case ScaledStrategy::Few: return scaled_few(c, f, r0, r1, counts);
    case ScaledStrategy::Lanes: return scaled_lanes(c, r0, r1, counts);
    case ScaledStrategy::Narrow: return scaled_narrow(c, f, plan, r0, r1, counts);
    case ScaledStrategy::Checked: return scaled_checked(c, f, plan, r0, r1, counts);
    case ScaledStrategy::Float64: return scaled_float64(c, f, plan, r0, r1, counts);
  }
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
