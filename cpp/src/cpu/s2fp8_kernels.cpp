// The S2FP8 loops (docs/design.md §4), compiled once per instruction-set level like quantize_kernels.cpp:
// the reduction over log2|x| and the element transform, both the shared math of
// cpp/include/lowfp/s2fp8.hpp in plain loops the compiler vectorises (plus, with AVX-512, table
// lookups from registers).
#include "isa.hpp"

#include <cstring>

#include "dispatch.hpp"
#include "lowfp/s2fp8.hpp"
#include "half_lanes.hpp"
#include "philox_lanes.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// Elements per tile of the loops below, a part of a range (ranges are whole kTile tiles): small
// enough that a tile's x, y and work buffers stay in the L1 cache.
constexpr int64_t kS2fp8Tile = 512;
static_assert(kTile % kS2fp8Tile == 0 && kS2fp8Tile % kS2fp8Group == 0,
              "tiles hold whole reduction groups and Philox blocks");

// Elements from one work buffer to the next such that the second starts `bytes` past a multiple
// of 4096 bytes from the first: a load whose address matches an earlier store's modulo 4096
// waits for it (4K aliasing), which stalls the lookups.
constexpr int64_t buffer_stride(int64_t bytes) {
  return kS2fp8Tile + ((4096 + bytes - (kS2fp8Tile * 4) % 4096) % 4096) / 4;
}

// Fetches the next tile's x (to be read) and y (to be written; null: none) into the cache while
// a tile is worked on. The loops below read a tile in a burst and then compute for a while, and
// over that pause the hardware prefetcher does not run far enough ahead: the next burst waited on
// memory (bench/RESULTS.md). Callers spread fetch() over the tile's work.
class NextTile {
 public:
  template <class T>
  NextTile(const T* x, T* y, int64_t next_t0, int64_t end)
      : x_(reinterpret_cast<const char*>(x + next_t0)),
        y_(y == nullptr ? nullptr : reinterpret_cast<char*>(y + next_t0)),
        bytes_(max_of<int64_t>(min_of(kS2fp8Tile, end - next_t0), 0) * int64_t(sizeof(T))) {}
  NextTile() : x_(nullptr), y_(nullptr), bytes_(0) {}  // nothing to fetch
  static constexpr int64_t kLine = 64;
  // Lines [first, first + count) of both, those that exist.
  void fetch(int64_t first, int64_t count) const {
    for (int64_t at = first * kLine; at < min_of((first + count) * kLine, bytes_); at += kLine) {
      __builtin_prefetch(x_ + at, 0);
      if (y_ != nullptr) __builtin_prefetch(y_ + at, 1);
    }
  }
  // Lines per step for a tile's lines to be spread over `steps` steps.
  template <class T>
  static constexpr int64_t lines_per_step(int64_t steps) {
    return (kS2fp8Tile * int64_t(sizeof(T)) / kLine + steps - 1) / steps;
  }

 private:
  const char* x_;
  char* y_;
  int64_t bytes_;
};

// The statistics of a whole tile of 16- or 32-bit x (float32 bits a) that holds only zeros and
// float32 normals, the common case: s2fp8_factor_f32 without its subnormal and special-value
// selects, and the maximum over every element (zeros add 0). false, with the tile to be redone by
// the general loop, when it holds a float32 subnormal, an infinity or a NaN.
template <class In>
bool reduce_plain_stats(const In* x, S2fp8Partial& tile) {
  uint32_t biased_sum = 0, count = 0, max_abs = 0;  // < 2^31 over a tile
  uint32_t min_below = ~0u;                         // min of a - 1: below 2^23 - 1 for a subnormal
  for (int64_t i = 0; i < kS2fp8Tile; ++i) {  // vectorised
    const uint32_t a = Widen<uint32_t>::from(x[i]) & 0x7FFFFFFFu;
    const uint32_t below = a - 1;
    count += uint32_t(below < 0x7F7FFFFFu);  // finite nonzero
    min_below = min_of(min_below, below);
    max_abs = max_of(max_abs, a);
    biased_sum += uint32_t(s2fp8_factor_f32_plain(a).e);
  }
  if (min_below < 0x007FFFFFu || max_abs >= 0x7F800000u) return false;
  tile.exp_sum = int64_t(biased_sum) - 127 * int64_t(count);
  tile.count = count;
  tile.max_abs = Widen<uint64_t>::f32(max_abs);
  return true;
}

