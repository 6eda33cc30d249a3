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
template <class In>
void amax_rows(const ScaledCall& c, int64_t br0, int64_t br1, double* amax) {
  using U = RawOf<In>;
  const U* x = static_cast<const U*>(c.x);
  const U magnitude = U(U(~U(0)) >> 1), exponent = U(exponent_mask(c.dtype));
  const int64_t gc = c.block_grid_cols();
  std::vector<U> top(static_cast<size_t>(gc));
  for (int64_t br = br0; br < br1; ++br) {
    for (int64_t j = 0; j < gc; ++j) top[size_t(j)] = 0;
    const int64_t r1 = min_of(c.rows, (br + 1) * c.block_rows);
    for (int64_t r = br * c.block_rows; r < r1; ++r) {
      const U* row = x + r * c.cols;
      for (int64_t j = 0, c0 = 0; c0 < c.cols; ++j, c0 += c.block_cols) {
        const int64_t n = min_of(c.block_cols, c.cols - c0);
        U m = top[size_t(j)];
        for (int64_t i = 0; i < n; ++i) {
          const U a = U(row[c0 + i] & magnitude);
          m = max_of(m, select(a < exponent, a, U(0)));
        }
        top[size_t(j)] = m;
      }
    }
    for (int64_t j = 0; j < gc; ++j) {
      In v;
      std::memcpy(&v, &top[size_t(j)], sizeof(U));
      amax[br * gc + j] = bit_cast<double>(Widen<uint64_t>::from(v));
    }
  }
}

// fn(t0, len, phase) for the tiles of a block's run of n elements from row-major index first;
// stochastic rounding finds element t0 + i's Philox word at rand[phase + i].
template <RoundKind Kind, class Fn>
void for_tiles(const ScaledCall& c, int64_t first, int64_t n, uint32_t* rand, Fn&& fn) {
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t len = min_of(kTile, n - t0);
    const int64_t phase = (first + t0) % 4;
    if constexpr (Kind == RoundKind::Stochastic)
      philox_fill(rand, c.seed, c.offset + uint64_t((first + t0) / 4), (phase + len + 3) / 4);
    fn(t0, len, phase);
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
  for_tiles<Kind>(c, first, n, rand, [&](int64_t t0, int64_t len, int64_t phase) {
    int64_t above = 0, under = 0, nans = 0;
    for (int64_t i = 0; i < len; ++i) {
      const double xv = bit_cast<double>(Widen<uint64_t>::from(x[t0 + i]));
      RoundEvents ev;
      const uint32_t rw = Kind == RoundKind::Stochastic ? rand[phase + i] : 0u;
      const double q = scaled_element<Kind, kPow2, kSubExp>(xv, s, inv, c.p, rw, ev);
      if constexpr (kParts) q_out[t0 + i] = float(q);
      y[t0 + i] = store_scaled<In>(q * s, c.out);
      if constexpr (kCount) {
        above += ev.above_max;
        under += ev.underflow;
        nans += ev.nan;
      }
    }
    overflow += above - nans;  // see RoundEvents
    underflow += under;
    nan += nans;
  });
}

// run_block in the float32 carrier (ScaledCall::narrow): s = 2^k.
template <class In, RoundKind Kind, bool kCount, bool kParts>
void run_block_narrow(const ScaledCall& c, int64_t first, int64_t n, double s, uint32_t* rand,
                      int64_t& overflow, int64_t& underflow, int64_t& nan) {
  const In* x = static_cast<const In*>(c.x) + first;
  In* y = static_cast<In*>(c.y) + first;
  float* q_out = kParts ? c.q + first : nullptr;
  const float sf = float(s), inv = float(1.0 / s);  // powers of two from 2^-127 to 2^127
  for_tiles<Kind>(c, first, n, rand, [&](int64_t t0, int64_t len, int64_t phase) {
    int32_t above = 0, under = 0, nans = 0;
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t xb = Widen<uint32_t>::from(x[t0 + i]);
      const uint32_t qb = bit_cast<uint32_t>(bit_cast<float>(xb) * inv);
      // A quotient that underflowed to 0 stays nonzero (its sign and nonzero-ness are all E's
      // rounding sees below 2^-126).
      const bool lost = ((qb << 1) == 0u) & ((xb << 1) != 0u);
      const uint32_t quotient = select(lost, (xb & 0x80000000u) | 1u, qb);
      RoundEvents ev;
      const uint32_t rw = Kind == RoundKind::Stochastic ? rand[phase + i] : 0u;
      const float q = bit_cast<float>(round_bits<Kind, uint32_t, false>(quotient, c.p32, rw, ev));
      if constexpr (kParts) q_out[t0 + i] = q;
      const float v = q * sf;  // exact (ScaledCall::narrow)
      if constexpr (std::is_same_v<In, float>) {
        y[t0 + i] = v;
      } else {
        RoundEvents store_ev;
        y[t0 + i] = Store<In>::from(round_bits<RoundKind::Nearest, uint32_t, false>(
            bit_cast<uint32_t>(v), c.out32, 0u, store_ev));
      }
      if constexpr (kCount) {
        above += ev.above_max;
        under += ev.underflow;
        nans += ev.nan;
      }
    }
    overflow += int64_t(above) - int64_t(nans);
    underflow += under;
    nan += nans;
  });
}

template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kParts>
void elements(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  const int64_t gc = c.block_grid_cols();
  alignas(64) uint32_t rand[kTile + 4];
  int64_t overflow = 0, underflow = 0, nan = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const double* scales = c.scales + (r / c.block_rows) * gc;
    for (int64_t j = 0, c0 = 0; c0 < c.cols; ++j, c0 += c.block_cols) {
      const int64_t first = r * c.cols + c0, n = min_of(c.block_cols, c.cols - c0);
      if constexpr (kPow2 && !std::is_same_v<In, double>) {
        if (c.narrow) {
          run_block_narrow<In, Kind, kCount, kParts>(c, first, n, scales[j], rand, overflow,
                                                     underflow, nan);
          continue;
        }
      }
      run_block<In, Kind, kCount, kPow2, kSubExp, kParts>(c, first, n, scales[j], rand, overflow,
                                                          underflow, nan);
    }
  }
  counts.overflow += overflow;
  counts.underflow += underflow;
  counts.nan += nan;
}

}  // namespace

void scaled_amax_range(const ScaledCall& c, int64_t br0, int64_t br1, double* amax) {
  with_storage_type(c.dtype, [&](auto p) {
    amax_rows<std::remove_const_t<std::remove_pointer_t<decltype(p)>>>(c, br0, br1, amax);
  });
}

void scaled_scales_range(const ScaledCall& c, const double* amax, double t, int64_t b0, int64_t b1,
                         int64_t& saturated) {
  // A block without a finite nonzero element takes the smallest scale.
  const double empty = c.scale.rule == ScaleRule::Format ? c.scale.s_smallest * t : 0x1p-127;
  int64_t n = 0;
  for (int64_t b = b0; b < b1; ++b) {
    bool sat = false;
    c.scales[b] = amax[b] > 0.0 ? block_scale(c.scale, amax[b], t, sat) : empty;
    n += sat;
  }
  saturated += n;
}

void scaled_elements_range(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  using B = std::true_type;
  using F = std::false_type;
  auto flag = [](bool v, auto fn) { return v ? fn(B{}) : fn(F{}); };
  with_storage_type(c.dtype, [&](auto p) {
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
