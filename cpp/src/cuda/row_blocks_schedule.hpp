// Which elements each lane of a warp holds in the one-pass kernel for 1-D blocks along the rows
// (scaled_rows.cu's row_blocks_kernel: MX, NVFP4). A block of w = 4 · 2^k consecutive elements
// (4 to 128, cutting each row evenly) is held by `lanes` consecutive lanes, aligned to `lanes`
// (a power of two), so that its largest magnitude is a shuffle reduction of that width. Each lane
// holds `quads` quads (quad g: elements 4g .. 4g + 3 of the row-major tensor), two where a block
// has two a lane or more: the block's own work (its maximum, its scale) is then shared by eight
// elements, not four. Lane `part` of a block holds its quads part and part + lanes, so that
// each of the warp's loads reads the first (or second) half of every block it takes, whole.
//
// Written for nvcc and for the host compiler: tests/cpp/row_blocks_schedule.cpp checks in CI,
// for every block width and a range of warps, that each quad is held once, by a lane of its
// block's aligned group (run by tests/test_scaled.py).
#pragma once
#include "lowfp/config.hpp"

namespace lowfp {

// The most quads a lane holds.
constexpr int kRowBlocksQuads = 2;

struct RowBlocksSchedule {
  int quads;     // quads a lane holds (1 or kRowBlocksQuads)
  int lanes;     // lanes a block: block_cols / (4 · quads)
  int per_warp;  // blocks a warp takes at a time: 32 / lanes
  int group;     // this lane's block among the warp's
  int part;      // this lane's place in its block's lanes

  // The schedule of lane `lane` (0 to 31) for blocks of block_cols elements (4 · 2^k, at most 128).
  LOWFP_HD RowBlocksSchedule(int64_t block_cols, int lane) {
    const int block_quads = int(block_cols / 4);
    quads = block_quads >= kRowBlocksQuads ? kRowBlocksQuads : 1;
    lanes = block_quads / quads;
    per_warp = 32 / lanes;
    group = lane / lanes;
    part = lane % lanes;
  }

  // The first block of the warp's turns, for warp `warp` of the grid, and the blocks between one
  // turn's first block and the next's, for `warps` warps in the grid.
  LOWFP_HD int64_t first_block(int64_t warp) const { return warp * per_warp; }
  LOWFP_HD int64_t stride(int64_t warps) const { return warps * per_warp; }

  // The block this lane takes in the turn starting at block b0.
  LOWFP_HD int64_t block(int64_t b0) const { return b0 + group; }

  // Quad q (0 <= q < quads) of block b that this lane holds.
  LOWFP_HD int64_t quad(int64_t b, int q) const { return (b * quads + q) * lanes + part; }
};

}  // namespace lowfp
