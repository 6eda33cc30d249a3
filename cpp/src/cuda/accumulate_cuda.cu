// The emulated-accumulation GEMM: one thread per output element, grid-stride, each summing its
// row of A and column of B by cpp/include/lowfp/accumulate.hpp as the CPU does, in the lane form
// the CPU takes for the call: nearest rounding by addition where AccumulateParams::by_addition
// holds, directed and stochastic rounding in the accumulator's direction where
// AccumulateParams::in_mode does (a few float64 additions per sum in place of round_bits' 64-bit
// integer steps; the CPU sets the floating-point unit's rounding mode, each CUDA addition names
// its direction: accumulate.hpp's Direction), else each sum rounded by its bits.
#include "accumulate_cuda.hpp"
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

}  // namespace

void accumulate_cuda(const AccumulateCall& c, int64_t* counts, int device, uintptr_t stream_handle) {
  const int64_t total = c.batch * c.m * c.n;
  if (total == 0) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto* cnt = reinterpret_cast<unsigned long long*>(counts);
  const int grid = grid_size(device, total);
  if (c.p.in_mode) {  // (in_mode_form: toward zero, up, down or stochastic)
    switch (c.p.mode) {
      case Rounding::Stochastic:
        accumulate_kernel<RoundKind::Stochastic, false, LaneForm::InMode, Direction::TowardZero>
            <<<grid, kThreads, 0, stream>>>(c, cnt);
        break;
      case Rounding::TowardZero:
        accumulate_kernel<RoundKind::TowardZero, false, LaneForm::InMode, Direction::TowardZero>
            <<<grid, kThreads, 0, stream>>>(c, cnt);
        break;
      case Rounding::Up:
        accumulate_kernel<RoundKind::Directed, false, LaneForm::InMode, Direction::Up>
            <<<grid, kThreads, 0, stream>>>(c, cnt);
        break;
      default:
        accumulate_kernel<RoundKind::Directed, false, LaneForm::InMode, Direction::Down>
            <<<grid, kThreads, 0, stream>>>(c, cnt);
        break;
    }
    check(cudaGetLastError(), "kernel launch");
    return;
  }
  with_round_kind(c.p.mode, [&](auto kind) {
    constexpr RoundKind K = decltype(kind)::value;
    if constexpr (K == RoundKind::Nearest) {
      if (c.p.by_addition) {  // (which nearest_by_addition holds only without subnormal exponents)
        accumulate_kernel<K, false, LaneForm::ByAddition><<<grid, kThreads, 0, stream>>>(c, cnt);
        return;
      }
    }
    with_flag(c.p.acc.subnormal_exponent, [&](auto sub) {
      accumulate_kernel<K, decltype(sub)::value, LaneForm::Bits><<<grid, kThreads, 0, stream>>>(c, cnt);
    });
  });
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
