// Device code shared by the scaled formats' CUDA files: scaled_cuda.cu (the driver and the
// three-pass form) and the one-pass kernels, each in a file of its own so that their many
// instances compile in parallel (scaled_rows.cu, scaled_columns.cu, scaled_tiles.cu). Maxima by
// shuffles and atomics, the tensor scale and the block counts; and the one-pass kernels'
// launchers.
#pragma once
#include <type_traits>

#include "common.cuh"
#include "dispatch.hpp"
#include "lowfp/scaled.hpp"
#include "scaled_call.hpp"
#include "scaled_one_pass.hpp"

namespace lowfp {
namespace {

// The largest of v over the `width` lanes of this lane's aligned group (width a power of two up
// to 32; every lane of the warp calls it).
template <class U>
__device__ U group_max(U v, int width) {
  using Shuffled = std::conditional_t<sizeof(U) == 8, unsigned long long, unsigned>;
  for (int o = width / 2; o > 0; o >>= 1) v = max_of(v, U(__shfl_xor_sync(0xffffffffu, Shuffled(v), o)));
  return v;
}

// a >= 0 into the maximum whose float64 bits *target holds (nonnegative doubles order as their
// bits), once per warp.
__device__ void warp_max_into(unsigned long long* target, double a) {
  const uint64_t m = group_max(bit_cast<uint64_t>(a), 32);
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(target, (unsigned long long)m);
}

// The largest of this thread block's values m (raw bits of nonnegative doubles), through
// `maxima` (one slot a warp); every thread calls it, thread 0 gets the answer. The caller
// synchronises before `maxima` is written again.
__device__ uint64_t thread_block_max(uint64_t m, uint64_t* maxima) {
  m = group_max(m, 32);
  if ((threadIdx.x & 31) == 0) maxima[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x != 0) return 0;
  for (int i = 0; i < kThreads / 32; ++i) m = max_of(m, maxima[i]);
  return m;
}

// The tensor scale from the tensor's largest magnitude (bits in *tensor_max), as scaled_cpu.
__device__ double tensor_scale_of(const ScaledCall& c, const unsigned long long* tensor_max) {
  if (tensor_max == nullptr) return 1.0;
  return tensor_scale(c.scale, bit_cast<double>(uint64_t(*tensor_max)));
}

// The block counts of a pass over the scales: its threads' saturated blocks, and all blocks once.
__device__ void count_blocks(const ScaledCall& c, uint64_t saturated, int64_t blocks, unsigned long long* counts) {
  if (counts == nullptr || !c.count_blocks) return;
  saturated = warp_sum(saturated);
  if ((threadIdx.x & 31) == 0 && saturated) atomicAdd(counts + 4, (unsigned long long)saturated);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counts + 5, (unsigned long long)blocks);
}

// What a thread of a one-pass kernel holds across its blocks: the input's exponent mask, the
// tensor scale t and an empty block's scale, its events and its saturated blocks.
template <class In>
struct OnePassThread {
  RawOf<In> exponent;
  double t, empty;
  ThreadCounts tc;
  uint64_t saturated = 0;

  __device__ OnePassThread(const ScaledCall& c, const unsigned long long* tensor_max)
      : exponent(RawOf<In>(exponent_mask(c.dtype))), t(tensor_scale_of(c, tensor_max)),
        empty(empty_block_scale(c.scale, t)) {}

  // The kernel's end: the events (kCount) and the block counts into the device counts.
  template <bool kCount>
  __device__ void finish(const ScaledCall& c, int64_t blocks, unsigned long long* counts) const {
    if constexpr (kCount) finish_counts(tc, counts, c.rows * c.cols);
    count_blocks(c, saturated, blocks, counts);
  }
};

// A one-pass kernel's template arguments, as with_one_pass_instance chooses them for a call.
template <class InType, RoundKind kKind, bool kCountV, bool kPow2V, bool kSubExpV, Carrier kCarrierV, bool kFasterV,
          bool kOnceV, bool kFaster32V>
struct OnePassInstance {
  using In = InType;
  static constexpr RoundKind K = kKind;
  static constexpr bool kCount = kCountV, kPow2 = kPow2V, kSubExp = kSubExpV, kFaster = kFasterV, kOnce = kOnceV,
                        kFaster32 = kFaster32V;
  static constexpr Carrier kCarrier = kCarrierV;
};

// fn(OnePassInstance<...>{}) for the instance a call takes (with_one_pass_instance).
template <class Fn>
void with_one_pass_kernel(const ScaledCall& c, Fn&& fn) {
  with_one_pass_instance(c, [&](auto type, auto kind, auto count, auto pow2, auto sub, auto carrier, auto faster,
                                auto once, auto faster32) {
    fn(OnePassInstance<typename decltype(type)::type, decltype(kind)::value, decltype(count)::value,
                       decltype(pow2)::value, decltype(sub)::value, decltype(carrier)::value, decltype(faster)::value,
                       decltype(once)::value, decltype(faster32)::value>{});
  });
}

}  // namespace

// The one-pass kernels' launchers: each enqueues its kernel's instance for call c on `stream`,
// `grid` thread blocks of kThreads. tensor_max: the tensor's largest magnitude, already reduced
// (null without a tensor scale); counts: the device counts buffer (or null).
void row_blocks_cuda(const ScaledCall& c, int grid, cudaStream_t stream, const unsigned long long* tensor_max,
                     unsigned long long* counts);
void column_blocks_cuda(const ScaledCall& c, int grid, cudaStream_t stream, const unsigned long long* tensor_max,
                        unsigned long long* counts);
// (no float64 inputs: tile_blocks never takes them)
void tile_blocks_cuda(const ScaledCall& c, int grid, cudaStream_t stream, const unsigned long long* tensor_max,
                      unsigned long long* counts);

}  // namespace lowfp
