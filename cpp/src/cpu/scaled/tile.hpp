// What the CPU's scaled strategies (plan.hpp) share, compiled once per instruction-set level
// like the other kernels: the walk over a call's rows in tiles, each tile's scales spread into
// buffers, event tallies, and the counts by comparison.
#pragma once
#include "isa.hpp"

#include <cstring>

#include "dispatch.hpp"
#include "philox_lanes.hpp"
#include "scaled/plan.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {

// (Vector types in signatures: internal linkage, so that no ABI crosses the files.)
namespace {

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

}  // namespace

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
  // Column words (ScaledCall::word_run): the Philox blocks of the tile's columns in rows 4j ..
  // 4j + 3, which the four rows take in turn (column_words_group j, from column column_words_t0)
  static constexpr int kWordLanes = 64;  // (blocks per philox_blocks_at call)
  alignas(64) uint32_t column_words[4][kTile + kWordLanes];
  int64_t column_words_group = -1, column_words_t0 = -1;
  // Per block of the tile (at most kTile + 1 blocks): 1 / s, and the float32 forms (checked).
  alignas(64) double block_inv[kTile + 1];
  alignas(64) float block_s32[kTile + 1];
  alignas(64) float block_inv32[kTile + 1];
  alignas(64) float checked_out[kTile];  // Checked's results, when rounding in place
  // Per block of the tile: its event points as float32 thresholds (count_tile)
  alignas(64) float block_zero[kTile + 1];
  alignas(64) float block_over[kTile + 1];
  int64_t at32 = 0;
  void place32(const void* y) {
    const uintptr_t gap = (uintptr_t(y) + kPage / 2 - uintptr_t(s32_buf)) % kPage;
    at32 = int64_t(gap & ~uintptr_t(63)) / int64_t(sizeof(float));  // (64-byte aligned)
  }
  // The blocks whose forms (block_forms) the per-block buffers hold: their scales and count
  const double* forms_bs = nullptr;
  int64_t forms_blocks = -1;
  bool forms_checkable = false;
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
  // add(l, ev) unless skip is 1 (an element counted elsewhere)
  void add_unless(int64_t l, const RoundEvents& ev, uint32_t skip) {
    const T keep = T(1u - skip);
    above[l] += T(ev.above_max) & keep;
    under[l] += T(ev.underflow) & keep;
    nans[l] += T(ev.nan) & keep;
  }
  void into(EventCounts& counts) const {
    for (int64_t l = 0; l < kLanes; ++l) {
      counts.overflow += int64_t(above[l]) - int64_t(nans[l]);  // see RoundEvents
      counts.underflow += under[l];
      counts.nan += nans[l];
    }
  }
};

// A tile of a row: len elements from column t0 (row-major index first), spanning the blocks
// j0 .. j0 + blocks - 1 of its row, whose scales are bs[0 .. blocks).
struct Tile {
  int64_t first, len, t0, j0, blocks;
  const double* bs;
};

// fn(tile) for the tiles of rows [r0, r1): row by row, each row's tiles in order; for blocks down
// the columns (block_cols 1, more than one row each), tile column by tile column within each
// run of rows of one block row, so that consecutive tiles share their scales (block_forms).
template <class Fn>
void for_each_tile(const ScaledCall& c, int64_t r0, int64_t r1, Fn&& fn) {
  const int64_t gc = c.block_grid_cols(), bc = c.block_cols;
  if (bc == 1 && c.block_rows > 1) {
    for (int64_t s0 = r0; s0 < r1;) {
      const int64_t br = s0 / c.block_rows, s1 = min_of(r1, (br + 1) * c.block_rows);
      const double* scales = c.scales + br * gc;
      for (int64_t t0 = 0; t0 < c.cols; t0 += kTile) {
        const int64_t len = min_of(kTile, c.cols - t0);
        for (int64_t r = s0; r < s1; ++r) fn(Tile{r * c.cols + t0, len, t0, t0, len, scales + t0});
      }
      s0 = s1;
    }
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const double* scales = c.scales + (r / c.block_rows) * gc;
    for (int64_t t0 = 0; t0 < c.cols; t0 += kTile) {
      const int64_t len = min_of(kTile, c.cols - t0), j0 = t0 / bc;
      fn(Tile{r * c.cols + t0, len, t0, j0, (t0 + len - 1) / bc + 1 - j0, scales + j0});
    }
  }
}

