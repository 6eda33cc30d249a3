// The CUDA one-pass kernels (scaled_rows.cu, scaled_columns.cu, scaled_tiles.cu) followed on the
// CPU with their own per-thread code (scaled_one_pass.hpp), in the kernel instance each call takes
// (with_one_pass_instance: the float32 carriers, checked or narrow, or the float64 carrier's
// faster forms):
// - row_blocks_kernel (MX, NVFP4, rows of 1 × 128) warp by warp: each lane's turns by its
//   schedule (row_blocks_schedule.hpp), the first half of each turn (row_blocks_load), the
//   block's maximum by the same butterfly of shuffles as group_max, then the second half
//   (row_blocks_round);
// - column_blocks_kernel (blocks down the columns: a GEMM operand along its reduction axis, with
//   and without a word_run) block by block (column_block);
// - tile_blocks_kernel (2-D blocks of 256 elements or more, short ones at the edges) thread block
//   by thread block: each thread's share of the block's maximum (tile_block_max), their maximum,
//   the block's forms, then each thread's share rounded (tile_block_round).
// (float16 inputs take bfloat16's code but for their conversions, tested elsewhere: left out, as
// its kernel instances would add a third to the build.) Each case's outputs, scales, elements
// and counts must equal, bit for bit, the float64 carrier's plain rounding of each block
// (block_scale, then scaled_element without faster forms, words by ScaledCall::word_index: the
// CPU's form that tests/test_scaled.py checks against the exact reference). Built and run by tests/test_scaled.py; prints the kernel
// instances taken and one line per differing case, and exits 1 if any differs.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "scaled_one_pass.hpp"

