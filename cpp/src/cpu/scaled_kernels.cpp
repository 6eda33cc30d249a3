// The scaled-format loops (docs/design.md §9), compiled once per instruction-set level like
// quantize_kernels.cpp: the blocks' largest finite magnitudes, and the elements given their
// blocks' scales. The element math is cpp/include/lowfp/scaled.hpp's, in a float64 carrier.
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "philox_lanes.hpp"
#include "kernels.hpp"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// 16 lanes of 32 bits (GCC's vector extensions: whatever registers the target has).
using Lanes16 = uint32_t __attribute__((vector_size(64)));

inline Lanes16 lanes_max(Lanes16 a, Lanes16 b) { return a > b ? a : b; }

using Floats16 = float __attribute__((vector_size(64)));

// How many lanes met a condition, over the vectors of a tile (at most 2^31 of them). With
// AVX-512 each compare's mask is counted by popcnt on the scalar ports, which the lane loops
// leave idle; elsewhere (and without the mask intrinsics, where GCC turned a compare into a
// vector and back into a mask) each lane keeps its own counter, incremented as a select.
// Conditions: a > b (unsigned, or float32 ordered: NaN never), and "r is 0 where x is not" on
// the sign-cleared bits.
struct LaneTally {
#if defined(__AVX512F__)
  int64_t n = 0;
  void greater(Lanes16 a, Lanes16 b) { add(_mm512_cmpgt_epu32_mask(__m512i(a), __m512i(b))); }
  void greater(Floats16 a, Floats16 b) { add(_mm512_cmp_ps_mask(__m512(a), __m512(b), _CMP_GT_OQ)); }
  void zero_where_nonzero(Lanes16 r, Lanes16 x) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    add(_mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(__m512i(r), __m512i(r)), __m512i(x),
                                    magnitude));
  }
  int64_t total() const { return n; }

 private:
  void add(__mmask16 m) { n += __builtin_popcount(uint32_t(m)); }
#else
  Lanes16 n{};
  void greater(Lanes16 a, Lanes16 b) { n = a > b ? n + 1u : n; }
  void greater(Floats16 a, Floats16 b) { n = a > b ? n + 1u : n; }
  void zero_where_nonzero(Lanes16 r, Lanes16 x) {
    n = r == 0u ? ((x & 0x7fffffffu) != 0u ? n + 1u : n) : n;
  }
  int64_t total() const {
    int64_t sum = 0;
    for (int l = 0; l < 16; ++l) sum += n[l];
    return sum;
  }
#endif
};

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

// fn(std::true_type{}) or fn(std::false_type{}): a run-time flag as a template parameter.
template <class Fn>
void with_flag(bool v, Fn&& fn) {
  if (v) fn(std::true_type{});
  else fn(std::false_type{});
}

// The element pass walks each row in tiles of kTile elements that span many blocks (a block of
// 16 or 32 is too short a loop to vectorise well): a tile's per-element scales (and their
// inverses) are spread into buffers first, then one flat loop rounds the tile. Stochastic
// rounding finds element i's Philox word at rand[i] (words by row-major index).
//
// Loads from the scale buffers stall behind the loop's stores to y when their addresses agree
// modulo 4 KB (4K aliasing, which depends only on where the stack and y happen to lie), so each
// tile's float32 scales start half a page from its first output,
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
  // Per block of the tile (at most kTile + 1 blocks): 1 / s, and the float32 forms (checked).
  alignas(64) double block_inv[kTile + 1];
  alignas(64) float block_s32[kTile + 1];
  alignas(64) float block_inv32[kTile + 1];
  alignas(64) float checked_out[kTile];  // run_tile_checked's results, when rounding in place
  // Per block of the tile: its event points as float32 thresholds (count_tile)
  alignas(64) float block_zero[kTile + 1];
  alignas(64) float block_over[kTile + 1];
  int64_t at32 = 0;
  void place32(const void* y) {
    const uintptr_t gap = (uintptr_t(y) + kPage / 2 - uintptr_t(s32_buf)) % kPage;
    at32 = int64_t(gap & ~uintptr_t(63)) / int64_t(sizeof(float));  // (64-byte aligned)
  }
};

// A tile's rounding events, per lane l of its loop (kLanes: the block width in the float32 loops,
// so that the counters stay in vector registers: one array per event, which the vectoriser keeps
// as registers, where an array of per-lane structs cost shuffles and stack round trips on every
// vector), in counters of the loop's lane width (int32 beside 32-bit lanes keeps the float32
// loop at 16 lanes), added to the call's totals at its end.
template <class T, int64_t kLanes = 1>
struct TileEvents {
  T above[kLanes] = {}, under[kLanes] = {}, nans[kLanes] = {};
  void add(int64_t l, const RoundEvents& ev) {
    above[l] += ev.above_max;
    under[l] += ev.underflow;
    nans[l] += ev.nan;
  }
  void into(int64_t& overflow, int64_t& underflow, int64_t& nan) const {
    for (int64_t l = 0; l < kLanes; ++l) {
      overflow += int64_t(above[l]) - int64_t(nans[l]);  // see RoundEvents
      underflow += under[l];
      nan += nans[l];
    }
  }
};