// For such a tile, the first two levels of each group's product tree straight from x: row s < 4
// of group g is (row 4s times row 4s+1) times (row 4s+2 times row 4s+3) of its factors, the
// products the tree would form. Writing 4 rows instead of 16 saves most of the stores (about 5 %
// of the reduction's time with AVX2, bench/RESULTS.md).
template <class In>
void plain_rows_of_four(const In* x, double* f) {
  constexpr int kLanes = kS2fp8Lanes;
  for (int64_t g = 0; g < kS2fp8Tile / kS2fp8Group; ++g)
    for (int s = 0; s < kS2fp8Factors / 4; ++s) {
      const In* q = x + g * kS2fp8Group + 4 * s * kLanes;
      double* row = f + g * kS2fp8Group + s * kLanes;
      for (int j = 0; j < kLanes; ++j) {  // vectorised
        const auto factor = [&](int r) {
          const uint32_t a = Widen<uint32_t>::from(q[r * kLanes + j]) & 0x7FFFFFFFu;
          return double(s2fp8_factor_f32_plain(a).f);
        };
        row[j] = (factor(0) * factor(1)) * (factor(2) * factor(3));
      }
    }
}

// The reduction of s2fp8.hpp over [begin, end), begin a multiple of kS2fp8Tile (so of the group).
template <class In>
void reduce(const In* x, int64_t begin, int64_t end, S2fp8Partial& out) {
  S2fp8Partial total;  // added to out once, as quantize's loop adds its counts
  constexpr int kLanes = kS2fp8Lanes;
  constexpr int64_t kGroups = kS2fp8Tile / kS2fp8Group;
  // float16 tiles are widened once, by F16C (half_lanes.hpp), and read as float32 twice
  constexpr bool kViaFloat = kF16cTiles<In>;
  using Src = std::conditional_t<kViaFloat, float, In>;
  alignas(64) Src widened[kViaFloat ? kS2fp8Tile : 1];
  alignas(64) double f[kS2fp8Tile];
  alignas(64) double products[kGroups * kLanes];
  for (int64_t t0 = begin; t0 < end; t0 += kS2fp8Tile) {
    const int64_t len = min_of(kS2fp8Tile, end - t0);
    const int64_t groups = (len + kS2fp8Group - 1) / kS2fp8Group;
    const Src* xt = readable_tile(x + t0, len, widened);
    S2fp8Partial tile;
    int rows_in_f = kS2fp8Factors;  // rows per group that f holds: the tree's level so far
    if constexpr (std::is_same_v<In, double>) {
      for (int64_t i = 0; i < len; ++i) {  // vectorised
        const uint64_t a = bit_cast<uint64_t>(xt[i]) & ~kF64SignBit;
        const S2fp8Factor factor = s2fp8_factor<true>(a);
        const bool use = finite_nonzero_abs(a);
        f[i] = factor.f;
        tile.exp_sum += factor.e;
        tile.count += int64_t(use);
        tile.max_abs = max_of(tile.max_abs, select(use, a, uint64_t(0)));
      }
    } else if (len == kS2fp8Tile && reduce_plain_stats(xt, tile)) {
      plain_rows_of_four(xt, f);
      rows_in_f = kS2fp8Factors / 4;
    } else {  // the last tile of a range, or one with a float32 subnormal, inf or NaN
      int32_t exp_sum = 0, count = 0;  // < 2^31 over a tile
      uint32_t max_abs = 0;
      for (int64_t i = 0; i < len; ++i) {  // vectorised
        const uint32_t a = Widen<uint32_t>::from(xt[i]) & 0x7FFFFFFFu;
        const bool use = a - 1 < 0x7F7FFFFFu;  // finite nonzero
        const S2fp8Factor32 factor = s2fp8_factor_f32(a);
        f[i] = double(factor.f);
        exp_sum += factor.e;
        count += int32_t(use);
        max_abs = max_of(max_abs, select(use, a, 0u));
      }
      tile.exp_sum = exp_sum;
      tile.count = count;
      tile.max_abs = Widen<uint64_t>::f32(max_abs);
    }
    if (rows_in_f == kS2fp8Factors)
      for (int64_t i = len; i < groups * kS2fp8Group; ++i) f[i] = 1.0;
    const NextTile next(x, static_cast<In*>(nullptr), t0 + len, end);
    constexpr int64_t kLinesPerGroup = NextTile::lines_per_step<In>(kGroups);
    // The lane products: at each level, row s of a group becomes row 2s times row 2s+1.
    for (int64_t g = 0; g < groups; ++g) {
      next.fetch(g * kLinesPerGroup, kLinesPerGroup);
      double* rows = f + g * kS2fp8Group;
      for (int n_rows = rows_in_f; n_rows > 1; n_rows /= 2)
        for (int s = 0; s < n_rows / 2; ++s)
          for (int j = 0; j < kLanes; ++j)  // one vector
            rows[s * kLanes + j] = rows[2 * s * kLanes + j] * rows[(2 * s + 1) * kLanes + j];
      for (int j = 0; j < kLanes; ++j) products[g * kLanes + j] = rows[j];
    }
    for (int64_t k = 0; k < groups * kLanes; ++k)  // vectorised; each term < 2^52
      tile.low += s2fp8_fixed_log(products[k]);
    tile.carry();
    total.add(tile);
  }
  out.add(total);
}

