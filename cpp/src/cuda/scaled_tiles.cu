// The one-pass kernel for blocks of kThreads to kTileMost elements (a row's scale, 128 × 128
// tiles; scaled_cuda.cu says which calls take it), in a file of its own: its instances compile
// beside the other kernels'.
#include "scaled_device.cuh"

namespace lowfp {
namespace {

// The one-pass form of blocks of kThreads to kTileMost elements (a row's scale, 128 × 128 tiles:
// tile_blocks): a thread block per block (grid-stride over the blocks) reads the block for its
// largest magnitude (BlockShare over its quads: coalesced vector loads), takes its scale, and
// rounds the block's elements, read again (from the L2 cache where it holds the block), a Philox
// block a quad. Template parameters: row_blocks_kernel's.
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, Carrier kCarrier, bool kFaster, bool kOnce,
          bool kFaster32>
__global__ void __launch_bounds__(kThreads)
tile_blocks_kernel(ScaledCall c, const unsigned long long* tensor_max, unsigned long long* counts) {
  const int64_t blocks = c.block_grid_rows() * c.block_grid_cols();
  OnePassThread<In> th(c, tensor_max);
  __shared__ uint64_t warp_maxima[kThreads / 32];
  __shared__ BlockForms block_f;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const ScaledBlock at = c.block(b);
    const BlockShare share(at.w / 4, threadIdx.x, blockDim.x);
    const RawOf<In> m = tile_block_max<In>(c, at, share, th.exponent);
    const uint64_t bm = thread_block_max(bit_cast<uint64_t>(raw_value<In>(m)), warp_maxima);
    if (threadIdx.x == 0) {
      bool sat = false;
      block_f = block_forms<kCarrier, kPow2>(c, bit_cast<double>(bm), th.t, th.empty, sat);
      c.scales[b] = block_f.s;
      th.saturated += sat;
    }
    __syncthreads();
    const BlockForms f = block_f;  // (in registers, not read from shared memory for each element)
    tile_block_round<In, K, kCount, kPow2, kSubExp, kCarrier, kFaster, kOnce, kFaster32>(c, at, share, f, th.tc);
    __syncthreads();  // (before block_f and warp_maxima are written again)
  }
  th.template finish<kCount>(c, blocks, counts);
}

}  // namespace

void tile_blocks_cuda(const ScaledCall& c, int grid, cudaStream_t stream, const unsigned long long* tensor_max,
                      unsigned long long* counts) {
  with_one_pass_kernel(c, [&](auto instance) {
    using I = decltype(instance);
    if constexpr (!std::is_same_v<typename I::In, double>)
      tile_blocks_kernel<typename I::In, I::K, I::kCount, I::kPow2, I::kSubExp, I::kCarrier, I::kFaster, I::kOnce,
                         I::kFaster32><<<grid, kThreads, 0, stream>>>(c, tensor_max, counts);
  });
}

}  // namespace lowfp