// One tile in the float64 carrier: n elements from index `first` (row-major). kPow2: every scale
// is a power of two, so x · (1 / s) is the exact quotient; else divide_nudged. kParts: write q.
// kAdd: nearest rounding by addition (ScaledCall::nearest_by_addition). kOnce: x / s rounded
// once (ScaledCall::divide_once).
template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kParts, bool kAdd,
          bool kOnce>
void run_tile(const ScaledCall& c, int64_t first, int64_t n, const TileScales& t,
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
    const uint32_t rw = Kind == RoundKind::Stochastic ? t.rand[i] : 0u;
    const double q = scaled_element<Kind, kPow2, kSubExp, kAdd, kOnce>(xv, t.s[i], t.inv[i], p, rw,
                                                                      ev, c.addition_cap);
    if constexpr (kParts) q_out[i] = float(q);
    y[i] = store_scaled<In>(q * t.s[i], out);
    if constexpr (kCount) events.add(0, ev);
  }
  events.into(overflow, underflow, nan);
}

// element(i, lane, scale, inverse) for a tile's n elements with float32 scales: kBlock > 0, per
// block of kBlock (the tile starts a block), its scale and inverse from TileScales' block_s32
// and block_inv32, lane = i % kBlock (so that accumulators indexed by it stay in vector
// registers); kBlock 0, from the per-element buffers (place32), lane 0.
template <int64_t kBlock, class Fn>
void for_tile_elements(int64_t n, const TileScales& t, Fn&& element) {
  if constexpr (kBlock > 0) {
    const int64_t whole = n / kBlock;
    for (int64_t b = 0; b < whole; ++b) {
      const float s = t.block_s32[b], inv = t.block_inv32[b];
      for (int64_t k = 0; k < kBlock; ++k) element(b * kBlock + k, k, s, inv);
    }
    for (int64_t i = whole * kBlock; i < n; ++i)
      element(i, int64_t(0), t.block_s32[whole], t.block_inv32[whole]);
  } else {
    const float* s32 = t.s32_buf + t.at32;
    const float* inv32 = t.inv32_buf + t.at32;
    for (int64_t i = 0; i < n; ++i) element(i, int64_t(0), s32[i], inv32[i]);
  }
}

// run_tile in the float32 carrier (ScaledCall::narrow): every scale is 2^k. kAdd: nearest
// rounding by addition (ScaledCall::nearest_by_addition). kBlock: see for_tile_elements.
template <class In, RoundKind Kind, bool kCount, bool kParts, bool kAdd, int64_t kBlock>
void run_tile_narrow(const ScaledCall& c, int64_t first, int64_t n, const TileScales& t,
                     int64_t& overflow, int64_t& underflow, int64_t& nan) {
  const In* x = static_cast<const In*>(c.x) + first;
  In* y = static_cast<In*>(c.y) + first;
  float* q_out = kParts ? c.q + first : nullptr;
  const RoundParams<uint32_t> p = c.p32;
  const RoundParams<uint32_t> out = c.out32;
  constexpr int64_t kLanes = kBlock > 0 ? kBlock : 1;
  TileEvents<int32_t, kLanes> events;
  auto element = [&](int64_t i, int64_t l, float s32, float inv32) {
    const uint32_t xb = Widen<uint32_t>::from(x[i]);
    const uint32_t qb = bit_cast<uint32_t>(bit_cast<float>(xb) * inv32);
    // A quotient that underflowed to 0 stays nonzero (nonzero_quotient), except where only its
    // rounding to nearest, a signed 0, is wanted (not its underflow count).
    constexpr bool kKeep = kCount || Kind != RoundKind::Nearest;
    const uint32_t quotient = kKeep ? nonzero_quotient(qb, xb) : qb;
    RoundEvents ev;
    const uint32_t rw = Kind == RoundKind::Stochastic ? t.rand[i] : 0u;
    const float q = bit_cast<float>(
        kAdd ? round_nearest_by_addition(quotient, p, c.addition_cap, ev)
             : round_bits<Kind, uint32_t, false>(quotient, p, rw, ev));
    if constexpr (kParts) q_out[i] = q;
    const float v = q * s32;  // exact (ScaledCall::narrow)
    if constexpr (std::is_same_v<In, float>) {
      y[i] = v;
    } else {
      RoundEvents store_ev;
      y[i] = Store<In>::from(
          round_bits<RoundKind::Nearest, uint32_t, false>(bit_cast<uint32_t>(v), out, 0u, store_ev));
    }
    if constexpr (kCount) events.add(l, ev);
  };
  for_tile_elements<kBlock>(n, t, element);
  events.into(overflow, underflow, nan);
}