// Rounds a tile of Y values in place in their carrier (Bits), adding the events to counts when
// kCount. rand: one Philox word per element, read only for stochastic rounding. The counters
// have the carrier's width so that the loop vectorises in its lanes.
template <RoundKind Kind, class Bits, bool kSubExp, bool kCount>
void round_tile(Bits* v, int64_t len, const RoundParams<Bits>& p, const uint32_t* rand,
                EventCounts& counts) {
  Bits above_max = 0, underflow = 0, nan = 0;
  for (int64_t i = 0; i < len; ++i) {
    RoundEvents ev;
    const uint32_t r = Kind == RoundKind::Stochastic ? rand[i] : 0u;
    v[i] = round_bits<Kind, Bits, kSubExp>(v[i], p, r, ev);
    if constexpr (kCount) {
      above_max += Bits(ev.above_max);
      underflow += Bits(ev.underflow);
      nan += Bits(ev.nan);
    }
  }
  counts.overflow += int64_t(above_max) - int64_t(nan);  // see RoundEvents
  counts.underflow += int64_t(underflow);
  counts.nan += int64_t(nan);
}

template <class T, RoundKind Kind, bool kCount, bool kSubExp>
void transform(const S2fp8Call& c, const S2fp8Stats& stats, int64_t begin, int64_t end,
               EventCounts& out) {
  EventCounts counts;  // added to out once
  const T* x = static_cast<const T*>(c.q.x);
  T* y = static_cast<T*>(c.q.y);
  const RoundParams<uint64_t>& p = c.q.p64;
  // Local copies: a store to float64 y could alias the caller's doubles, which kept the store
  // loop from vectorising for float64 x.
  const S2fp8Stats s = stats;
  const RoundParams<uint64_t> p_store = c.p_store;
  const double inv_alpha = 1.0 / s.alpha;
  alignas(64) uint32_t rand[kS2fp8Tile];
  alignas(64) uint64_t y_bits[kS2fp8Tile];
  for (int64_t t0 = begin; t0 < end; t0 += kS2fp8Tile) {
    const int64_t len = min_of(kS2fp8Tile, end - t0);
    if constexpr (Kind == RoundKind::Stochastic)
      philox_fill(rand, c.q.seed, c.q.offset + uint64_t(t0) / 4, (len + 3) / 4);
    const T* xt = x + t0;
    for (int64_t i = 0; i < len; ++i)  // vectorised
      y_bits[i] = s2fp8_squeeze(Widen<uint64_t>::from(xt[i]), s);
    // scalar: gcc does not vectorise the 64-bit per-lane shifts
    round_tile<Kind, uint64_t, kSubExp, kCount>(y_bits, len, p, rand, counts);
    T* yt = y + t0;  // may alias xt: element i is read before it is written
    for (int64_t i = 0; i < len; ++i)  // vectorised for float32 and float64 y (16-bit y round)
      yt[i] = s2fp8_store<T>(s2fp8_unsqueeze(Widen<uint64_t>::from(xt[i]), y_bits[i], s, inv_alpha),
                             p_store);
  }
  out.add(counts);
}

