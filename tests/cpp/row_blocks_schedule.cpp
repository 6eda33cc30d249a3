// The one-pass kernel's schedule for 1-D blocks along the rows (cpp/src/cuda/row_blocks_schedule.hpp)
// followed on the CPU, lane by lane, through row_blocks_kernel's loop, for every block width and
// grids of one warp to more warps than blocks. Checked: every quad of the tensor is held by
// exactly one lane in one turn; that lane's block is the quad's; the lanes of a block are the
// aligned group of `lanes` lanes that group_max's shuffles reduce over (so its maximum is the
// block's); all lanes of a warp take the same turns (they all shuffle); each of a block's loads
// reads a run of consecutive quads. Built and run by tests/test_scaled.py; prints one line per
// failure and exits 1 if any.
#include <cstdio>
#include <vector>

#include "row_blocks_schedule.hpp"

namespace {

using namespace lowfp;

int failures = 0;

void fail(const char* what, int64_t w, int64_t blocks, int64_t warps, int64_t at) {
  if (++failures <= 20)
    std::printf("block_cols %lld, %lld blocks, %lld warps: %s (at %lld)\n", (long long)w, (long long)blocks,
                (long long)warps, what, (long long)at);
}

void check(int64_t w, int64_t blocks, int64_t warps) {
  const int64_t block_quads = w / 4, quads_total = blocks * block_quads;
  std::vector<int> held(quads_total, 0);
  for (int64_t warp = 0; warp < warps; ++warp) {
    const RowBlocksSchedule first(w, 0);
    if (first.lanes < 1 || 32 % first.lanes != 0 || (first.lanes & (first.lanes - 1)) != 0)
      fail("lanes a block is not a power of two dividing 32", w, blocks, warps, first.lanes);
    if (first.lanes * first.quads != block_quads) fail("a block's lanes do not hold it", w, blocks, warps, 0);
    for (int64_t b0 = first.first_block(warp); b0 < blocks; b0 += first.stride(warps)) {  // (a warp's turns)
      std::vector<int64_t> block_of_lane(32);
      for (int lane = 0; lane < 32; ++lane) {
        const RowBlocksSchedule s(w, lane);
        if (s.first_block(warp) != first.first_block(warp) || s.stride(warps) != first.stride(warps))
          fail("a warp's lanes take different turns", w, blocks, warps, lane);
        const int64_t b = s.block(b0);
        block_of_lane[lane] = b;
        if (b >= blocks) continue;
        for (int q = 0; q < s.quads; ++q) {
          const int64_t g = s.quad(b, q);
          if (g < 0 || g >= quads_total || g / block_quads != b) {
            fail("a lane holds a quad of another block", w, blocks, warps, g);
            continue;
          }
          ++held[g];
        }
        // each load (one q over a block's lanes) reads a run of consecutive quads
        if (s.part == 0)
          for (int q = 0; q < s.quads; ++q)
            for (int p = 1; p < s.lanes; ++p)
              if (RowBlocksSchedule(w, lane + p).quad(b, q) != s.quad(b, q) + p)
                fail("a load's quads are not consecutive", w, blocks, warps, b);
      }
      // group_max(m, lanes) reduces over lanes (lane & ~(lanes - 1)) ... + lanes - 1
      for (int lane = 0; lane < 32; ++lane) {
        const int lanes = first.lanes, base = lane & ~(lanes - 1);
        for (int other = base; other < base + lanes; ++other)
          if (block_of_lane[other] != block_of_lane[lane]) fail("a shuffle group spans two blocks", w, blocks, warps, lane);
        for (int other = 0; other < 32; ++other)
          if ((other < base || other >= base + lanes) && block_of_lane[other] == block_of_lane[lane])
            fail("a block's lanes are not one shuffle group", w, blocks, warps, lane);
      }
    }
  }
  for (int64_t g = 0; g < quads_total; ++g)
    if (held[g] != 1) fail(held[g] == 0 ? "a quad is held by no lane" : "a quad is held twice", w, blocks, warps, g);
}

}  // namespace

int main() {
  int cases = 0;
  for (int64_t w = 4; w <= 128; w *= 2)
    for (int64_t blocks : {1, 2, 3, 7, 8, 31, 33, 64, 100, 257})
      for (int64_t warps : {1, 2, 3, 8, 9, 40, 300}) {
        check(w, blocks, warps);
        ++cases;
      }
  std::printf("%d failures in %d cases\n", failures, cases);
  return failures == 0 ? 0 : 1;
}
