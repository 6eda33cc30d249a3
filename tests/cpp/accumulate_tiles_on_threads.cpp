// The CUDA driver's tiled schedule of accumulation (cpp/src/cuda/accumulate_tiles.hpp) run on CPU
// threads: one std::thread per CUDA thread of a block, a std::barrier for __syncthreads, the
// blocks of a small grid one after another, so that every tile is strided over as on a GPU. Each
// case's outputs and counts must equal the CPU driver's sums of one column at a time
// (accumulate_lanes with one lane, which tests/test_accumulate.py checks against the exact
// reference), bit for bit. Built and run by test_accumulate.py; prints one line per differing case
// and exits 1 if any differs.
#include <barrier>
#include <cfenv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "accumulate_tiles.hpp"

namespace {

using namespace lowfp;

constexpr int kThreads = 256;  // (as the CUDA driver's blocks)

template <int kCols, bool kGroups>
struct ThreadBlock {
  using Tile = AccumulateTile<kThreads, kCols, kGroups>;
  double (*a_chunk)[Tile::kChunk + 1];
  double (*b_chunk)[kCols];
  std::barrier<>* barrier;
  int index;
  int64_t block_index, grid;
  int thread() const { return index; }
  int64_t block() const { return block_index; }
  int64_t blocks() const { return grid; }
  void sync() const { barrier->arrive_and_wait(); }
};

// The directed modes' sums take the floating-point unit's rounding mode, as the CPU driver sets it
// (LaneForm::InMode; CUDA's additions name their direction).
int fpu_mode(const AccumulateParams& p) {
  if (!p.in_mode) return FE_TONEAREST;
  return p.mode == Rounding::Up ? FE_UPWARD : p.mode == Rounding::Down ? FE_DOWNWARD : FE_TOWARDZERO;
}

template <RoundKind K, bool kSub, LaneForm kForm, int kCols, bool kGroups>
void run_tiles(const AccumulateCall& c, int64_t grid, AccumulateCounts& total) {
  using Tile = AccumulateTile<kThreads, kCols, kGroups>;
  std::vector<double> a_chunk(Tile::kRows * (Tile::kChunk + 1)), b_chunk(Tile::kChunk * kCols);
  std::mutex mutex;
  for (int64_t b = 0; b < grid; ++b) {
    std::barrier<> barrier(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::fesetround(fpu_mode(c.p));
        ThreadBlock<kCols, kGroups> blk{reinterpret_cast<double(*)[Tile::kChunk + 1]>(a_chunk.data()),
                               reinterpret_cast<double(*)[kCols]>(b_chunk.data()), &barrier, t, b, grid};
        AccumulateCounts mine;
        accumulate_tiles<K, kSub, kForm, Direction::Fpu, kThreads, kCols, kGroups>(c, blk, mine);
        const std::lock_guard<std::mutex> lock(mutex);
        total.overflow += mine.overflow;
        total.underflow += mine.underflow;
        total.nan += mine.nan;
        total.roundings += mine.roundings;
        total.swamped += mine.swamped;
      });
    }
    for (std::thread& t : threads) t.join();
  }
}

template <RoundKind K, bool kSub, LaneForm kForm>
void columns_one_by_one(const AccumulateCall& c, AccumulateCounts& total) {
  const int saved = std::fegetround();
  std::fesetround(fpu_mode(c.p));
  for (int64_t e = 0; e < c.batch * c.m * c.n; ++e) {
    const int64_t r = e / c.n, j = e % c.n, batch = r / c.m, i = r % c.m;
    double sum[1];
    accumulate_lanes<K, kSub, 1, kForm>(c.p, c.a + batch * c.a_batch + i * c.a_row, c.a_k,
                                        c.b + batch * c.b_batch + j * c.b_col, c.b_k, c.b_col, c.k, c.seed,
                                        c.offset, uint64_t(e), sum, total);
    c.c[e] = stored_sum(sum[0]);
  }
  std::fesetround(saved);
}