// The threshold form (S2fp8Thresholds) on one tile, in phases: vector loops for the arithmetic,
// the bucket entries by a TableLookup where there are at most 256 (else a scalar loop; there
// can be up to 2^17) and x' by a TableLookup (in registers where there are at most 256 values).
// Scalar loads rather than vector gathers: gcc emulates gathers with scalar loads and lane
// inserts that cost more than the loads themselves.
struct TileEvents {
  uint32_t above = 0, under = 0, nan = 0;
};

// out[j] = table[index[j]] for j < 16 by scalar loads, reading the indices and writing the
// results two at a time as 64-bit words: memory accesses, not arithmetic, bound this loop, and
// pairing takes them from 3 to 2 per element (bench/RESULTS.md).
inline void lookup16(const uint32_t* __restrict table, const uint32_t* __restrict index,
                     uint32_t* __restrict out) {
  for (int j = 0; j < 16; j += 2) {
    uint64_t two;
    std::memcpy(&two, index + j, sizeof two);
    const uint64_t pair = uint64_t(table[uint32_t(two)]) | (uint64_t(table[two >> 32]) << 32);
    std::memcpy(out + j, &pair, sizeof pair);
  }
}

// out[i] = table[index[i]], fetching the next tile meanwhile (one line of its x and y per 16
// lookups: a tile of 16-bit x has half the lines).
__attribute__((noinline, optimize("no-tree-vectorize")))
void lookup(const uint32_t* __restrict table, const uint32_t* __restrict index,
            uint32_t* __restrict out, int64_t n, const NextTile& next) {
  int64_t i = 0;
  for (int64_t line = 0; i + 16 <= n; ++line, i += 16) {
    next.fetch(line, 1);
    lookup16(table, index + i, out + i);
  }
  for (; i < n; ++i) out[i] = table[index[i]];
}

// kSymmetric, in these loops: the form is mirrored (S2fp8Thresholds::sign_entries = 0), so the
// negative sign has no entries and no event ranges of its own, and the loops drop their per-sign
// terms.
template <class T, bool kSymmetric, class Raw = RawOf<T>>
void bucket_index(const Raw* __restrict x, uint32_t* __restrict index, int64_t len,
                  const S2fp8Thresholds& th) {
  constexpr uint32_t kAbs = kSignRaw<T> - 1;
  constexpr int kSignShift = 8 * sizeof(Raw) - 1;
  S2fp8Thresholds t = th;  // a local copy: the stores below cannot change it
  if constexpr (kSymmetric) t.sign_entries = 0;
  for (int64_t i = 0; i < len; ++i)  // vectorised
    index[i] = t.entry_index(t.raised(x[i] & kAbs), uint32_t(x[i]) >> kSignShift);
}

// Turns bucket entries into indices of values, in place.
template <class T, class Raw = RawOf<T>>
void value_index(const Raw* __restrict x, uint32_t* __restrict entry, int64_t len,
                 const S2fp8Thresholds& th) {
  constexpr uint32_t kAbs = kSignRaw<T> - 1;
  const S2fp8Thresholds t = th;
  for (int64_t i = 0; i < len; ++i)  // vectorised
    entry[i] = t.value_index(t.raised(x[i] & kAbs), entry[i]);
}

