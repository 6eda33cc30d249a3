// The emulated-accumulation GEMM: each output element's sums by cpp/include/lowfp/accumulate.hpp
// as the CPU does, in the lane form the CPU takes for the call: nearest rounding by addition
// where AccumulateParams::by_addition holds, directed and stochastic rounding in the
// accumulator's direction where AccumulateParams::in_mode does (a few float64 additions per sum
// in place of round_bits' 64-bit integer steps; the CPU sets the floating-point unit's rounding
// mode, each CUDA addition names its direction: accumulate.hpp's Direction), else each sum
// rounded by its bits.
//
// The sequential and blocked orders without Kahan's corrections (the common requests) take
// tiles_kernel, accumulate_tiles.hpp's schedule of staged tiles (fused groups where they fit
// its chunks). The others take accumulate_kernel: one output element per thread, grid-stride,
// reading its row and column.
#include "accumulate_cuda.hpp"
#include "accumulate_tiles.hpp"
#include "common.cuh"
#include "dispatch.hpp"

namespace lowfp {
namespace {

template <RoundKind K, bool kSub, LaneForm kForm, Direction kDir = Direction::Fpu>
__global__ void __launch_bounds__(kThreads) accumulate_kernel(AccumulateCall c, unsigned long long* counts) {
  const int64_t total = c.batch * c.m * c.n;
  AccumulateCounts mine;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / c.n, j = e % c.n, batch = r / c.m, i = r % c.m;
    double sum[1];
    accumulate_lanes<K, kSub, 1, kForm, PhiloxLaneBlocks, kDir>(
        c.p, c.a + batch * c.a_batch + i * c.a_row, c.a_k, c.b + batch * c.b_batch + j * c.b_col, c.b_k, c.b_col,
        c.k, c.seed, c.offset, uint64_t(e), sum, mine);
    c.c[e] = stored_sum(sum[0]);
  }
  if (counts == nullptr) return;
  const int64_t values[5] = {mine.overflow, mine.underflow, mine.nan, mine.roundings, mine.swamped};
  for (int v = 0; v < 5; ++v) {
    const uint64_t sum = warp_sum(uint64_t(values[v]));
    if ((threadIdx.x & 31) == 0 && sum) atomicAdd(counts + v, (unsigned long long)sum);
  }
}

// A CUDA thread block as accumulate_tiles sees it.
template <int kCols, bool kGroups>
struct TileBlock {
  using Tile = AccumulateTile<kThreads, kCols, kGroups>;
  double (*a_chunk)[Tile::kChunk + 1];
  double (*b_chunk)[kCols];
  __device__ int thread() const { return int(threadIdx.x); }
  __device__ int64_t block() const { return blockIdx.x; }
  __device__ int64_t blocks() const { return gridDim.x; }
  __device__ void sync() const { __syncthreads(); }
};

// kCount: the call counts its roundings (where counts is not null). Without, every count is a
// dead store that the compiler drops from the step. kGroups: fused groups.
template <RoundKind K, bool kSub, LaneForm kForm, Direction kDir, int kCols, bool kCount, bool kGroups>
__global__ void __launch_bounds__(kThreads) tiles_kernel(AccumulateCall c, unsigned long long* counts) {
  using Tile = AccumulateTile<kThreads, kCols, kGroups>;
  __shared__ double a_chunk[Tile::kRows][Tile::kChunk + 1];
  __shared__ double b_chunk[Tile::kChunk][kCols];
  TileBlock<kCols, kGroups> blk{a_chunk, b_chunk};
  AccumulateCounts mine;
  accumulate_tiles<K, kSub, kForm, kDir, kThreads, kCols, kGroups>(c, blk, mine);
  if (!kCount || counts == nullptr) return;
  const int64_t values[5] = {mine.overflow, mine.underflow, mine.nan, mine.roundings, mine.swamped};
  for (int v = 0; v < 5; ++v) {
    const uint64_t sum = warp_sum(uint64_t(values[v]));
    if ((threadIdx.x & 31) == 0 && sum) atomicAdd(counts + v, (unsigned long long)sum);
  }
}

template <RoundKind K, bool kSub, LaneForm kForm, Direction kDir, int kCols, bool kGroups>
void launch_tiles(const AccumulateCall& c, unsigned long long* cnt, int device, cudaStream_t stream) {
  // (grid_size sizes a grid by elements, kThreads a block: here, by tiles)
  const int grid = grid_size(device, accumulate_tile_count<kThreads, kCols>(c) * kThreads);
  // (one-column tiles, a matrix times a few vectors, always count: a kernel fewer to build)
  if constexpr (kCols > 1) {
    if (cnt == nullptr) {
      tiles_kernel<K, kSub, kForm, kDir, kCols, false, kGroups><<<grid, kThreads, 0, stream>>>(c, cnt);
      return;
    }
  }
  tiles_kernel<K, kSub, kForm, kDir, kCols, true, kGroups><<<grid, kThreads, 0, stream>>>(c, cnt);
}

// The call's kernel for one lane form: tiles for the sequential and blocked orders without
// Kahan's corrections, one product at a time, or in fused groups that fit the staged chunks
// (accumulate_tile_groups; 32-column tiles only, a kernel fewer per form to build); else one
// element per thread.
template <RoundKind K, bool kSub, LaneForm kForm, Direction kDir = Direction::Fpu>
void launch(const AccumulateCall& c, unsigned long long* cnt, int device, cudaStream_t stream) {
  const bool tiled_order = (c.p.order == AccumulateOrder::Sequential || c.p.order == AccumulateOrder::Blocked) &&
                           !c.p.compensated;
  if (tiled_order && c.p.group == 0) {
    switch (accumulate_tile_columns(c.n)) {
      case 32: launch_tiles<K, kSub, kForm, kDir, 32, false>(c, cnt, device, stream); break;
      case 8: launch_tiles<K, kSub, kForm, kDir, 8, false>(c, cnt, device, stream); break;
      default: launch_tiles<K, kSub, kForm, kDir, 1, false>(c, cnt, device, stream); break;
    }
    return;
  }
  if constexpr (kForm != LaneForm::InMode) {  // (fused groups add exact products: never in the mode)
    if (tiled_order && accumulate_tile_groups(c.p) && accumulate_tile_columns(c.n) == 32) {
      launch_tiles<K, kSub, kForm, kDir, 32, true>(c, cnt, device, stream);
      return;
    }
  }
  accumulate_kernel<K, kSub, kForm, kDir><<<grid_size(device, c.batch * c.m * c.n), kThreads, 0, stream>>>(c, cnt);
}

}  // namespace