// Both ways for the call's lane form and tile, as the CUDA driver chooses them (launch in
// accumulate_cuda.cu); false if they differ.
template <RoundKind K, bool kSub, LaneForm kForm>
bool same_both_ways(AccumulateCall c, std::vector<float>& want, std::vector<float>& got) {
  AccumulateCounts expected, counted;
  c.c = want.data();
  columns_one_by_one<K, kSub, kForm>(c, expected);
  c.c = got.data();
  auto tiles = [&](auto cols, auto groups) {
    constexpr int kCols = decltype(cols)::value;
    // (fewer blocks than tiles where there are several: the grid strides)
    const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(accumulate_tile_count<kThreads, kCols>(c), 3));
    run_tiles<K, kSub, kForm, kCols, decltype(groups)::value>(c, grid, counted);
  };
  if (c.p.group > 0) {
    if (!accumulate_tile_groups(c.p) || accumulate_tile_columns(c.n) != 32) {
      std::printf("a case the tiles do not take\n");
      return false;
    }
    tiles(std::integral_constant<int, 32>{}, std::true_type{});
  } else {
    switch (accumulate_tile_columns(c.n)) {
      case 32: tiles(std::integral_constant<int, 32>{}, std::false_type{}); break;
      case 8: tiles(std::integral_constant<int, 8>{}, std::false_type{}); break;
      default: tiles(std::integral_constant<int, 1>{}, std::false_type{}); break;
    }
  }
  bool same = std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0;
  const int64_t e[5] = {expected.overflow, expected.underflow, expected.nan, expected.roundings, expected.swamped};
  const int64_t g[5] = {counted.overflow, counted.underflow, counted.nan, counted.roundings, counted.swamped};
  for (int v = 0; v < 5; ++v) same &= e[v] == g[v];
  return same;
}

bool same_both_ways(const AccumulateCall& c, std::vector<float>& want, std::vector<float>& got) {
  if (c.p.in_mode) {
    switch (c.p.mode) {
      case Rounding::Stochastic: return same_both_ways<RoundKind::Stochastic, false, LaneForm::InMode>(c, want, got);
      case Rounding::TowardZero: return same_both_ways<RoundKind::TowardZero, false, LaneForm::InMode>(c, want, got);
      default: return same_both_ways<RoundKind::Directed, false, LaneForm::InMode>(c, want, got);
    }
  }
  if (c.p.by_addition) return same_both_ways<RoundKind::Nearest, false, LaneForm::ByAddition>(c, want, got);
  const RoundKind k = round_kind(c.p.mode);
  if (c.p.acc.subnormal_exponent) {
    if (k == RoundKind::Stochastic) return same_both_ways<RoundKind::Stochastic, true, LaneForm::Bits>(c, want, got);
    if (k == RoundKind::Directed) return same_both_ways<RoundKind::Directed, true, LaneForm::Bits>(c, want, got);
    return same_both_ways<RoundKind::Nearest, true, LaneForm::Bits>(c, want, got);
  }
  if (k == RoundKind::Stochastic) return same_both_ways<RoundKind::Stochastic, false, LaneForm::Bits>(c, want, got);
  if (k == RoundKind::Directed) return same_both_ways<RoundKind::Directed, false, LaneForm::Bits>(c, want, got);
  return same_both_ways<RoundKind::Nearest, false, LaneForm::Bits>(c, want, got);
}

struct Shape {
  int64_t batch, m, n, k;
  bool a_transposed, b_transposed;
};

struct Case {
  FormatSpec accumulator;
  Rounding mode;
  AccumulateOrder order;
  int64_t block;
  bool product;
  Overflow overflow;
  int32_t group = 0, align_bits = 0, operand_emin = 0;  // fused groups
};

}  // namespace