// run_tile_narrow for float32 inputs rounded to nearest by addition or stochastically, written in
// GCC vectors of 16 lanes: round.hpp's magnitude_by_addition (nearest) or round_bits (stochastic,
// with no subnormal exponent, as ScaledCall::narrow implies) and rounded_result, lane by lane, so
// that kCount's events come from the masks the rounding computes anyway (no per-lane counters in
// memory, no separate counting pass). kBlock 16 or 32: each block's 2^±k broadcast (the tile starts a block); 0:
// from the per-element buffers (place32). A ragged end is padded with zeros, which count nothing.
// kSignedZero: E has -0 (RoundParams::no_negative_zero false); kInfStays: inf_stays_inf.
template <RoundKind Kind, bool kCount, bool kSignedZero, bool kInfStays, int64_t kBlock>
void run_tile_narrow_lanes(const ScaledCall& c, int64_t first, int64_t n, const TileScales& t,
                           int64_t& overflow, int64_t& underflow, int64_t& nan) {
  static_assert(Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic, "nearest or stochastic");
  using C = CarrierTraits<uint32_t>;
  using Ints16 = int32_t __attribute__((vector_size(64)));
  const float* x = static_cast<const float*>(c.x) + first;
  float* y = static_cast<float*>(c.y) + first;
  const RoundParams<uint32_t>& p = c.p32;
  const Lanes16 magnitude = Lanes16{} + ~C::kSign, sign_bit = Lanes16{} + C::kSign,
                inf = Lanes16{} + C::kInf, one = Lanes16{} + 1u,
                max_bits = Lanes16{} + p.max_bits, over_pos = Lanes16{} + p.overflow_pos,
                over_neg = Lanes16{} + p.overflow_neg;
  // magnitude_by_addition's exponent clamp and step, on biased exponent fields
  const Lanes16 e_low = Lanes16{} + uint32_t(p.emin + C::kExpBias),
                e_high = Lanes16{} + uint32_t(c.addition_cap + C::kExpBias),
                drop = Lanes16{} + uint32_t(p.normal_drop);
  // round_bits' (stochastic), exponents biased: emin + 127 >= 1 (ScaledCall::narrow)
  const Ints16 emin_b = Ints16{} + (p.emin + C::kExpBias), normal_drop = Ints16{} + p.normal_drop,
               below_drop = Ints16{} + p.below_drop, r_bits = Ints16{} + (32 - int32_t(p.sr_shift)),
               max_shift = Ints16{} + C::kMaxShift, mant_bits = Ints16{} + C::kMantBits;
  const Lanes16 below_step = Lanes16{} + p.below_step;
  LaneTally above, under, nans;
  auto vector = [&](const float* src, float* dst, const uint32_t* rand, const Floats16& s,
                    const Floats16& inv) {
    Floats16 xv;
    std::memcpy(&xv, src, sizeof xv);
    const Lanes16 xb = bit_cast<Lanes16>(xv);
    Lanes16 q = bit_cast<Lanes16>(xv * inv);  // exact, or below 2^-126 (ScaledCall::narrow)
    Lanes16 mag;
    if constexpr (Kind == RoundKind::Nearest) {
      const Lanes16 a = q & magnitude;
      Lanes16 e = a >> C::kMantBits;
      e = e < e_low ? e_low : e;
      e = e > e_high ? e_high : e;
      const Floats16 step = bit_cast<Floats16>((e + drop) << C::kMantBits);
      mag = bit_cast<Lanes16>((bit_cast<Floats16>(a) + step) - step);
    } else {
      // A quotient that underflowed to 0 stays nonzero (nonzero_quotient, in lanes)
      q = (q << 1) == 0u ? ((xb << 1) != 0u ? (xb & sign_bit) | 1u : q) : q;
      const Lanes16 a = q & magnitude;
      Lanes16 rw;
      std::memcpy(&rw, rand, sizeof rw);
      const Ints16 ex = Ints16(a >> C::kMantBits);
      const Ints16 e_eff = ex < 1 ? Ints16{} + 1 : ex;  // carrier subnormals share 2^(1 - bias)
      const Lanes16 sig = (a & C::kMantMask) | (ex != 0 ? Lanes16{} + C::kImplicit : Lanes16{});
      const Ints16 d = e_eff < emin_b ? below_drop + (emin_b - e_eff) : normal_drop;
      const Lanes16 dm = Lanes16(d < max_shift ? d : max_shift);
      const Lanes16 unit = one << dm;
      const Lanes16 rem = sig & (unit - 1u);
      // up with probability floor(f · 2^R) / 2^R: R random bits against the top R of rem / 2^d
      const Ints16 wide = r_bits - d, tight = d - r_bits;
      const Lanes16 widened = rem << Lanes16(wide < 0 ? Ints16{} : (wide > max_shift ? max_shift : wide));
      const Lanes16 narrowed = rem >> Lanes16(tight < 0 ? Ints16{} : (tight > max_shift ? max_shift : tight));
      const Lanes16 threshold = d <= r_bits ? widened : narrowed;
      const Lanes16 drawn = rw >> p.sr_shift;
      const Lanes16 stepped = (a & ~(unit - 1u)) + (drawn < threshold ? unit : Lanes16{});
      mag = d <= mant_bits ? stepped : (drawn < threshold ? below_step : Lanes16{});
    }
    // rounded_result. (Each mask written where it is used: GCC then keeps it in a mask register,
    // where a named vector of it made a vector and compared it again at every use.)
    const Lanes16 a = q & magnitude, sign = q & sign_bit;
    Lanes16 rounded = mag | sign;
    if constexpr (!kSignedZero) rounded = mag == 0u ? mag : rounded;
    Lanes16 overflowed = sign != 0u ? over_neg : over_pos;
    if constexpr (kInfStays) overflowed = a == inf ? q : overflowed;
    // (mag > max_bits: overflow, or NaN)
    const Lanes16 r = a > inf ? q : (mag > max_bits ? overflowed : rounded);
    const Floats16 out = bit_cast<Floats16>(r) * s;  // exact (ScaledCall::narrow)
    std::memcpy(dst, &out, sizeof out);
    if constexpr (kCount) {
      above.greater(mag, max_bits);
      nans.greater(a, inf);
      // a nonzero x whose result is 0 (its quotient may have underflowed to 0 already)
      under.zero_where_nonzero(mag, xb);
    }
  };
  auto padded = [&](int64_t i, int64_t stop, const Floats16& s, const Floats16& inv) {
    alignas(64) float in[16] = {}, out[16];
    alignas(64) uint32_t rand[16] = {};
    std::memcpy(in, x + i, sizeof(float) * size_t(stop - i));
    if constexpr (Kind == RoundKind::Stochastic)
      std::memcpy(rand, t.rand + i, sizeof(uint32_t) * size_t(stop - i));
    vector(in, out, rand, s, inv);
    std::memcpy(y + i, out, sizeof(float) * size_t(stop - i));
  };
  if constexpr (kBlock > 0) {
    static_assert(kBlock % 16 == 0, "whole vectors per block");
    const int64_t whole = n / kBlock;
    for (int64_t b = 0; b < whole; ++b) {
      const Floats16 s = Floats16{} + t.block_s32[b], inv = Floats16{} + t.block_inv32[b];
      for (int64_t i = b * kBlock; i < (b + 1) * kBlock; i += 16) vector(x + i, y + i, t.rand + i, s, inv);
    }
    if (whole * kBlock < n) {  // a ragged last block
      const Floats16 s = Floats16{} + t.block_s32[whole], inv = Floats16{} + t.block_inv32[whole];
      for (int64_t i = whole * kBlock; i < n; i += 16) padded(i, min_of(i + 16, n), s, inv);
    }
  } else {
    const float* s32 = t.s32_buf + t.at32;
    const float* inv32 = t.inv32_buf + t.at32;
    auto at = [](const float* v, int64_t i, int64_t stop) {
      alignas(64) float lanes[16] = {};
      std::memcpy(lanes, v + i, sizeof(float) * size_t(stop - i));
      Floats16 f;
      std::memcpy(&f, lanes, sizeof f);
      return f;
    };
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      Floats16 s, inv;
      std::memcpy(&s, s32 + i, sizeof s);
      std::memcpy(&inv, inv32 + i, sizeof inv);
      vector(x + i, y + i, t.rand + i, s, inv);
    }
    if (i < n) padded(i, n, at(s32, i, n), at(inv32, i, n));
  }
  if constexpr (kCount) {
    overflow += above.total() - nans.total();  // (see RoundEvents)
    underflow += under.total();
    nan += nans.total();
  }
}

