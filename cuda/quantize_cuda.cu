// The quantize kernel: the shared element math of cpp/include/lowfp/ in a grid-stride loop.
// Deterministic modes give each thread one element per step (coalesced); stochastic rounding gives
// each thread one Philox block, i.e. the four consecutive elements that share it, so every random
// word is drawn once. Counts are reduced per warp and added to the device buffer with atomics.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "dispatch.hpp"
#include "lowfp/philox.hpp"
#include "quantize_cuda.hpp"

namespace lowfp {
namespace {

constexpr int kThreads = 256;

struct ThreadCounts {
  uint32_t overflow = 0, underflow = 0, nan = 0;
  __device__ void add(const RoundEvents& ev) {
    overflow += ev.overflow();
    underflow += ev.underflow;
    nan += ev.nan;
  }
};

__device__ uint64_t warp_sum(uint64_t v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

__device__ void flush_counts(const ThreadCounts& c, unsigned long long* counts) {
  // Per-thread counts are < 2^32 (grid-stride steps per thread are far fewer), warp sums fit int64.
  const uint64_t o = warp_sum(c.overflow), u = warp_sum(c.underflow), n = warp_sum(c.nan);
  if ((threadIdx.x & 31) == 0) {
    if (o) atomicAdd(counts + 0, (unsigned long long)o);
    if (u) atomicAdd(counts + 1, (unsigned long long)u);
    if (n) atomicAdd(counts + 2, (unsigned long long)n);
  }
}

// x and y are not __restrict__: quantize_(x) and out=x pass the same buffer (each element is read
// by the thread that writes it, before it writes it).
template <class In, class Out, class Bits, RoundKind K, bool kCount, bool kSubExp>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const In* x, Out* y, int64_t n, RoundParams<Bits> p,
                uint64_t seed, uint64_t offset, unsigned long long* counts) {
  ThreadCounts tc;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (K == RoundKind::Stochastic) {
    for (int64_t g = first; g < (n + 3) / 4; g += stride) {
      const Philox4x32Block r = philox_block(seed, offset + uint64_t(g));
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t i = 4 * g + k;
        if (i < n) {
          RoundEvents ev;
          y[i] = Store<Out>::from(round_bits<K, Bits, kSubExp>(Widen<Bits>::from(x[i]), p, r.w[k], ev));
          if (kCount) tc.add(ev);
        }
      }
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      RoundEvents ev;
      y[i] = Store<Out>::from(round_bits<K, Bits, kSubExp>(Widen<Bits>::from(x[i]), p, 0u, ev));
      if (kCount) tc.add(ev);
    }
  }
  if constexpr (kCount) {
    flush_counts(tc, counts);
    if (first == 0) atomicAdd(counts + 3, (unsigned long long)n);
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("lowfp CUDA: ") + what + ": " + cudaGetErrorString(err));
}

// Enough blocks to fill the device several times over; the grid-stride loop covers the rest.
int grid_size(int device, int64_t work) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device query");
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return int(min_of<int64_t>(wanted, int64_t(sms) * 16));
}

}  // namespace

void quantize_cuda(const QuantizeCall& c, int64_t* counts, int device, uintptr_t stream_handle) {
  if (c.n == 0) return;
  int previous = -1;
  check(cudaGetDevice(&previous), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice");
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  dispatch_quantize(c, [&](auto in, auto out, auto bits, auto kind, auto count, auto sub_exp) {
    using In = typename decltype(in)::type;
    using Out = typename decltype(out)::type;
    using Bits = typename decltype(bits)::type;
    constexpr RoundKind K = decltype(kind)::value;
    const int64_t work = K == RoundKind::Stochastic ? (c.n + 3) / 4 : c.n;
    quantize_kernel<In, Out, Bits, K, decltype(count)::value, decltype(sub_exp)::value>
        <<<grid_size(device, work), kThreads, 0, stream>>>(
            static_cast<const In*>(c.x), static_cast<Out*>(c.y), c.n, round_params<Bits>(c), c.seed,
            c.offset, reinterpret_cast<unsigned long long*>(counts));
  });
  const cudaError_t launch = cudaGetLastError();
  cudaSetDevice(previous);
  check(launch, "kernel launch");
}

}  // namespace lowfp
