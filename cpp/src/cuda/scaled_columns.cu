// The one-pass kernel for blocks down the columns (a GEMM operand along its reduction axis;
// scaled_cuda.cu says which calls take it), in a file of its own: its instances compile beside
// the other kernels'.
#include "scaled_device.cuh"

namespace lowfp {
namespace {

// The one-pass form of blocks down the columns (block_cols 1: a GEMM operand along its reduction
// axis, scaled.config.kernel_layout): a thread per block, consecutive threads on consecutive
// columns (coalesced), reading its block_rows elements for the maximum and again (from cache)
// to round them. Template parameters: row_blocks_kernel's.
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, Carrier kCarrier, bool kFaster, bool kOnce,
          bool kFaster32>
__global__ void __launch_bounds__(kThreads)
column_blocks_kernel(ScaledCall c, const unsigned long long* tensor_max, unsigned long long* counts) {
  const int64_t blocks = c.block_grid_rows() * c.cols;
  OnePassThread<In> th(c, tensor_max);
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x)
    column_block<In, K, kCount, kPow2, kSubExp, kCarrier, kFaster, kOnce, kFaster32>(c, b, th.exponent, th.t, th.empty,
                                                                                    th.tc, th.saturated);
  th.template finish<kCount>(c, blocks, counts);
}

}  // namespace

void column_blocks_cuda(const ScaledCall& c, int grid, cudaStream_t stream, const unsigned long long* tensor_max,
                        unsigned long long* counts) {
  with_one_pass_kernel(c, [&](auto instance) {
    using I = decltype(instance);
    column_blocks_kernel<typename I::In, I::K, I::kCount, I::kPow2, I::kSubExp, I::kCarrier, I::kFaster, I::kOnce,
                         I::kFaster32><<<grid, kThreads, 0, stream>>>(c, tensor_max, counts);
  });
}

}  // namespace lowfp
