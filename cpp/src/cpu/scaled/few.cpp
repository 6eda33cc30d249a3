// ScaledStrategy::Few: float32 inputs rounded to nearest, saturating, to an element format of
// few magnitudes (FP4), by comparisons of |x| with each block's thresholds (scaled.hpp's
// FewThresholds): no division, and the counts from the same comparisons.
#include <vector>

#include "scaled/tile.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// Each block's comparisons (FewThresholds), per thread: entries cached per
// value of the scale format (few_keys of them), each filled when a block first needs it, so a
// call computes each scale's thresholds once, not each block's; without keys (scale formats of
// many values), each tile's blocks' own.
struct FewTables {
  static constexpr int64_t kBlocks = kTile / 16 + 1;  // blocks of at least 16 in a tile
  std::vector<FewThresholds> by_key;
  std::vector<double> key_scale;                       // the scale s of each entry (0: none yet)
  alignas(64) FewThresholds tile[kBlocks];
  int32_t at[kBlocks];                                 // block b's entry

  explicit FewTables(const ScaledCpuForms& f)
      : by_key(static_cast<size_t>(f.few_keys)), key_scale(static_cast<size_t>(f.few_keys), 0.0) {}

  // The entries of a tile's blocks with scales bs[0, blocks): entries()[at[b]]
  const FewThresholds* entries(const ScaledCall& c, const ScaledCpuForms& f, const double* bs,
                               int64_t blocks) {
    if (by_key.empty()) {
      for (int64_t b = 0; b < blocks; ++b) tile[b] = few_thresholds(f.magnitudes, bs[b]);
      for (int64_t b = 0; b < blocks; ++b) at[b] = int32_t(b);
      return tile;
    }
    // The key of S = s / t from s · fl(1 / t), within a few units of S's last float64 bit, so
    // rounded to the key's bits (and clamped: a scale off S's range would be a bug, not a
    // reason to read elsewhere). An entry is filled from the block's own s (not the key's S · t).
    const double inv_t = 1.0 / c.t;
    const uint64_t half = uint64_t(1) << (f.few_key_shift - 1);
    const int64_t last = f.few_keys - 1;
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t key =
          int64_t((bit_cast<uint64_t>(bs[b] * inv_t) + half) >> f.few_key_shift) - f.few_key0;
      key = key < 0 ? 0 : (key > last ? last : key);
      if (key_scale[size_t(key)] != bs[b]) {
        by_key[size_t(key)] = few_thresholds(f.magnitudes, bs[b]);
        key_scale[size_t(key)] = bs[b];
      }
      at[b] = int32_t(key);
    }
    return by_key.data();
  }
};

// A tile of float32 inputs rounded by comparisons, blocks of kBlock (a multiple
// of 16), block b's comparisons at entries[at[b]]: |x| against its block's thresholds, each one
// passed stepping the result to the next magnitude's s · g (past the last, E saturates). Inputs
// that pass none round to a zero of x's sign; NaN stays NaN (quieted, as the float32 product of
// the other paths leaves it). In GCC vectors of 16 lanes, each threshold and value a broadcast
// from the entry (AVX-512: an operand of the compare or blend); a ragged last block is padded.
// kCount: the events too, from the same comparisons (the overflow threshold the last).
template <bool kCount, int64_t kBlock>
void run_tile(const ScaledCall& c, const Tile& k, const FewThresholds* entries, const int32_t* at,
              EventCounts& counts) {
  static_assert(kBlock % 16 == 0, "whole vectors per block");
  constexpr int32_t kSteps = kFewMagnitudes - 1, kOver = kSteps;
  const float* x = static_cast<const float*>(c.x) + k.first;
  float* y = static_cast<float*>(c.y) + k.first;
  const int64_t n = k.len;
  const Lanes16 magnitude = Lanes16{} + 0x7fffffffu, sign = Lanes16{} + 0x80000000u,
                inf = Lanes16{} + 0x7f800000u, quiet = Lanes16{} + 0x00400000u,
                one = Lanes16{} + 1u;
  LaneTally over, under, nans;
  // (masks written where they are used: see lanes.cpp)
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
    counts.overflow += over.total();
    counts.underflow += under.total();
    counts.nan += nans.total();
  }
}

}  // namespace

void scaled_few(const ScaledCall& c, const ScaledCpuForms& f, int64_t r0, int64_t r1, EventCounts& counts) {
  FewTables few(f);
  with_flag(c.count, [&](auto count) {
    constexpr bool kCount = decltype(count)::value;
    const auto run = c.block_cols == 16 ? run_tile<kCount, 16> : run_tile<kCount, 32>;  // (plan.cpp)
    for_each_tile(c, r0, r1, [&](const Tile& k) {
      run(c, k, few.entries(c, f, k.bs, k.blocks), few.at, counts);
    });
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