// Each block's 1 / s into t.block_inv (a loop over the tile's blocks of its own: it vectorises).
// kPow2: power-of-two scales (pow2_inverse).
template <bool kPow2>
inline void block_inverses(const Tile& k, TileScales& t) {
  for (int64_t b = 0; b < k.blocks; ++b) t.block_inv[b] = kPow2 ? pow2_inverse(k.bs[b]) : 1.0 / k.bs[b];
}

// The float32 forms of each block's scale after block_inverses: s / over_t (exact: 2^±k for
// power-of-two scales, over_t 1; S for scales in a format, over_t the tensor scale) and fl(1 / s).
// Returns whether every fl(1 / s) is a normal float32.
inline bool block_scales32(const Tile& k, double over_t, TileScales& t) {
  for (int64_t b = 0; b < k.blocks; ++b) {
    t.block_s32[b] = float(k.bs[b] / over_t);
    t.block_inv32[b] = float(t.block_inv[b]);
  }
  uint32_t bad = 0;
  for (int64_t b = 0; b < k.blocks; ++b)  // fl(1 / s) in [2^-126, 2^127], by its bits
    bad |= uint32_t(bit_cast<uint32_t>(t.block_inv32[b]) - 0x00800000u > 0x7e800000u);
  return bad == 0;
}

// block_inverses<kPow2> and block_scales32(k, over_t, t) (its answer returned), once for a run of
// tiles of the same blocks (the same scales and count, over_t the same within a call): the rows
// of a block row. (A tile's forms depend on its blocks' scales alone, k.bs[0 .. k.blocks).)
template <bool kPow2 = false>
inline bool block_forms(const Tile& k, double over_t, TileScales& t) {
  if (k.bs == t.forms_bs && k.blocks == t.forms_blocks) return t.forms_checkable;
  block_inverses<kPow2>(k, t);
  t.forms_checkable = block_scales32(k, over_t, t);
  t.forms_bs = k.bs;
  t.forms_blocks = k.blocks;
  return t.forms_checkable;
}

// Each element's block scale and inverse: float32 (from block_scales32, at t.at32: place32 first)
// or float64 (from block_inverses).
inline void spread32(const ScaledCall& c, const Tile& k, TileScales& t) {
  float* s32 = t.s32_buf + t.at32;
  float* inv32 = t.inv32_buf + t.at32;
  if (c.block_cols == 1) {  // (a block per element: copies)
    std::memcpy(s32, t.block_s32, sizeof(float) * size_t(k.len));
    std::memcpy(inv32, t.block_inv32, sizeof(float) * size_t(k.len));
    return;
  }
  for (int64_t i = 0, b = 0; i < k.len; ++b) {
    const int64_t stop = min_of(k.len, (k.j0 + b + 1) * c.block_cols - k.t0);
    const float s = t.block_s32[b], inv = t.block_inv32[b];
    for (; i < stop; ++i) s32[i] = s, inv32[i] = inv;
  }
}
inline void spread64(const ScaledCall& c, const Tile& k, TileScales& t) {
  if (c.block_cols == 1) {
    std::memcpy(t.s, k.bs, sizeof(double) * size_t(k.len));
    std::memcpy(t.inv, t.block_inv, sizeof(double) * size_t(k.len));
    return;
  }
  for (int64_t i = 0, b = 0; i < k.len; ++b) {
    const int64_t stop = min_of(k.len, (k.j0 + b + 1) * c.block_cols - k.t0);
    const double s = k.bs[b], inv = t.block_inv[b];
    for (; i < stop; ++i) t.s[i] = s, t.inv[i] = inv;
  }
}

