// S2FP8 on the GPU (DESIGN §4): a reduction kernel, a one-thread kernel turning the sums into
// alpha, beta, mu, m, and the element kernel, all enqueued on one stream with no host sync. The
// math is cpp/include/lowfp/s2fp8.hpp's; the reduction is made of integer sums and a max, so its
// result does not depend on how the work is split and equals the CPU's bit for bit.
#include "common.cuh"
#include "dispatch.hpp"
#include "lowfp/philox.hpp"
#include "lowfp/s2fp8.hpp"
#include "quantize_cuda.hpp"

namespace lowfp {
namespace {

// One warp per reduction group (s2fp8.hpp): lane l loads quad 32 g + l, elements 4l..4l+3 of
// the group, which are factor row l / 2 of product lanes 4 (l % 2) + k. Rows 2s and 2s+1 then sit
// in warp lanes l and l ^ 2, and the tree's later levels in l ^ 4, l ^ 8, l ^ 16.
template <class T>
__global__ void __launch_bounds__(kThreads)
s2fp8_reduce_kernel(const T* x, int64_t n, bool quad_io, unsigned long long* sums) {
  static_assert(kS2fp8Group == 32 * 4 && kS2fp8Lanes == 8, "a group is one warp's quads");
  constexpr bool kSubnormal = std::is_same_v<T, double>;
  S2fp8Partial part;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t groups = (n + kS2fp8Group - 1) / kS2fp8Group, full_quads = quad_io ? n / 4 : 0;
  for (int64_t g = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; g < groups; g += warps) {
    const Quad<T> in = load_group(x, 32 * g + lane, n, full_quads);
    double f[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // padding elements of the last group are +0: the factor 1
      const uint64_t a = Widen<uint64_t>::from(in.v[k]) & ~kF64SignBit;
      const bool use = finite_nonzero_abs(a);
      const S2fp8Factor factor = s2fp8_factor<kSubnormal>(a);
      f[k] = factor.f;
      part.exp_sum += factor.e;
      part.count += int64_t(use);
      part.max_abs = max_of(part.max_abs, use ? a : uint64_t(0));
    }
#pragma unroll
    for (int mask = 2; mask < 32; mask <<= 1)
#pragma unroll
      for (int k = 0; k < 4; ++k) f[k] *= __shfl_xor_sync(0xffffffffu, f[k], mask);
    if (lane < 2) {
#pragma unroll
      for (int k = 0; k < 4; ++k) part.low += s2fp8_fixed_log(f[k]);
      part.carry();
    }
  }
  // Warp sums: high, count and exp_sum as two's-complement adds, low < 2^32 per thread, max of bits.
  uint64_t high = uint64_t(part.high), low = part.low, count = uint64_t(part.count);
  uint64_t exp_sum = uint64_t(part.exp_sum), max_abs = part.max_abs;
  for (int offset = 16; offset > 0; offset >>= 1) {
    high += __shfl_down_sync(0xffffffffu, high, offset);
    low += __shfl_down_sync(0xffffffffu, low, offset);
    count += __shfl_down_sync(0xffffffffu, count, offset);
    exp_sum += __shfl_down_sync(0xffffffffu, exp_sum, offset);
    max_abs = max_of<uint64_t>(max_abs, __shfl_down_sync(0xffffffffu, max_abs, offset));
  }
  if (lane == 0 && count != 0) {
    high += low >> 32;  // the warp's low below 2^32, so the global low sum cannot overflow
    low &= 0xFFFFFFFFull;
    atomicAdd(sums + kSumLogHigh, (unsigned long long)high);
    atomicAdd(sums + kSumLogLow, (unsigned long long)low);
    atomicAdd(sums + kSumCount, (unsigned long long)count);
    atomicAdd(sums + kSumExp, (unsigned long long)exp_sum);
    atomicMax(sums + kSumMaxAbs, (unsigned long long)max_abs);
  }
}

__global__ void s2fp8_stats_kernel(int64_t* sums, double log_max, double* params) {
  // The warps' low words were added without carries: leave the sums in the CPU's form (low < 2^32).
  const uint64_t low = uint64_t(sums[kSumLogLow]);
  sums[kSumLogHigh] += int64_t(low >> 32);
  sums[kSumLogLow] = int64_t(low & 0xFFFFFFFFull);
  const S2fp8Stats s = s2fp8_stats(sums, log_max);
  params[kAlpha] = s.alpha;
  params[kBeta] = s.beta;
  params[kMu] = s.mu;
  params[kMax] = s.m;
}

// x and y may alias (in place): each element is read by the thread that writes it.
template <class T, RoundKind K, bool kCount, bool kSubExp>
__global__ void __launch_bounds__(kThreads)
s2fp8_transform_kernel(const T* x, T* y, int64_t n, bool quad_io, const double* params,
                       RoundParams<uint64_t> p, RoundParams<uint64_t> p_store, uint64_t seed,
                       uint64_t offset, unsigned long long* counts) {
  const S2fp8Stats s{params[kAlpha], params[kBeta], params[kMu], params[kMax]};
  const double inv_alpha = 1.0 / s.alpha;
  ThreadCounts tc;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t groups = (n + 3) / 4, full_groups = quad_io ? n / 4 : 0;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const Quad<T> in = load_group(x, g, n, full_groups);
    Philox4x32Block r = {{0u, 0u, 0u, 0u}};
    if constexpr (K == RoundKind::Stochastic) r = philox_block(seed, offset + uint64_t(g));
    Quad<T> out;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      RoundEvents ev;
      const uint64_t v =
          s2fp8_element<K, kSubExp>(Widen<uint64_t>::from(in.v[k]), s, inv_alpha, p, r.w[k], ev);
      out.v[k] = s2fp8_store<T>(v, p_store);
      if (kCount && 4 * g + k < n) tc.add(ev);
    }
    store_group(y, g, n, full_groups, out);
  }
  if constexpr (kCount) finish_counts(tc, counts, n);
}

}  // namespace

void s2fp8_cuda(const S2fp8Call& c, int64_t* sums, double* params, int64_t* counts, int device,
                uintptr_t stream_handle) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto* sums_u = reinterpret_cast<unsigned long long*>(sums);
  check(cudaMemsetAsync(sums, 0, kSumSize * sizeof(int64_t), stream), "cudaMemsetAsync");
  const int grid = grid_size(device, max_of<int64_t>((c.q.n + 3) / 4, 1));  // a thread per quad
  dispatch_s2fp8(c.q, [&](auto in, auto, auto, auto kind, auto count, auto sub_exp) {
    using T = typename decltype(in)::type;
    const T* x = static_cast<const T*>(c.q.x);
    T* y = static_cast<T*>(c.q.y);
    const bool quad_io = quad_aligned<T>(x) && quad_aligned<T>(y);
    if (c.q.n > 0) s2fp8_reduce_kernel<T><<<grid, kThreads, 0, stream>>>(x, c.q.n, quad_io, sums_u);
    s2fp8_stats_kernel<<<1, 1, 0, stream>>>(sums, c.log_max, params);
    if (c.q.n > 0)
      s2fp8_transform_kernel<T, decltype(kind)::value, decltype(count)::value,
                             decltype(sub_exp)::value><<<grid, kThreads, 0, stream>>>(
          x, y, c.q.n, quad_io, params, c.q.p64, c.p_store, c.q.seed, c.q.offset,
          reinterpret_cast<unsigned long long*>(counts));
  });
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