namespace {

using namespace lowfp;

constexpr FormatSpec kE4M3{4, 3, 0, Specials::FN, true};
constexpr FormatSpec kE5M2{5, 2, 0, Specials::IEEE, true};
constexpr FormatSpec kE3M2{3, 2, 0, Specials::None, true};
constexpr FormatSpec kE2M1{2, 1, 0, Specials::None, true};
constexpr FormatSpec kFloat32{8, 23, 0, Specials::IEEE, true};

constexpr unsigned kThreads = 256;  // (as the CUDA kernels' thread blocks)

struct Counts {
  uint64_t overflow = 0, underflow = 0, nan = 0, saturated = 0;
  bool operator!=(const Counts& o) const {
    return overflow != o.overflow || underflow != o.underflow || nan != o.nan || saturated != o.saturated;
  }
};

template <class In>
struct Outputs {
  std::vector<In> y;
  std::vector<double> scales;
  std::vector<float> q;
  Counts counts;
};

// The element as the storage type holds it, from a float64 value (through float32).
template <class In>
In stored(double v) {
  if constexpr (std::is_same_v<In, double>) return v;
  else return Store<In>::from(bit_cast<uint32_t>(float(v)));
}

// Test inputs: normal values times a power of two per block (2^-40 to 2^40; block_of(i): element
// i's block, of `blocks`), with zeros, float32 subnormals, values past the format's range,
// infinities, NaNs, a block of zeros (block 1) and one of infinities and NaNs only (block 2).
template <class In, class BlockOf>
std::vector<In> inputs(int64_t n, int64_t blocks, BlockOf block_of, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(-40, 40), pick(0, 99);
  std::vector<double> scale(blocks);
  for (double& v : scale) v = std::ldexp(1.0, exponent(gen));
  std::vector<In> x(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = block_of(i);
    double v = normal(gen) * scale[b];
    const int p = pick(gen);
    if (p == 0) v = 0.0;
    else if (p == 1) v = -0.0;
    else if (p == 2) v = std::ldexp(normal(gen), -140);
    else if (p == 3) v = INFINITY;
    else if (p == 4) v = NAN;
    else if (p == 5) v = normal(gen) * 1e30;
    if (b == 1) v = 0.0;
    if (b == 2) v = i % 2 ? -INFINITY : NAN;
    x[i] = stored<In>(v);
  }
  return x;
}

template <class In>
double value(In v) {
  return bit_cast<double>(Widen<uint64_t>::from(v));
}

// fn(r, col) for each element of block b (row-major over the block grid), either layout.
template <class Fn>
void each_element(const ScaledCall& c, int64_t b, Fn&& fn) {
  const ScaledBlock at = c.block(b);
  for (int64_t r = at.r0; r < at.r0 + at.h; ++r)
    for (int64_t col = at.c0; col < at.c0 + at.w; ++col) fn(r, col);
}

// The float64 carrier's plain rounding of each block: the reference.
template <class In, RoundKind K, bool kPow2, bool kSubExp>
Outputs<In> reference(const ScaledCall& c, const std::vector<In>& x, double t) {
  const int64_t blocks = c.block_grid_rows() * c.block_grid_cols();
  Outputs<In> o{std::vector<In>(x.size()), std::vector<double>(blocks), std::vector<float>(x.size()), {}};
  for (int64_t b = 0; b < blocks; ++b) {
    double a = 0.0;
    each_element(c, b, [&](int64_t r, int64_t col) {
      const double v = std::fabs(value(x[r * c.cols + col]));
      if (std::isfinite(v)) a = std::fmax(a, v);
    });
    bool sat = false;
    const double s = a > 0.0 ? block_scale(c.scale, a, t, sat) : empty_block_scale(c.scale, t);
    o.scales[b] = s;
    o.counts.saturated += sat;
    each_element(c, b, [&](int64_t r, int64_t col) {
      const int64_t i = r * c.cols + col;
      const uint64_t w = c.word_index(r, col);
      const uint32_t word = K == RoundKind::Stochastic ? philox_block(c.seed, c.offset + w / 4).w[w % 4] : 0u;
      RoundEvents ev;
      const double q = scaled_element<K, kPow2, kSubExp>(value(x[i]), s, 1.0 / s, c.p, word, ev);
      o.q[i] = float(q);
      o.y[i] = store_scaled<In>(q * s, c.out);
      o.counts.overflow += ev.overflow();
      o.counts.underflow += ev.underflow;
      o.counts.nan += ev.nan;
    });
  }
  return o;
}

// The kernel's work: row_blocks_kernel's on a grid of `warps` warps, warp by warp,
// column_blocks_kernel's block by block, or tile_blocks_kernel's block by block, thread by
// thread; its instance's name into `instance`.
template <class In>
Outputs<In> kernel_on_lanes(ScaledCall c, const std::vector<In>& x, double t, int64_t warps, std::string& instance) {
  const int64_t blocks = c.block_grid_rows() * c.block_grid_cols();
  Outputs<In> o{std::vector<In>(x.size()), std::vector<double>(blocks, -1.0), std::vector<float>(x.size()), {}};
  c.y = o.y.data();
  c.scales = o.scales.data();
  c.q = o.q.data();
  const double empty = empty_block_scale(c.scale, t);
  const RawOf<In> exponent = RawOf<In>(exponent_mask(c.dtype));
  with_one_pass_instance(c, [&](auto type, auto kind, auto count, auto pow2, auto sub, auto carrier, auto faster,
                                auto once, auto faster32) {
    using U = RawOf<In>;
    if constexpr (std::is_same_v<typename decltype(type)::type, In>) {
      constexpr RoundKind K = decltype(kind)::value;
      constexpr bool kCount = decltype(count)::value, kPow2 = decltype(pow2)::value, kSub = decltype(sub)::value,
                     kFaster = decltype(faster)::value, kOnce = decltype(once)::value,
                     kFaster32 = decltype(faster32)::value;
      constexpr Carrier kCarrier = decltype(carrier)::value;
      instance = std::string(kCarrier == Carrier::Checked ? "checked" : kCarrier == Carrier::Narrow ? "narrow" : "float64") +
                 (kFaster || kFaster32 ? " faster" : "") + (kOnce ? " once" : "");
      ThreadCounts tc[32];
      uint64_t saturated[32] = {};
      if (column_blocks(c)) {
        for (int64_t b = 0; b < blocks; ++b)
          column_block<In, K, kCount, kPow2, kSub, kCarrier, kFaster, kOnce, kFaster32>(c, b, exponent, t, empty, tc[0],
                                                                                       saturated[0]);
      } else if (!row_blocks(c)) {  // (tile_blocks: a thread block of kThreads threads a block)
        for (int64_t b = 0; b < blocks; ++b) {
          const ScaledBlock at = c.block(b);
          uint64_t block_max = 0;  // (thread_block_max: the largest of the threads' raw float64 bits)
          for (unsigned thread = 0; thread < kThreads; ++thread) {
            const BlockShare share(at.w / 4, thread, kThreads);
            block_max = max_of(block_max, bit_cast<uint64_t>(raw_value<In>(tile_block_max<In>(c, at, share, exponent))));
          }
          bool sat = false;
          const BlockForms f = block_forms<kCarrier, kPow2>(c, bit_cast<double>(block_max), t, empty, sat);
          c.scales[b] = f.s;
          saturated[0] += sat;
          for (unsigned thread = 0; thread < kThreads; ++thread)
            tile_block_round<In, K, kCount, kPow2, kSub, kCarrier, kFaster, kOnce, kFaster32>(
                c, at, BlockShare(at.w / 4, thread, kThreads), f, tc[thread % 32]);
        }
      } else {
        for (int64_t warp = 0; warp < warps; ++warp) {
          const RowBlocksSchedule first(c.block_cols, 0);
          for (int64_t b0 = first.first_block(warp); b0 < blocks; b0 += first.stride(warps)) {
            Quad<In> in[32][kRowBlocksQuads];
            U m[32];
            for (int lane = 0; lane < 32; ++lane) {
              const RowBlocksSchedule s(c.block_cols, lane);
              m[lane] = row_blocks_load(c, s, s.block(b0), s.block(b0) < blocks, exponent, in[lane]);
            }
            for (int o2 = first.lanes / 2; o2 > 0; o2 >>= 1) {  // group_max's butterfly
              U next[32];
              for (int lane = 0; lane < 32; ++lane) next[lane] = max_of(m[lane], m[lane ^ o2]);
              std::memcpy(m, next, sizeof(m));
            }
            for (int lane = 0; lane < 32; ++lane) {
              const RowBlocksSchedule s(c.block_cols, lane);
              if (s.block(b0) < blocks)
                row_blocks_round<In, K, kCount, kPow2, kSub, kCarrier, kFaster, kOnce, kFaster32>(
                    c, s, s.block(b0), in[lane], raw_value<In>(m[lane]), t, empty, tc[lane], saturated[lane]);
            }
          }
        }
      }
      for (int lane = 0; lane < 32; ++lane) {
        o.counts.overflow += tc[lane].overflow;
        o.counts.underflow += tc[lane].underflow;
        o.counts.nan += tc[lane].nan;
        o.counts.saturated += saturated[lane];
      }
    }
  });
  return o;
}

struct Case {
  const char* name;
  FormatSpec element;
  ScaleRule rule;
  FormatSpec scale_format;
  bool tensor_scale;
  int64_t block;
};

int failures = 0, cases = 0;
std::map<std::string, int> instances;  // the kernel instances the cases took

// Where a case's blocks lie: along the rows (row_blocks_kernel), down the columns (blocks of
// k.block rows, column_blocks_kernel), down the columns with a word_run of all its rows, or in
// tiles of k.block × k.block (tile_blocks_kernel where they hold 256 elements or more).
enum class Layout { Rows, Columns, ColumnsInRuns, Tiles };

template <class In>
void run(const Case& k, Layout layout, DType dtype, Rounding mode, Overflow overflow, bool count) {
  ScaledRequest r{k.element, overflow, mode, 32, k.rule, k.scale_format, k.tensor_scale, BlockChoice::Fixed, dtype};
  const bool rows_layout = layout == Layout::Rows, tiles = layout == Layout::Tiles;
  if (tiles && (k.block * k.block < kThreads || dtype == DType::Float64)) return;  // (not tile_blocks calls)
  // (down the columns without runs, a last block of 6 rows; tiles: a last row of blocks of 4 rows,
  // a last column of blocks of 8 columns)
  const int64_t rows = rows_layout ? 5 : 2 * k.block + (layout == Layout::Columns ? 6 : tiles ? 4 : 0);
  const int64_t cols = rows_layout ? 7 * k.block : tiles ? k.block + 8 : 5;
  const int64_t block_rows = rows_layout ? 1 : k.block, block_cols = rows_layout ? k.block : tiles ? k.block : 1;
  const int64_t word_run = layout == Layout::ColumnsInRuns ? rows : 0;
  const int64_t grid_cols = (cols + block_cols - 1) / block_cols;
  const int64_t blocks = ((rows + block_rows - 1) / block_rows) * grid_cols;
  const std::vector<In> x = inputs<In>(rows * cols, blocks, [&](int64_t i) {
    return (i / cols / block_rows) * grid_cols + (i % cols) / block_cols;
  }, uint32_t(cases + 1));
  std::vector<In> y(x.size());
  std::vector<double> scales(blocks);
  const ScaledCall c = with_buffers(prepare_scaled_call(r), x.data(), y.data(), rows, cols, block_rows, block_cols,
                                    word_run, 0x1234567890abcdefull + cases, 1000 + cases, scales.data(), nullptr,
                                    count ? 6 : 0);
  if (rows_layout ? !row_blocks(c) : tiles ? row_blocks(c) || column_blocks(c) || !tile_blocks(c, kThreads)
                                           : !column_blocks(c)) {
    std::printf("%s: not a call of the layout's kernel\n", k.name);
    ++failures;
    return;
  }
  double amax = 0.0;
  for (In v : x)
    if (std::isfinite(value(v))) amax = std::fmax(amax, std::fabs(value(v)));
  const double t = c.tensor_scale ? tensor_scale(c.scale, amax) : 1.0;
  Outputs<In> want;
  with_round_kind(mode, [&](auto kind) {
    with_flag(k.rule != ScaleRule::Format, [&](auto pow2) {
      with_flag(c.p.subnormal_exponent, [&](auto sub) {
        want = reference<In, decltype(kind)::value, decltype(pow2)::value, decltype(sub)::value>(c, x, t);
      });
    });
  });
  for (int64_t warps : {1, 3, 1000}) {
    if (!rows_layout && warps != 1) break;  // (the columns kernel: block by block)
    ++cases;
    std::string instance;
    const Outputs<In> got = kernel_on_lanes(c, x, t, warps, instance);
    ++instances[instance];
    std::string what;
    for (size_t i = 0; i < x.size() && what.empty(); ++i) {
      if (std::memcmp(&got.y[i], &want.y[i], sizeof(In)) != 0) what = "y[" + std::to_string(i) + "]";
      else if (bit_cast<uint32_t>(got.q[i]) != bit_cast<uint32_t>(want.q[i]) && !(std::isnan(got.q[i]) && std::isnan(want.q[i])))
        what = "q[" + std::to_string(i) + "]";
    }
    for (size_t b = 0; b < want.scales.size() && what.empty(); ++b)
      if (bit_cast<uint64_t>(got.scales[b]) != bit_cast<uint64_t>(want.scales[b])) what = "scale " + std::to_string(b);
    if (what.empty() && count && got.counts != want.counts) what = "counts";
    if (!what.empty()) {
      ++failures;
      std::printf("%s, layout %d, dtype %d, mode %d, overflow %d, count %d, %lld warps (%s): %s differs\n", k.name,
                  int(layout), int(dtype), int(mode), int(overflow), int(count), (long long)warps, instance.c_str(),
                  what.c_str());
    }
  }
}

}  // namespace