// Stochastic rounding's words: element i of the tile (row-major index first + i) takes t.rand[i].
inline void draw_words(const ScaledCall& c, const Tile& k, TileScales& t) {
  if (c.word_run != 0) {  // column words: element (r, t0 + j) takes word r % 4 of the block of its
                          // column in rows 4(r / 4) .. + 3 (word_run a multiple of 4)
    const int64_t r = k.first / c.cols, group = r / 4;
    if (group != t.column_words_group || k.t0 != t.column_words_t0) {
      const uint64_t first = c.offset + c.word_index(4 * group, k.t0) / 4;
      const uint64_t step = uint64_t(c.word_run / 4);  // (between consecutive columns' blocks)
      constexpr int kN = TileScales::kWordLanes;
      for (int64_t j0 = 0; j0 < k.len; j0 += kN) {
        uint64_t blocks[kN];
        uint32_t w[4][kN];
        for (int l = 0; l < kN; ++l) blocks[l] = first + uint64_t(j0 + l) * step;
        philox_blocks_at(c.seed, blocks, w);
        for (int q = 0; q < 4; ++q) std::memcpy(t.column_words[q] + j0, w[q], sizeof(w[q]));
      }
      t.column_words_group = group;
      t.column_words_t0 = k.t0;
    }
    std::memcpy(t.rand, t.column_words[r % 4], sizeof(uint32_t) * size_t(k.len));
    return;
  }
  const int64_t phase = k.first % 4;
  philox_fill(t.rand, c.seed, c.offset + uint64_t(k.first / 4), (phase + k.len + 3) / 4);
  // element i's word to rand[i]: indexed rand[phase + i], GCC 12 at -O3 dropped the stores of
  // the float64 loop that read it (baseline and AVX2 kernels; the test comparing the kernels in
  // tests/test_scaled.py)
  if (phase != 0) std::memmove(t.rand, t.rand + phase, sizeof(uint32_t) * size_t(k.len));
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

// The nearest-rounding events of a tile of float32 inputs (ScaledPlan::count_by_comparison):
// |x| against each block's event points ep times its scale, in GCC vectors of
// 16 lanes, each block's points broadcast (a block's ragged end padded with zeros, which count
// nothing). Separate from the rounding loops, which then need no per-element events. kBlock:
// bc when it is 16 or 32 (whole vectors per block), else 0.
template <int64_t kBlock>
void count_tile(const ScaledCall& c, const EventPoints& ep, const Tile& k, TileScales& t,
                EventCounts& counts) {
  const float* x = static_cast<const float*>(c.x) + k.first;
  const int64_t n = k.len, t0 = k.t0, blocks = k.blocks, j0 = k.j0;
  const double* bs = k.bs;
  const int64_t bc = kBlock > 0 ? kBlock : c.block_cols;
  for (int64_t b = 0; b < blocks; ++b) {  // (a loop of its own: it vectorises)
    t.block_zero[b] = strict_threshold(ep.mu_zero * bs[b], ep.up_zero);
    t.block_over[b] = strict_threshold(ep.mu_over * bs[b], ep.up_over);
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
  auto padded = [&](int64_t i, int64_t stop, int64_t b) {
    alignas(64) float in[16] = {};
    std::memcpy(in, x + i, sizeof(float) * size_t(stop - i));
    vector(in, t.block_zero[b], t.block_over[b]);
  };
  if constexpr (kBlock > 0) {
    const int64_t whole = n / kBlock;
    for (int64_t b = 0; b < whole; ++b)
      for (int64_t v = 0; v < kBlock; v += 16)
        vector(x + b * kBlock + v, t.block_zero[b], t.block_over[b]);
    for (int64_t i = whole * kBlock; i < n; i += 16) padded(i, min_of(i + 16, n), whole);
  } else {
    for (int64_t i = 0, b = 0; i < n; ++b) {
      const int64_t stop = min_of(n, (j0 + b + 1) * bc - t0);
      for (; i + 16 <= stop; i += 16) vector(x + i, t.block_zero[b], t.block_over[b]);
      if (i < stop) padded(i, stop, b);
      i = stop;
    }
  }
  counts.overflow += over.total();
  counts.underflow += under.total();
  counts.nan += nans.total();
}

// round() for a tile, with its counts by comparison when the plan says so: after the rounding,
// while its inputs are in cache, or before it when the rounding overwrites them.
template <class Round>
void round_tile(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, const Tile& k,
                TileScales& t, EventCounts& counts, Round&& round) {
  auto count = [&] {
    if (c.block_cols == 16) count_tile<16>(c, f.events, k, t, counts);
    else if (c.block_cols == 32) count_tile<32>(c, f.events, k, t, counts);
    else count_tile<0>(c, f.events, k, t, counts);
  };
  if (plan.count_by_comparison && plan.in_place) count();
  round();
  if (plan.count_by_comparison && !plan.in_place) count();
}

// The strategies, one file each, over rows [r0, r1) of a call whose scales (t included) are known.
void scaled_float64(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                    int64_t r1, EventCounts& counts);
void scaled_checked(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                    int64_t r1, EventCounts& counts);
void scaled_narrow(const ScaledCall& c, const ScaledCpuForms& f, const ScaledPlan& plan, int64_t r0,
                   int64_t r1, EventCounts& counts);
void scaled_lanes(const ScaledCall& c, int64_t r0, int64_t r1,
                  EventCounts& counts);
void scaled_few(const ScaledCall& c, const ScaledCpuForms& f, int64_t r0, int64_t r1, EventCounts& counts);

// One float32 tile in the float64 carrier (Checked's rerun), its block inverses known.
void float64_tile(const ScaledCall& c, bool count, const Tile& k, TileScales& t,
                  EventCounts& counts);

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
