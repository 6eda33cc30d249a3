// The CUDA driver's schedule for the sequential and blocked orders without Kahan's corrections
// (docs/design.md §10), one product at a time or in fused groups: a thread block computes a tile
// of kRows × kCols output elements, one a thread, from chunks of kChunk steps of A's rows and B's
// columns staged in the block's shared memory as float64. Each operand is read from global memory
// and widened once per tile, not once per product, and a step is two shared-memory reads, the
// product and the sum (cpp/include/lowfp/accumulate.hpp's AccumulateLanes, as on the CPU).
//
// Written for nvcc and for the host compiler alike: the block (its thread and tile indices, its
// barrier, its staged chunks) is a parameter, a CUDA thread block in accumulate_cuda.cu and CPU
// threads with a barrier in tests/cpp/accumulate_tiles_on_threads.cpp, which runs this schedule
// against the CPU's sums in CI.
#pragma once
#include "accumulate_call.hpp"

#if defined(__CUDACC__)
#define LOWFP_TILE_FN __device__ __forceinline__
#define LOWFP_UNROLL_4 _Pragma("unroll 4")
#else
#define LOWFP_TILE_FN inline
#define LOWFP_UNROLL_4 _Pragma("GCC unroll 4")
#endif

namespace lowfp {

// A tile's shape for blocks of kThreads threads. Narrow B (attention's heads, a matrix times a
// vector) takes narrow tiles, so that threads are not left without a column; a one-column tile's
// rows stage fewer steps, to stay within shared memory's 48 KiB.
// kGroups: fused groups, which stage kAccumulateMaxGroup steps, so that a group of a divisor of
// that many products never straddles two chunks (accumulate_tile_groups).
template <int kThreads, int kCols, bool kGroups = false>
struct AccumulateTile {
  static constexpr int kRows = kThreads / kCols;
  static constexpr int kChunk = kGroups ? kAccumulateMaxGroup : kCols == 1 ? 16 : 32;
  static_assert(kRows * kCols == kThreads, "a tile has a thread per output element");
};

// The tile's columns for a call: 32, 8 or 1 as B has at least that many.
inline int accumulate_tile_columns(int64_t n) { return n >= 32 ? 32 : n >= 8 ? 8 : 1; }

// Whether a call's fused groups can be summed from staged chunks: groups of a divisor of the
// chunk's steps, which then start at multiples of the group size as the spec's do (from k = 0,
// and from each block's start, a multiple of the group).
inline bool accumulate_tile_groups(const AccumulateParams& p) {
  return p.group > 0 && kAccumulateMaxGroup % p.group == 0 &&
         (p.order == AccumulateOrder::Sequential || (p.order == AccumulateOrder::Blocked && p.block % p.group == 0));
}

// The tiles of a call (the grid strides over them).
template <int kThreads, int kCols>
inline int64_t accumulate_tile_count(const AccumulateCall& c) {
  constexpr int kRows = AccumulateTile<kThreads, kCols>::kRows;  // (kRows does not depend on kGroups)
  return c.batch * ((c.m + kRows - 1) / kRows) * ((c.n + kCols - 1) / kCols);
}

// Where the steps just taken ended a block (block_left reached 0): the block's sum into the outer
// sum, and the next block from +0.
LOWFP_TILE_FN void end_of_block(int64_t block, int64_t& block_left, double (&sum)[1], double (&out)[1],
                                const AccumulateParams& p, AccumulateCounts& counts) {
  if (block_left != 0) return;
  add_block_sum<1>(out, sum, p, counts);
  sum[0] = 0.0;
  block_left = block;
}

// One thread's fused groups of a staged chunk (chunk_sums' arguments): a group ends at the
// group's size, the chunk's end (the reduction's) or the block's, whichever comes first.
template <int kCols, class Sums>
LOWFP_TILE_FN void chunk_groups(Sums& acc, const double* a, const double* b, int steps, int64_t block,
                                int64_t& block_left, double (&sum)[1], double (&out)[1], const AccumulateParams& p,
                                AccumulateCounts& counts) {
  for (int kk = 0; kk < steps;) {
    const int n = int(min_of<int64_t>(min_of(steps - kk, p.group), block_left));
    add_fused_group(acc, p, a + kk, 1, b + kk * kCols, kCols, 0, n, sum);
    kk += n;
    block_left -= n;
    end_of_block(block, block_left, sum, out, p, counts);
  }
}

// One thread's steps of a staged chunk: a its row's operands (consecutive), b its column's (kCols
// apart); the block's sum added to the outer sum where a block ends (block_left steps away).
template <int kCols, bool kProduct, class Sums>
LOWFP_TILE_FN void chunk_sums(Sums& acc, const double* a, const double* b, int steps, int64_t block,
                              int64_t& block_left, double (&sum)[1], double (&out)[1], const AccumulateParams& p,
                              AccumulateCounts& counts) {
  for (int kk = 0; kk < steps;) {
    const int run = int(min_of<int64_t>(steps - kk, block_left));
LOWFP_UNROLL_4
    for (int u = 0; u < run; ++u, ++kk) {
      double q[1] = {a[kk] * b[kk * kCols]};  // (exact: 48 bits)
      if constexpr (kProduct) round_nearest_lanes<1>(q, q, p.product, p.product_add_cap, counts);
      acc.add(sum, sum, q);
    }
    block_left -= run;
    end_of_block(block, block_left, sum, out, p, counts);
  }
}

// The calling thread's output elements, its roundings counted into `counts`. Block: thread()
// (0 .. kThreads - 1), block() and blocks() (the grid), sync() (every thread of the block), and
// the staged chunks a_chunk[kRows][kChunk + 1] (+1: a warp's rows in different banks) and
// b_chunk[kChunk][kCols]. Every thread of a block takes every chunk and barrier, whether or not
// it has an element of the tile.
template <RoundKind K, bool kSub, LaneForm kForm, Direction kDir, int kThreads, int kCols, bool kGroups, class Block>
LOWFP_TILE_FN void accumulate_tiles(const AccumulateCall& c, Block& blk, AccumulateCounts& counts) {
  using Tile = AccumulateTile<kThreads, kCols, kGroups>;
  constexpr int kRows = Tile::kRows, kChunk = Tile::kChunk;
  const int row = blk.thread() / kCols, col = blk.thread() % kCols;
  const int64_t row_tiles = (c.m + kRows - 1) / kRows, col_tiles = (c.n + kCols - 1) / kCols;
  const bool blocked = c.p.order == AccumulateOrder::Blocked;
  const int64_t block = blocked ? c.p.block : c.k + 1;  // (sequential: one block, never ended early)
  for (int64_t t = blk.block(); t < c.batch * row_tiles * col_tiles; t += blk.blocks()) {
    const int64_t batch = t / (row_tiles * col_tiles), in_batch = t % (row_tiles * col_tiles);
    const int64_t i0 = in_batch / col_tiles * kRows, j0 = in_batch % col_tiles * kCols;
    const int64_t i = i0 + row, j = j0 + col, e = (batch * c.m + i) * c.n + j;
    const bool active = i < c.m && j < c.n;
    const float* a = c.a + batch * c.a_batch;
    const float* b = c.b + batch * c.b_batch;
    AccumulateLanes<K, kSub, 1, kForm, PhiloxLaneBlocks, kDir> acc(c.p, counts, c.seed, c.offset, uint64_t(e), c.k);
    double sum[1] = {0.0}, out[1] = {0.0};  // the (block's) sum; blocked: the outer sum
    int64_t block_left = block;
    for (int64_t k0 = 0; k0 < c.k; k0 += kChunk) {
      const int steps = int(min_of<int64_t>(kChunk, c.k - k0));
      blk.sync();  // (every thread done with the previous chunk)
      for (int x = blk.thread(); x < kRows * kChunk; x += kThreads) {
        const int r = x / kChunk, kk = x % kChunk;
        blk.a_chunk[r][kk] = i0 + r < c.m && kk < steps ? double(a[(i0 + r) * c.a_row + (k0 + kk) * c.a_k]) : 0.0;
      }
      for (int x = blk.thread(); x < kChunk * kCols; x += kThreads) {
        const int kk = x / kCols, cc = x % kCols;
        blk.b_chunk[kk][cc] = j0 + cc < c.n && kk < steps ? double(b[(k0 + kk) * c.b_k + (j0 + cc) * c.b_col]) : 0.0;
      }
      blk.sync();
      if (!active) continue;
      // (the products' format chosen once a chunk, not in its loop)
      if constexpr (kGroups) {
        chunk_groups<kCols>(acc, &blk.a_chunk[row][0], &blk.b_chunk[0][col], steps, block, block_left, sum, out, c.p,
                            counts);
      } else if (c.p.has_product) {
        chunk_sums<kCols, true>(acc, &blk.a_chunk[row][0], &blk.b_chunk[0][col], steps, block, block_left, sum, out,
                                c.p, counts);
      } else {
        chunk_sums<kCols, false>(acc, &blk.a_chunk[row][0], &blk.b_chunk[0][col], steps, block, block_left, sum, out,
                                 c.p, counts);
      }
    }
    if (!active) continue;
    if (!blocked) out[0] = sum[0];
    else if (block_left != block) add_block_sum<1>(out, sum, c.p, counts);  // (the last, partial block)
    c.c[e] = stored_sum(out[0]);
  }
}

}  // namespace lowfp