int main() {
  const Case all[] = {
      {"mxfp8_e4m3", kE4M3, ScaleRule::Floor, {}, false, 32},
      {"mxfp8_e5m2 (even)", kE5M2, ScaleRule::Even, {}, false, 32},
      {"mxfp6_e3m2 (rceil)", kE3M2, ScaleRule::RCeil, {}, false, 32},
      {"mxfp4_e2m1 (ceil)", kE2M1, ScaleRule::Ceil, {}, false, 32},
      {"e2m1, E8M0 scales, blocks of 4", kE2M1, ScaleRule::Floor, {}, false, 4},
      {"e4m3, E8M0 scales, blocks of 8", kE4M3, ScaleRule::Floor, {}, false, 8},
      {"nvfp4", kE2M1, ScaleRule::Format, kE4M3, true, 16},
      {"e2m1, E4M3 scales, no tensor scale", kE2M1, ScaleRule::Format, kE4M3, false, 16},
      {"e4m3, float32 scales, 1 x 128", kE4M3, ScaleRule::Format, kFloat32, false, 128},
      {"e5m2, E4M3 scales and a tensor scale, blocks of 64", kE5M2, ScaleRule::Format, kE4M3, true, 64},
  };
  for (const Case& k : all)
    for (Layout layout : {Layout::Rows, Layout::Columns, Layout::ColumnsInRuns, Layout::Tiles})
      for (Rounding mode : {Rounding::Nearest, Rounding::TowardZero, Rounding::Up, Rounding::Stochastic})
        for (bool count : {false, true}) {
          run<float>(k, layout, DType::Float32, mode, Overflow::Saturate, count);
          run<BFloat>(k, layout, DType::BFloat16, mode, Overflow::Saturate, count);
          if (mode == Rounding::Nearest) {
            run<BFloat>(k, layout, DType::BFloat16, mode, Overflow::Inf, count);
            run<double>(k, layout, DType::Float64, mode, Overflow::Saturate, count);
          }
        }
  for (const auto& [name, n] : instances) std::printf("instance %s: %d cases\n", name.c_str(), n);
  std::printf("%d of %d cases differ\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