// x' for finite nonzero x, else s2fp8_pass_through (x and y may be the same buffer); the events.
template <class T, bool kCount, bool kSymmetric, class Raw = RawOf<T>>
TileEvents store_tile(const Raw* x, Raw* y, const uint32_t* __restrict value, int64_t len,
                      const S2fp8Thresholds& th) {
  constexpr uint32_t kInf = kInfRaw<T>, kAbs = kSignRaw<T> - 1;
  constexpr int kSignShift = 8 * sizeof(Raw) - 1;
  const S2fp8Thresholds t = th;
  // Per-sign event bounds as "the positive one, flipped by these bits for negative x".
  const uint32_t above = th.above[0], under_lo = th.under_lo[0];
  const uint32_t under_w = th.under_hi[0] - th.under_lo[0];
  const uint32_t above_flip = kSymmetric ? 0 : above ^ th.above[1];
  const uint32_t under_lo_flip = kSymmetric ? 0 : under_lo ^ th.under_lo[1];
  const uint32_t under_w_flip = kSymmetric ? 0 : under_w ^ (th.under_hi[1] - th.under_lo[1]);
  TileEvents ev;
  for (int64_t i = 0; i < len; ++i) {  // vectorised
    const uint32_t xb = x[i];
    const uint32_t a = xb & kAbs;
    y[i] = select(a - 1 < kInf - 1, Raw(t.signed_value(value[i], xb)),
                  s2fp8_pass_through<T>(Raw(xb)));
    if constexpr (kCount) {
      const uint32_t neg = uint32_t(0) - (xb >> kSignShift);
      ev.above += uint32_t(a >= (above ^ (neg & above_flip)));
      ev.under += uint32_t(a - (under_lo ^ (neg & under_lo_flip)) < (under_w ^ (neg & under_w_flip)));
      ev.nan += uint32_t(a > kInf);
    }
  }
  return ev;
}

// Whether one of index[0, 16) has kS2fp8Ambiguous set (its sign bit).
inline bool any_flagged16(const uint32_t* index) {
#if defined(__AVX2__)
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index));
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index + 8));
  return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(low, high))) != 0;
#else
  uint32_t any = 0;
  for (int j = 0; j < 16; ++j) any |= index[j];
  return any >= kS2fp8Ambiguous;
#endif
}

// By 16 elements with one test for a flag among them (flags are rare: each element's test and
// branch had cost as much as its loads), as scalar loads (no-tree-vectorize: see lookup()).
template <class Fn>
__attribute__((optimize("no-tree-vectorize")))
void lookup_flagged_scalar(const uint32_t* table, const uint32_t* index, uint32_t* out, int64_t len,
                           Fn&& ambiguous) {
  const auto one = [&](int64_t at) {
    const uint32_t idx = index[at];
    out[at] = table[idx & ~kS2fp8Ambiguous];
    if (idx >= kS2fp8Ambiguous) ambiguous(at);
  };
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    if (__builtin_expect(!any_flagged16(index + i), 1)) {
      lookup16(table, index + i, out + i);
      continue;
    }
    for (int j = 0; j < 16; ++j) one(i + j);
  }
  for (; i < len; ++i) one(i);
}

#if defined(__AVX512F__)
// The same for a table of at most 32 * kPairs entries (padded: that many, 64-byte aligned), held
// in registers: one two-register permute per 32 entries and a tree of blends on the index's
// higher bits. (Scalar loads cost ~3 cycles an element on the machine this was measured on,
// gathers more.)
template <int kPairs, class Fn, class Hook>
void lookup_flagged_avx512(const uint32_t* padded, const uint32_t* table, const uint32_t* index,
                           uint32_t* out, int64_t len, Fn&& ambiguous, const Hook& each16) {
  __m512i t[2 * kPairs];
  for (int j = 0; j < 2 * kPairs; ++j) t[j] = _mm512_load_si512(padded + 16 * j);
  const __m512i flag = _mm512_set1_epi32(int(kS2fp8Ambiguous));
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    each16(i / 16);
    const __m512i idx = _mm512_loadu_si512(index + i);
    __m512i v[kPairs];
    for (int j = 0; j < kPairs; ++j) v[j] = _mm512_permutex2var_epi32(t[2 * j], idx, t[2 * j + 1]);
    for (int half = kPairs / 2, bit = 32; half >= 1; half /= 2, bit *= 2) {
      const __mmask16 upper = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(bit));
      for (int j = 0; j < half; ++j) v[j] = _mm512_mask_blend_epi32(upper, v[2 * j], v[2 * j + 1]);
    }
    _mm512_storeu_si512(out + i, v[0]);
    uint32_t flagged = _mm512_test_epi32_mask(idx, flag);
    for (; flagged != 0; flagged &= flagged - 1) ambiguous(i + __builtin_ctz(flagged));
  }
  lookup_flagged_scalar(table, index + i, out + i, len - i, [&](int64_t j) { ambiguous(i + j); });
}
#endif