// A tile of float32 inputs with scales s = S · t in a format, nearest (ScaledCall::checked), in
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
bool run_tile_checked(const ScaledCall& c, int64_t first, int64_t n, const TileScales& t,
                      float* y, int64_t& overflow, int64_t& underflow, int64_t& nan) {
  const float* x = static_cast<const float*>(c.x) + first;
  float* q_out = kParts ? c.q + first : nullptr;
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
  events.into(overflow, underflow, nan);
  return true;
}

// Each block's comparisons (FewThresholds) for ScaledCall::few, per thread: entries cached per
// value of the scale format (few_keys of them), each filled when a block first needs it, so a
// call computes each scale's thresholds once, not each block's; without keys (scale formats of
// many values), each tile's blocks' own.
struct FewTables {
  static constexpr int64_t kBlocks = kTile / 16 + 1;  // blocks of at least 16 in a tile
  std::vector<FewThresholds> by_key;
  std::vector<double> key_scale;                       // the scale s of each entry (0: none yet)
  alignas(64) FewThresholds tile[kBlocks];
  int32_t at[kBlocks];                                 // block b's entry

  explicit FewTables(const ScaledCall& c)
      : by_key(static_cast<size_t>(c.few_keys)), key_scale(static_cast<size_t>(c.few_keys), 0.0) {}

