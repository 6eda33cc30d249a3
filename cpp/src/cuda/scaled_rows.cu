// The one-pass kernel for 1-D blocks along the rows (MX, NVFP4; scaled_cuda.cu says which calls
// take it), in a file of its own: its instances compile beside the other kernels'.
#include "scaled_device.cuh"

namespace lowfp {
namespace {

// The one-pass form (row_blocks): blocks of c.block_cols consecutive elements, block b holding
// elements b · block_cols ... (row-major), each held by a group of lanes of a warp, a lane holding
// one or two of its quads (RowBlocksSchedule); quad g (elements 4g .. 4g + 3) takes Philox block
// offset + g. A warp takes per_warp blocks at a time (its loop bound the same for all its lanes,
// which all shuffle). kCarrier: where the elements are rounded; kFaster32: round_narrow's;
// kFaster, kOnce: round_scaled's.
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, Carrier kCarrier, bool kFaster, bool kOnce,
          bool kFaster32>
__global__ void __launch_bounds__(kThreads)
row_blocks_kernel(ScaledCall c, const unsigned long long* tensor_max, unsigned long long* counts) {
  const RowBlocksSchedule s(c.block_cols, int(threadIdx.x & 31));
  const int64_t blocks = c.rows * (c.cols / c.block_cols);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  OnePassThread<In> th(c, tensor_max);
  for (int64_t b0 = s.first_block((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32); b0 < blocks;
       b0 += s.stride(warps)) {
    const int64_t b = s.block(b0);
    const bool live = b < blocks;
    Quad<In> in[kRowBlocksQuads];
    const RawOf<In> m = row_blocks_load(c, s, b, live, th.exponent, in);
    const double a = raw_value<In>(group_max(m, s.lanes));
    if (live)
      row_blocks_round<In, K, kCount, kPow2, kSubExp, kCarrier, kFaster, kOnce, kFaster32>(
          c, s, b, in, a, th.t, th.empty, th.tc, th.saturated);
  }
  th.template finish<kCount>(c, blocks, counts);
}

}  // namespace

void row_blocks_cuda(const ScaledCall& c, int grid, cudaStream_t stream, const unsigned long long* tensor_max,
                     unsigned long long* counts) {
  with_one_pass_kernel(c, [&](auto instance) {
    using I = decltype(instance);
    row_blocks_kernel<typename I::In, I::K, I::kCount, I::kPow2, I::kSubExp, I::kCarrier, I::kFaster, I::kOnce,
                      I::kFaster32><<<grid, kThreads, 0, stream>>>(c, tensor_max, counts);
  });
}

}  // namespace lowfp