// x' = table[index[i]] for a table of `entries` entries, with AVX-512 in registers where it
// holds at most 256 (padded once, for a thread's range), else by scalar loads; ambiguous(i) for
// each element whose index has kS2fp8Ambiguous set. in_registers(): whether the first is taken.
class TableLookup {
 public:
  TableLookup(const uint32_t* table, int64_t entries) : table_(table), entries_(entries) {
#if defined(__AVX512F__)
    for (int64_t j = 0; j < min_of<int64_t>(entries, 256); ++j) padded_[j] = table[j];
#endif
  }
  bool in_registers() const {
#if defined(__AVX512F__)
    return entries_ <= 256;
#else
    return false;
#endif
  }
  // each16(k) is called before the k-th 16 elements looked up in registers.
  template <class Fn, class Hook = NoHook>
  void operator()(const uint32_t* index, uint32_t* out, int64_t len, Fn&& ambiguous,
                  [[maybe_unused]] const Hook& each16 = Hook{}) const {
#if defined(__AVX512F__)
    const auto in = [&](auto pairs) {
      lookup_flagged_avx512<decltype(pairs)::value>(padded_, table_, index, out, len, ambiguous,
                                                    each16);
    };
    if (entries_ <= 64) return in(std::integral_constant<int, 2>{});
    if (entries_ <= 128) return in(std::integral_constant<int, 4>{});
    if (entries_ <= 256) return in(std::integral_constant<int, 8>{});
#endif
    lookup_flagged_scalar(table_, index, out, len, ambiguous);
  }
  // The same for indices that are never flagged, fetching next's lines (one per 16 elements)
  // meanwhile; without registers, scalar loads without the test for flags (lookup()).
  void unflagged(const uint32_t* index, uint32_t* out, int64_t len, const NextTile& next) const {
    if (in_registers())
      (*this)(index, out, len, [](int64_t) {}, [&](int64_t line) { next.fetch(line, 1); });
    else
      lookup(table_, index, out, len, next);
  }

 private:
  const uint32_t* table_;
  int64_t entries_;
#if defined(__AVX512F__)
  alignas(64) uint32_t padded_[256] = {};
#endif
};

template <class T, bool kCount, bool kSymmetric>
void transform_thresholds(const S2fp8Call& c, const S2fp8Thresholds& th, int64_t begin,
                          int64_t end, EventCounts& out) {
  EventCounts counts;  // added to out once
  using Raw = RawOf<T>;
  const Raw* x = static_cast<const Raw*>(c.q.x);
  Raw* y = static_cast<Raw*>(c.q.y);
  constexpr int64_t kStride = buffer_stride(256);
  alignas(64) uint32_t buffer[kStride + kS2fp8Tile];
  uint32_t* index = buffer;
  uint32_t* found = buffer + kStride;
  const TableLookup values(th.values, th.n_values);
  // Bucket entries in registers too where they fit (mirrored float8_e5m2 tables usually do):
  // about half the cost of the scalar loads.
  const TableLookup entries(th.entries, int64_t(th.buckets) + th.sign_entries);
  for (int64_t t0 = begin; t0 < end; t0 += kS2fp8Tile) {
    const int64_t len = min_of(kS2fp8Tile, end - t0);
    const NextTile next(x, y, t0 + len, end);
    bucket_index<T, kSymmetric>(x + t0, index, len, th);
    entries.unflagged(index, found, len, next);
    value_index<T>(x + t0, found, len, th);
    values.unflagged(found, index, len, NextTile());  // (the next tile is fetched by now)
    const TileEvents ev = store_tile<T, kCount, kSymmetric>(x + t0, y + t0, index, len, th);
    counts.overflow += int64_t(ev.above) - int64_t(ev.nan);  // see RoundEvents
    counts.underflow += int64_t(ev.under);
    counts.nan += int64_t(ev.nan);
  }
  out.add(counts);
}

