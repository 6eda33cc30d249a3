// The scaled-format loops (docs/design.md §9), compiled once per instruction-set level like
// quantize_kernels.cpp: the blocks' largest finite magnitudes, and the elements given their
// blocks' scales. The element math is cpp/include/lowfp/scaled.hpp's, in a float64 carrier.
#include <cmath>
#include <type_traits>

#include "philox_lanes.hpp"
#include "quantize_cpu.hpp"

#ifndef LOWFP_ISA_NS
#error "compile with -DLOWFP_ISA_NS=<namespace>"
#endif

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

template <class T, class Fn>
void with_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::Float16: return fn(static_cast<const Half*>(nullptr));
    case DType::BFloat16: return fn(static_cast<const BFloat*>(nullptr));
    case DType::Float32: return fn(static_cast<const float*>(nullptr));
    default: return fn(static_cast<const double*>(nullptr));
  }
}

template <class In>
void amax_rows(const ScaledCall& c, int64_t br0, int64_t br1, double* amax) {
  const In* x = static_cast<const In*>(c.x);
  const int64_t gc = c.block_grid_cols();
  for (int64_t br = br0; br < br1; ++br) {
    double* out = amax + br * gc;
    for (int64_t j = 0; j < gc; ++j) out[j] = 0.0;
    const int64_t r1 = min_of(c.rows, (br + 1) * c.block_rows);
    for (int64_t r = br * c.block_rows; r < r1; ++r) {
      const In* row = x + r * c.cols;
      for (int64_t j = 0; j < gc; ++j) {
        const int64_t c0 = j * c.block_cols, c1 = min_of(c.cols, c0 + c.block_cols);
        double m = out[j];
        for (int64_t i = c0; i < c1; ++i) {
          const double a = std::fabs(bit_cast<double>(Widen<uint64_t>::from(row[i])));
          m = a <= 1.7976931348623157e308 && a > m ? a : m;  // NaN and inf excluded
        }
        out[j] = m;
      }
    }
  }
}

// s · q (float64) in the storage type: float32 and float64 by the conversion (nearest even);
// 16-bit types rounded to their grid by lowfp's own nearest rounding first.
template <class Out>
Out store(double v, const RoundParams<uint64_t>& out) {
  if constexpr (std::is_same_v<Out, double>) {
    return v;
  } else if constexpr (std::is_same_v<Out, float>) {
    return float(v);
  } else {
    RoundEvents ev;
    const uint64_t b = round_bits<RoundKind::Nearest, uint64_t, true>(bit_cast<uint64_t>(v), out, 0u, ev);
    return Store<Out>::from(b);
  }
}

// One block's run of one row: n elements from index `first` (row-major) with scale s. kPow2: s is
// a power of two, so x · (1 / s) is the exact quotient; else divide_nudged. kParts: write q too.
template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kParts>
void run_block(const ScaledCall& c, int64_t first, int64_t n, double s, uint32_t* rand,
               int64_t& overflow, int64_t& underflow, int64_t& nan) {
  const In* x = static_cast<const In*>(c.x) + first;
  In* y = static_cast<In*>(c.y) + first;
  float* q_out = kParts ? c.q + first : nullptr;
  const double inv = 1.0 / s;
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t len = min_of(kTile, n - t0);
    const int64_t phase = (first + t0) % 4;
    if constexpr (Kind == RoundKind::Stochastic)
      philox_fill(rand, c.seed, c.offset + uint64_t((first + t0) / 4), (phase + len + 3) / 4);
    int64_t above = 0, under = 0, nans = 0;
    for (int64_t i = 0; i < len; ++i) {
      const double xv = bit_cast<double>(Widen<uint64_t>::from(x[t0 + i]));
      const uint64_t quotient = kPow2 ? bit_cast<uint64_t>(xv * inv) : divide_nudged(xv, s);
      RoundEvents ev;
      const uint32_t rw = Kind == RoundKind::Stochastic ? rand[phase + i] : 0u;
      const double q = bit_cast<double>(round_bits<Kind, uint64_t, kSubExp>(quotient, c.p, rw, ev));
      if constexpr (kParts) q_out[t0 + i] = float(q);
      y[t0 + i] = store<In>(q * s, c.out);
      if constexpr (kCount) {
        above += ev.above_max;
        under += ev.underflow;
        nans += ev.nan;
      }
    }
    overflow += above - nans;  // see RoundEvents
    underflow += under;
    nan += nans;
  }
}

template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kParts>
void elements(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  const int64_t gc = c.block_grid_cols();
  alignas(64) uint32_t rand[kTile + 4];
  int64_t overflow = 0, underflow = 0, nan = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const double* scales = c.scales + (r / c.block_rows) * gc;
    for (int64_t j = 0, c0 = 0; c0 < c.cols; ++j, c0 += c.block_cols)
      run_block<In, Kind, kCount, kPow2, kSubExp, kParts>(
          c, r * c.cols + c0, min_of(c.block_cols, c.cols - c0), scales[j], rand, overflow,
          underflow, nan);
  }
  counts.overflow += overflow;
  counts.underflow += underflow;
  counts.nan += nan;
}

}  // namespace

void scaled_amax_range(const ScaledCall& c, int64_t br0, int64_t br1, double* amax) {
  with_dtype<void>(c.dtype, [&](auto p) {
    amax_rows<std::remove_const_t<std::remove_pointer_t<decltype(p)>>>(c, br0, br1, amax);
  });
}

void scaled_elements_range(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  using B = std::true_type;
  using F = std::false_type;
  auto flag = [](bool v, auto fn) { return v ? fn(B{}) : fn(F{}); };
  with_dtype<void>(c.dtype, [&](auto p) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    auto go = [&](auto kind) {
      constexpr RoundKind K = decltype(kind)::value;
      // x · (1 / s) is the exact quotient for E8M0's power-of-two scales.
      flag(c.count, [&](auto count) {
        flag(c.scale.rule != ScaleRule::Format, [&](auto pow2) {
          flag(c.p.subnormal_exponent, [&](auto sub) {
            flag(c.q != nullptr, [&](auto parts) {
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