void accumulate_cuda(const AccumulateCall& c, int64_t* counts, int device, uintptr_t stream_handle) {
  const int64_t total = c.batch * c.m * c.n;
  if (total == 0) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto* cnt = reinterpret_cast<unsigned long long*>(counts);
  if (c.p.in_mode) {  // (in_mode_form: toward zero, up, down or stochastic)
    switch (c.p.mode) {
      case Rounding::Stochastic:
        launch<RoundKind::Stochastic, false, LaneForm::InMode, Direction::TowardZero>(c, cnt, device, stream);
        break;
      case Rounding::TowardZero:
        launch<RoundKind::TowardZero, false, LaneForm::InMode, Direction::TowardZero>(c, cnt, device, stream);
        break;
      case Rounding::Up:
        launch<RoundKind::Directed, false, LaneForm::InMode, Direction::Up>(c, cnt, device, stream);
        break;
      default:
        launch<RoundKind::Directed, false, LaneForm::InMode, Direction::Down>(c, cnt, device, stream);
        break;
    }
    check(cudaGetLastError(), "kernel launch");
    return;
  }
  with_round_kind(c.p.mode, [&](auto kind) {
    constexpr RoundKind K = decltype(kind)::value;
    if constexpr (K == RoundKind::Nearest) {
      if (c.p.by_addition) {  // (which nearest_by_addition holds only without subnormal exponents)
        launch<K, false, LaneForm::ByAddition>(c, cnt, device, stream);
        return;
      }
    }
    with_flag(c.p.acc.subnormal_exponent,
              [&](auto sub) { launch<K, decltype(sub)::value, LaneForm::Bits>(c, cnt, device, stream); });
  });
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