  // The entries of a tile's blocks with scales bs[0, blocks): entries()[at[b]]
  const FewThresholds* entries(const ScaledCall& c, const double* bs, int64_t blocks) {
    if (by_key.empty()) {
      for (int64_t b = 0; b < blocks; ++b) tile[b] = few_thresholds(c.magnitudes, bs[b]);
      for (int64_t b = 0; b < blocks; ++b) at[b] = int32_t(b);
      return tile;
    }
    // The key of S = s / t from s · fl(1 / t), within a few units of S's last float64 bit, so
    // rounded to the key's bits (and clamped: a scale off S's range would be a bug, not a
    // reason to read elsewhere). An entry is filled from the block's own s (not the key's S · t).
    const double inv_t = 1.0 / c.t;
    const uint64_t half = uint64_t(1) << (c.few_key_shift - 1);
    const int64_t last = c.few_keys - 1;
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t key =
          int64_t((bit_cast<uint64_t>(bs[b] * inv_t) + half) >> c.few_key_shift) - c.few_key0;
      key = key < 0 ? 0 : (key > last ? last : key);
      if (key_scale[size_t(key)] != bs[b]) {
        by_key[size_t(key)] = few_thresholds(c.magnitudes, bs[b]);
        key_scale[size_t(key)] = bs[b];
      }
      at[b] = int32_t(key);
    }
    return by_key.data();
  }
};

// A tile of float32 inputs rounded by comparisons (ScaledCall::few), blocks of kBlock (a multiple
// of 16), block b's comparisons at entries[at[b]]: |x| against its block's thresholds, each one
// passed stepping the result to the next magnitude's s · g (past the last, E saturates). Inputs
// that pass none round to a zero of x's sign; NaN stays NaN (quieted, as the float32 product of
// the other paths leaves it). In GCC vectors of 16 lanes, each threshold and value a broadcast
// from the entry (AVX-512: an operand of the compare or blend); a ragged last block is padded.
// kCount: the events too, from the same comparisons (the overflow threshold the last).
template <bool kCount, int64_t kBlock>
void run_tile_few(const ScaledCall& c, int64_t first, int64_t n, const FewThresholds* entries,
                  const int32_t* at, int64_t& overflow, int64_t& underflow, int64_t& nan) {
  static_assert(kBlock % 16 == 0, "whole vectors per block");
  constexpr int32_t kSteps = kFewMagnitudes - 1, kOver = kSteps;
  const float* x = static_cast<const float*>(c.x) + first;
  float* y = static_cast<float*>(c.y) + first;
  const Lanes16 magnitude = Lanes16{} + 0x7fffffffu, sign = Lanes16{} + 0x80000000u,
                inf = Lanes16{} + 0x7f800000u, quiet = Lanes16{} + 0x00400000u,
                one = Lanes16{} + 1u;
  LaneTally over, under, nans;
  // (masks written where they are used: see run_tile_narrow_lanes)
  auto vector = [&](const float* src, float* dst, const FewThresholds& e) {
    Lanes16 xb;
    std::memcpy(&xb, src, sizeof xb);
    const Lanes16 ab = xb & magnitude;
    const Floats16 a = bit_cast<Floats16>(ab);
    Floats16 v{};
    for (int32_t k = 0; k < kSteps; ++k) v = a > e.above[k] ? Floats16{} + e.value[k] : v;
    const Lanes16 out = ab > inf ? xb | quiet : bit_cast<Lanes16>(v) | (xb & sign);
    std::memcpy(dst, &out, sizeof out);
    if constexpr (kCount) {
      over.greater(a, Floats16{} + e.above[kOver]);  // (NaN compares false; inf passes)
      // 0 < |x| <= above[0], by the bits (which order non-negative floats; NaN's lie above)
      under.greater(Lanes16{} + bit_cast<uint32_t>(e.above[0]), ab - one);
      nans.greater(ab, inf);
    }
  };
  // (whole blocks in a loop of their own: a constant count of vectors per block, where a
  // block's end found at run time cost a loop's setup, constants included, every block)
  const int64_t whole = n / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    const FewThresholds& e = entries[at[b]];
    for (int64_t v = 0; v < kBlock; v += 16) vector(x + b * kBlock + v, y + b * kBlock + v, e);
  }
  for (int64_t i = whole * kBlock; i < n; i += 16) {  // a ragged last block, padded
    const int64_t stop = min_of(i + 16, n);
    alignas(64) float in[16] = {}, out[16];
    std::memcpy(in, x + i, sizeof(float) * size_t(stop - i));
    vector(in, out, entries[at[whole]]);
    std::memcpy(y + i, out, sizeof(float) * size_t(stop - i));
  }
  if constexpr (kCount) {
    overflow += over.total();
    underflow += under.total();
    nan += nans.total();
  }
}