int main() {
  // Tiles of 32, 8 and 1 columns; edges of tiles and chunks (k not a multiple of 32 or 16); batches;
  // transposed operands; an empty reduction; a grid smaller than the tiles.
  const std::vector<Shape> shapes = {{1, 5, 40, 37, false, false}, {2, 9, 8, 70, true, false},
                                     {1, 3, 3, 33, false, true},   {1, 300, 1, 20, false, false},
                                     {3, 17, 33, 64, true, true},  {1, 1, 9, 0, false, false},
                                     {1, 40, 12, 100, false, false}, {1, 9, 32, 300, false, true}};
  const FormatSpec e5m2{5, 2, 0, Specials::None, true}, e8m13{8, 13, 0, Specials::IEEE, true},
      e4m3b4{4, 3, 4, Specials::None, true}, e8m7{8, 7, 0, Specials::IEEE, true},
      e4m3_no_subnormals{4, 3, 0, Specials::None, false};
  const std::vector<Case> cases = {
      {e5m2, Rounding::Nearest, AccumulateOrder::Sequential, 0, false, Overflow::Saturate},   // by addition
      {e8m13, Rounding::Nearest, AccumulateOrder::Blocked, 7, false, Overflow::Inf},
      {e4m3b4, Rounding::Nearest, AccumulateOrder::Blocked, 32, true, Overflow::Saturate},   // products' format
      {e8m7, Rounding::NearestAway, AccumulateOrder::Sequential, 0, true, Overflow::NaN},    // by its bits
      {e4m3_no_subnormals, Rounding::Nearest, AccumulateOrder::Sequential, 0, false, Overflow::Saturate},
      {e5m2, Rounding::Stochastic, AccumulateOrder::Blocked, 5, false, Overflow::Saturate},  // by its bits
      {e4m3b4, Rounding::Stochastic, AccumulateOrder::Sequential, 0, false, Overflow::Saturate},  // in the mode
      {e8m7, Rounding::TowardZero, AccumulateOrder::Sequential, 0, false, Overflow::Inf},
      {e5m2, Rounding::Up, AccumulateOrder::Sequential, 0, false, Overflow::Saturate},
      {e5m2, Rounding::Down, AccumulateOrder::Blocked, 9, false, Overflow::Saturate},
      // Fused groups (32-column tiles): Hopper's FP8 accumulation and DeepSeek-V3's promotion
      // (python/lowfp/accumulate.py's presets), and groups of other divisors of a chunk
      {e8m13, Rounding::TowardZero, AccumulateOrder::Sequential, 0, false, Overflow::Saturate, 32, 13, -6},
      {e8m13, Rounding::TowardZero, AccumulateOrder::Blocked, 128, false, Overflow::Saturate, 32, 13, -6},
      {e5m2, Rounding::Nearest, AccumulateOrder::Blocked, 24, false, Overflow::Saturate, 8, 9, -10},
      {e4m3b4, Rounding::Stochastic, AccumulateOrder::Sequential, 0, false, Overflow::Saturate, 16, 20, -126},
      {e8m7, Rounding::Nearest, AccumulateOrder::Sequential, 0, false, Overflow::Inf, 64, 30, -126},
  };
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  int differ = 0, runs = 0;
  for (const Case& q : cases) {
    for (const Shape& s : shapes) {
      if (q.group > 0 && accumulate_tile_columns(s.n) != 32) continue;  // (fused groups: 32-column tiles)
      AccumulateRequest r{};
      r.accumulator = q.accumulator;
      r.overflow = q.overflow;
      r.mode = q.mode;
      r.sr_bits = 13;
      r.order = q.order;
      r.block = q.block;
      r.has_product = q.product;
      r.group = q.group;
      r.align_bits = q.align_bits;
      r.operand_emin = q.operand_emin;
      r.product = FormatSpec{4, 3, 0, Specials::FN, true};
      r.product_overflow = Overflow::Saturate;
      r.outer = FormatSpec{5, 10, 0, Specials::IEEE, true};
      r.outer_overflow = Overflow::Inf;
      AccumulateCall c{};
      c.p = prepare_accumulate(r);
      std::vector<float> a(s.batch * s.m * s.k), b(s.batch * s.k * s.n);
      for (float& v : a) v = normal(gen) * std::ldexp(1.0f, int(gen() % 16) - 8);
      for (float& v : b) v = normal(gen) * std::ldexp(1.0f, int(gen() % 16) - 8);
      if (a.size() > 3) {
        a[0] = 0.0f;
        a[3] = 1e30f;  // (overflows)
      }
      c.a = a.data();
      c.b = b.data();
      c.batch = s.batch;
      c.m = s.m;
      c.n = s.n;
      c.k = s.k;
      c.a_batch = s.m * s.k;
      c.b_batch = s.k * s.n;
      c.a_row = s.a_transposed ? 1 : s.k;
      c.a_k = s.a_transposed ? s.m : 1;
      c.b_k = s.b_transposed ? 1 : s.n;
      c.b_col = s.b_transposed ? s.k : 1;
      c.seed = 77;
      c.offset = 3;
      std::vector<float> want(s.batch * s.m * s.n, -1.0f), got(want.size(), -2.0f);
      ++runs;
      if (!same_both_ways(c, want, got)) {
        ++differ;
        std::printf("differs: mode %d order %d block %lld product %d, %lld x %lld x %lld x %lld\n", int(q.mode),
                    int(q.order), (long long)q.block, int(q.product), (long long)s.batch, (long long)s.m,
                    (long long)s.k, (long long)s.n);
      }
    }
  }
  std::printf("%d of %d cases differ\n", differ, runs);
  return differ == 0 ? 0 : 1;
}