// For the plain loop below, which leaves out the test for t_deep: flags the tile's finite nonzero
// x that reach it, for the float64 path to decide, and returns the underflows the loop counted for
// them.
template <class T, class Raw = RawOf<T>>
__attribute__((noinline)) uint32_t flag_deep(const Raw* x, const float* log_y, uint32_t* index,
                                             int64_t len, const S2fp8FastStochastic& k) {
  uint32_t counted = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t a = Widen<uint32_t>::from(bit_cast<T>(x[i])) & 0x7FFFFFFFu;
    if (a - 1 < 0x7F7FFFFFu && log_y[i] < k.t_deep && index[i] < kS2fp8Ambiguous) {
      counted += uint32_t(index[i] == 0);
      index[i] |= kS2fp8Ambiguous;
    }
  }
  return counted;
}

// The fast stochastic form (S2fp8StochasticForm) on one tile: grid indices in two vector loops,
// x' looked up (in registers where the table fits), the float64 path on the rare ambiguous
// elements, then a vector loop that stores x' (s2fp8_pass_through where x is zero, infinite or NaN).
// kPlain: the form is plain (S2fp8FastStochastic::plain), and the grid loop drops the terms for
// other forms and the test for t_deep (flag_deep runs where a tile may need it), about a tenth of
// its instructions.
template <class T, bool kCount, bool kPlain>
void transform_stochastic(const S2fp8Call& c, const S2fp8Stats& s, const S2fp8StochasticForm& form,
                          int64_t begin, int64_t end, EventCounts& out) {
  EventCounts counts;  // added to out once
  using Raw = RawOf<T>;
  const Raw* x = static_cast<const Raw*>(c.q.x);
  Raw* y = static_cast<Raw*>(c.q.y);
  const S2fp8FastStochastic k = form.k;
  // A tile may hold an x below t_deep when its smallest finite nonzero a, as `lowest` below
  // encodes it, is below deep_abs (>= 1, so the encoding does not wrap).
  const int32_t deep_below = int32_t(k.deep_abs + 0x7FFFFFFFu);
  const double inv_alpha = 1.0 / s.alpha;
  const TableLookup values(form.values, int64_t(k.per_sign) + k.sign_offset);
  alignas(64) uint32_t rand[kS2fp8Tile];
  alignas(64) float log_y[kS2fp8Tile];
  constexpr int64_t kStride = buffer_stride(2048);  // value[i]: half a page past index[i]
  alignas(64) uint32_t buffer[kStride + kS2fp8Tile];
  uint32_t* index = buffer;
  uint32_t* value = buffer + kStride;
  for (int64_t t0 = begin; t0 < end; t0 += kS2fp8Tile) {
    const int64_t len = min_of(kS2fp8Tile, end - t0);
    const NextTile next(x, y, t0 + len, end);
    constexpr int64_t kFetch = NextTile::lines_per_step<Raw>(kS2fp8Tile / (4 * lanes::kLanes));
    philox_fill(rand, c.q.seed, c.q.offset + uint64_t(t0) / 4, (len + 3) / 4,
                [&](int64_t group) { next.fetch(group * kFetch, kFetch); });
    const Raw* xt = x + t0;
    uint32_t under = 0, above = 0, nan = 0;
    for (int64_t i = 0; i < len; ++i)  // vectorised
      log_y[i] = s2fp8_fast_log_y(Widen<uint32_t>::from(bit_cast<T>(xt[i])), k);
    // The smallest a + 2^31 - 1 as a signed integer: zero, infinite and NaN x map above every
    // finite nonzero one.
    int32_t lowest = INT32_MAX;
    for (int64_t i = 0; i < len; ++i) {  // vectorised
      const uint32_t xb = Widen<uint32_t>::from(bit_cast<T>(xt[i]));
      const uint32_t a = xb & 0x7FFFFFFFu;
      // The tests on a as signed comparisons, one instruction each with AVX2: a - 1 + 2^31 is
      // below -2^23 - 1 (signed) exactly for finite nonzero x, and a is below 2^31.
      const int32_t a_less_one = int32_t(a + 0x7FFFFFFFu);
      const bool finite_nonzero = a_less_one < -0x00800001;
      if constexpr (kPlain) lowest = min_of(lowest, a_less_one);
      const uint32_t grid =
          select(finite_nonzero, s2fp8_fast_grid_index<kPlain>(log_y[i], rand[i], k), 0u);
      index[i] = s2fp8_fast_table_index<kPlain>(grid, xb, k);
      if constexpr (kCount) {  // (over > 0: a grid of 0 for x not finite nonzero is not above max)
        under += uint32_t(finite_nonzero & s2fp8_fast_underflow(grid));
        above += uint32_t(s2fp8_fast_above_max(grid, k) |
                          (int32_t(a) > 0x7F7FFFFF));  // infinite x overflow, NaN is "above max" too
        nan += uint32_t(int32_t(a) > 0x7F800000);
      }
    }
    if (kPlain && lowest < deep_below) {
      const uint32_t counted = flag_deep<T>(xt, log_y, index, len, k);
      if constexpr (kCount) under -= counted;
    }
    // The fallback's events have counters of their own: where the lookup does not inline the
    // lambda, taking the loop's counters by reference keeps gcc from vectorising that loop.
    TileEvents fallback;
    const auto ambiguous = [&](int64_t i) {
      RoundEvents ev;
      const uint64_t v = s2fp8_element<RoundKind::Stochastic, false>(
          Widen<uint64_t>::from(bit_cast<T>(xt[i])), s, inv_alpha, c.q.p64, rand[i], ev);
      value[i] = bit_cast<Raw>(s2fp8_store<T>(v, c.p_store));
      fallback.above += uint32_t(ev.above_max);
      fallback.under += uint32_t(ev.underflow);
      fallback.nan += uint32_t(ev.nan);
    };
    values(index, value, len, ambiguous);
    if constexpr (kCount) {
      above += fallback.above;
      under += fallback.under;
      nan += fallback.nan;
    }
    Raw* yt = y + t0;  // may alias xt: element i is read before it is written
    for (int64_t i = 0; i < len; ++i) {  // vectorised
      const uint32_t xb = Widen<uint32_t>::from(bit_cast<T>(xt[i]));
      const uint32_t a = xb & 0x7FFFFFFFu;
      yt[i] = select(a - 1 < 0x7F7FFFFFu, Raw(s2fp8_fast_signed_value(value[i], xb, k)),
                     s2fp8_pass_through<T>(xt[i]));
    }
    counts.overflow += int64_t(above) - int64_t(nan);  // see RoundEvents
    counts.underflow += int64_t(under);
    counts.nan += int64_t(nan);
  }
  out.add(counts);
}

}  // namespace