// The nearest-rounding events of a tile's n float32 inputs from index `first`, columns t0 on of
// one row, blocks of bc columns from block j0 = t0 / bc with scales bs (ScaledCall::
// count_by_comparison): |x| against each block's event points times its scale, in GCC vectors of
// 16 lanes, each block's points broadcast (a block's ragged end padded with zeros, which count
// nothing). Separate from the rounding loops, which then need no per-element events. kBlock:
// bc when it is 16 or 32 (whole vectors per block), else 0.
template <int64_t kBlock>
void count_tile(const ScaledCall& c, int64_t first, int64_t n, int64_t t0, const double* bs,
                int64_t blocks, TileScales& t, int64_t& overflow, int64_t& underflow, int64_t& nan) {
  const float* x = static_cast<const float*>(c.x) + first;
  const int64_t bc = kBlock > 0 ? kBlock : c.block_cols, j0 = t0 / bc;
  const EventPoints ep = c.events;
  for (int64_t k = 0; k < blocks; ++k) {  // (a loop of its own: it vectorises)
    t.block_zero[k] = strict_threshold(ep.mu_zero * bs[k], ep.up_zero);
    t.block_over[k] = strict_threshold(ep.mu_over * bs[k], ep.up_over);
  }
  const Lanes16 magnitude = Lanes16{} + 0x7fffffffu, inf = Lanes16{} + 0x7f800000u,
                one = Lanes16{} + 1u;
  LaneTally over, under, nans;
  auto vector = [&](const float* src, const float& zero_t, const float& over_t) {
    Lanes16 xb;
    std::memcpy(&xb, src, sizeof xb);
    const Lanes16 ab = xb & magnitude;
    over.greater(bit_cast<Floats16>(ab), Floats16{} + over_t);  // (NaN compares false; inf passes)
    // 0 < |x| <= the zero threshold, by the bits (which order non-negative floats; NaN's are
    // above every threshold's)
    under.greater(Lanes16{} + bit_cast<uint32_t>(zero_t), ab - one);
    nans.greater(ab, inf);
  };
  auto padded = [&](int64_t i, int64_t stop, int64_t k) {
    alignas(64) float in[16] = {};
    std::memcpy(in, x + i, sizeof(float) * size_t(stop - i));
    vector(in, t.block_zero[k], t.block_over[k]);
  };
  if constexpr (kBlock > 0) {
    const int64_t whole = n / kBlock;
    for (int64_t k = 0; k < whole; ++k)
      for (int64_t v = 0; v < kBlock; v += 16)
        vector(x + k * kBlock + v, t.block_zero[k], t.block_over[k]);
    for (int64_t i = whole * kBlock; i < n; i += 16) padded(i, min_of(i + 16, n), whole);
  } else {
    for (int64_t i = 0, k = 0; i < n; ++k) {
      const int64_t stop = min_of(n, (j0 + k + 1) * bc - t0);
      for (; i + 16 <= stop; i += 16) vector(x + i, t.block_zero[k], t.block_over[k]);
      if (i < stop) padded(i, stop, k);
      i = stop;
    }
  }
  overflow += over.total();
  underflow += under.total();
  nan += nans.total();
}