void s2fp8_reduce_range(const S2fp8Call& c, int64_t begin, int64_t end, S2fp8Partial& part) {
  switch (c.q.x_dtype) {
    case DType::Float16: return reduce(static_cast<const Half*>(c.q.x), begin, end, part);
    case DType::BFloat16: return reduce(static_cast<const BFloat*>(c.q.x), begin, end, part);
    case DType::Float32: return reduce(static_cast<const float*>(c.q.x), begin, end, part);
    case DType::Float64: return reduce(static_cast<const double*>(c.q.x), begin, end, part);
  }
}

void s2fp8_transform_range(const S2fp8Call& c, const S2fp8Stats& s, const S2fp8Forms& forms,
                           int64_t begin, int64_t end, EventCounts& counts) {
  const auto run_form = [&](auto type) {
    using T = typename decltype(type)::type;
    if (forms.thresholds != nullptr) {
      const S2fp8Thresholds& th = *forms.thresholds;
      dispatch_flags(c.q.count, th.sign_entries == 0, [&](auto count, auto symmetric) {
        transform_thresholds<T, decltype(count)::value, decltype(symmetric)::value>(
            c, th, begin, end, counts);
      });
    } else {
      dispatch_flags(c.q.count, forms.stochastic->k.plain, [&](auto count, auto plain) {
        transform_stochastic<T, decltype(count)::value, decltype(plain)::value>(
            c, s, *forms.stochastic, begin, end, counts);
      });
    }
    return true;
  };
  // (float64 x has no per-call form)
  if ((forms.thresholds != nullptr || forms.stochastic != nullptr) &&
      dispatch_narrow(c.q.x_dtype, false, run_form))
    return;
  dispatch_s2fp8(c.q, [&](auto in, auto, auto, auto kind, auto count, auto sub_exp) {
    using T = typename decltype(in)::type;
    transform<T, decltype(kind)::value, decltype(count)::value, decltype(sub_exp)::value>(
        c, s, begin, end, counts);
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