template <class In, RoundKind Kind, bool kCount, bool kPow2, bool kSubExp, bool kParts>
void elements(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  const int64_t gc = c.block_grid_cols(), bc = c.block_cols;
  constexpr bool kMayNarrow = kPow2 && !std::is_same_v<In, double>;
  constexpr bool kMayDivideOnce =
      Kind == RoundKind::Nearest && !kPow2 && !std::is_same_v<In, double>;
  constexpr bool kMayCheck = Kind == RoundKind::Nearest && !kPow2 && std::is_same_v<In, float>;
  // ScaledCall::count_by_comparison: the rounding loops count nothing (kCount false)
  constexpr bool kMayCompareCounts =
      !kCount && Kind == RoundKind::Nearest && std::is_same_v<In, float>;
  constexpr bool kLanesNarrow = kMayNarrow && std::is_same_v<In, float> && !kParts &&
                                (Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic);
  const bool narrow = kMayNarrow && c.narrow;
  const bool checked = kMayCheck && c.checked;
  TileScales t;
  std::optional<FewTables> few;
  if constexpr (kMayCheck && !kParts)
    if (c.few && c.count_by_comparison && (bc == 16 || bc == 32)) few.emplace(c);
  int64_t overflow = 0, underflow = 0, nan = 0;
  const uintptr_t bytes = uintptr_t(c.rows * c.cols) * sizeof(In);
  const bool apart = uintptr_t(c.x) + bytes <= uintptr_t(c.y) || uintptr_t(c.y) + bytes <= uintptr_t(c.x);
  for (int64_t r = r0; r < r1; ++r) {
    const double* scales = c.scales + (r / c.block_rows) * gc;
    for (int64_t t0 = 0; t0 < c.cols; t0 += kTile) {
      const int64_t len = min_of(kTile, c.cols - t0), first = r * c.cols + t0;
      const int64_t j0 = t0 / bc, blocks = (t0 + len - 1) / bc + 1 - j0;
      const double* bs = scales + j0;
      if (few) {  // (counting in the same comparisons: ScaledCall::few implies count_by_comparison)
        const FewThresholds* entries = few->entries(c, bs, blocks);
        with_flag(c.count, [&](auto count_c) {
          constexpr bool kFewCount = decltype(count_c)::value;
          if (bc == 16)
            run_tile_few<kFewCount, 16>(c, first, len, entries, few->at, overflow, underflow, nan);
          else
            run_tile_few<kFewCount, 32>(c, first, len, entries, few->at, overflow, underflow, nan);
        });
        continue;
      }
      // Counts by comparison (kMayCompareCounts): after the tile's rounding, while its inputs
      // are in cache, unless the rounding overwrites them
      auto count = [&] {
        if (bc == 16) count_tile<16>(c, first, len, t0, bs, blocks, t, overflow, underflow, nan);
        else if (bc == 32) count_tile<32>(c, first, len, t0, bs, blocks, t, overflow, underflow, nan);
        else count_tile<0>(c, first, len, t0, bs, blocks, t, overflow, underflow, nan);
      };
      // The float32 loop in lanes counts as it rounds (run_tile_narrow_lanes)
      const bool lanes =
          kLanesNarrow && narrow && (Kind == RoundKind::Stochastic || c.nearest_by_addition);
      const bool count_first = kMayCompareCounts && c.count && !apart && !lanes;
      const bool count_after = kMayCompareCounts && c.count && apart && !lanes;
      if constexpr (kMayCompareCounts) {
        if (count_first) count();
      }
      auto round_tile = [&] {
        if (narrow || checked) t.place32(static_cast<In*>(c.y) + first);
        float* s32 = t.s32_buf + t.at32;
        float* inv32 = t.inv32_buf + t.at32;
        // Spread each block's scale: as float32 (narrow: 2^±k, exact; checked: S and fl(1 / s)),
        // or as float64. (The divisions first, in a loop over the tile's blocks that vectorises.)
        for (int64_t k = 0; k < blocks; ++k) t.block_inv[k] = 1.0 / bs[k];
        bool checkable = checked;  // every fl(1 / s) a normal float32
        if (narrow || checked) {
          const double over_t = narrow ? 1.0 : c.t;
          uint32_t bad = 0;
          for (int64_t k = 0; k < blocks; ++k) {
            t.block_s32[k] = float(bs[k] / over_t);  // (s / t = S exactly)
            t.block_inv32[k] = float(t.block_inv[k]);
          }
          for (int64_t k = 0; k < blocks; ++k)  // fl(1 / s) in [2^-126, 2^127], by its bits
            bad |= uint32_t(bit_cast<uint32_t>(t.block_inv32[k]) - 0x00800000u > 0x7e800000u);
          checkable &= bad == 0;
        }
        auto spread = [&](bool as_float32) {
          for (int64_t i = 0, k = 0; i < len; ++k) {
            const int64_t stop = min_of(len, (j0 + k + 1) * bc - t0);
            if (as_float32) {
              const float big_s = t.block_s32[k], inv_s = t.block_inv32[k];
              for (; i < stop; ++i) s32[i] = big_s, inv32[i] = inv_s;
            } else {
              const double s = bs[k], inv = t.block_inv[k];
              for (; i < stop; ++i) t.s[i] = s, t.inv[i] = inv;
            }
          }
        };
        if ((narrow && bc != 32 && !(lanes && bc == 16)) || (checked && bc != 16 && bc != 32))
          spread(true);
        else if (!checked && !narrow) spread(false);
        const int64_t phase = first % 4;
        if constexpr (Kind == RoundKind::Stochastic) {
          philox_fill(t.rand, c.seed, c.offset + uint64_t(first / 4), (phase + len + 3) / 4);
          // element i's word to rand[i]: indexed rand[phase + i], GCC 12 at -O3 dropped the
          // stores of the float64 loop that read it (baseline and AVX2 kernels; the test comparing
          // the kernels in tests/test_scaled.py)
          if (phase != 0) std::memmove(t.rand, t.rand + phase, sizeof(uint32_t) * size_t(len));
        }
        if constexpr (kLanesNarrow) {
          if (lanes) {
            const RoundParams<uint32_t>& p = c.p32;
            with_flag(c.count, [&](auto count_c) {
              with_flag(!p.no_negative_zero, [&](auto signed_zero) {
                with_flag(p.inf_stays_inf, [&](auto stays) {
                  constexpr bool kC = decltype(count_c)::value, kZ = decltype(signed_zero)::value,
                                 kS = decltype(stays)::value;
                  if (bc == 32)
                    run_tile_narrow_lanes<Kind, kC, kZ, kS, 32>(c, first, len, t, overflow, underflow, nan);
                  else if (bc == 16)
                    run_tile_narrow_lanes<Kind, kC, kZ, kS, 16>(c, first, len, t, overflow, underflow, nan);
                  else
                    run_tile_narrow_lanes<Kind, kC, kZ, kS, 0>(c, first, len, t, overflow, underflow, nan);
                });
              });
            });
            return;
          }
        }
        if constexpr (kMayNarrow) {
          if (narrow) {
            const bool add = Kind == RoundKind::Nearest && c.nearest_by_addition;
            with_flag(add, [&](auto add_c) {
              constexpr bool kAdd = decltype(add_c)::value && Kind == RoundKind::Nearest;
              if (bc == 32)
                run_tile_narrow<In, Kind, kCount, kParts, kAdd, 32>(c, first, len, t,
                                                                    overflow, underflow, nan);
              else
                run_tile_narrow<In, Kind, kCount, kParts, kAdd, 0>(c, first, len, t,
                                                                   overflow, underflow, nan);
            });
            return;
          }
        }
        if constexpr (kMayCheck) {
          if (checked) {
            bool done = false;
            // (in place, the results wait in a buffer until the tile is done)
            float* const y = static_cast<float*>(c.y) + first;
            float* const dst = apart ? y : t.checked_out;
            if (checkable) {
              if (bc == 16)
                done = run_tile_checked<kCount, kParts, 16>(c, first, len, t, dst, overflow, underflow, nan);
              else if (bc == 32)
                done = run_tile_checked<kCount, kParts, 32>(c, first, len, t, dst, overflow, underflow, nan);
              else
                done = run_tile_checked<kCount, kParts, 0>(c, first, len, t, dst, overflow, underflow, nan);
            }
            if (done && dst != y) std::memcpy(y, dst, sizeof(float) * size_t(len));
            if (done) return;
            spread(false);
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
            run_tile<In, Kind, kCount, kPow2, kSubExp, kParts, kAdd, kOnce>(c, first, len, t,
                                                                          overflow, underflow, nan);
          });
        });
      };
      round_tile();
      if constexpr (kMayCompareCounts) {
        if (count_after) count();
      }
    }
  }
  counts.overflow += overflow;
  counts.underflow += underflow;
  counts.nan += nan;
}

}  // namespace

double scaled_amax_range(const ScaledCall& c, int64_t br0, int64_t br1) {
  double most = 0.0;
  with_storage_type(c.dtype, [&](auto p) {
    most = amax_rows<std::remove_const_t<std::remove_pointer_t<decltype(p)>>>(c, br0, br1);
  });
  return most;
}

void scaled_scales_range(const ScaledCall& c, double t, int64_t b0, int64_t b1, int64_t& saturated) {
  double* v = c.scales;  // in place: each block's largest magnitude becomes its scale
  // A block without a finite nonzero element takes the smallest scale.
  const double empty = c.scale.rule == ScaleRule::Format ? c.scale.s_smallest * t : 0x1p-127;
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

void scaled_elements_range(const ScaledCall& c, int64_t r0, int64_t r1, EventCounts& counts) {
  with_storage_type(c.dtype, [&](auto p) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    auto go = [&](auto kind) {
      constexpr RoundKind K = decltype(kind)::value;
      // x · (1 / s) is the exact quotient for E8M0's power-of-two scales.
      with_flag(c.count && !c.count_by_comparison, [&](auto count) {
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
