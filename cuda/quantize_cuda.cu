// The quantize kernel: the shared element math of cpp/include/lowfp/ in a grid-stride loop over
// groups of four elements (vector loads and stores; one Philox block per group when rounding
// stochastically). Counts are reduced per warp and added to the device buffer with atomics.
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

// Four consecutive elements, loaded or stored with one vector access (16 bytes for float32 in and
// out; two accesses for float64). Four because a Philox block holds four random words.
template <class T> struct alignas(4 * sizeof(T) > 16 ? 16 : 4 * sizeof(T)) Quad { T v[4]; };

template <class T> bool quad_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(Quad<T>) == 0;
}

// Each thread takes one group of four consecutive elements per grid-stride step. Stochastic
// rounding draws group g's four words from Philox block offset + g (DESIGN §3), so every word is
// drawn once. (Loading two or four groups before rounding them measured no faster on an H100.)
// x and y are not __restrict__: quantize_(x) and out=x pass the same buffer (each element is read
// by the thread that writes it, before it writes it).
template <class In, class Out, class Bits, RoundKind K, bool kCount, bool kSubExp>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const In* x, Out* y, int64_t n, RoundParams<Bits> p, uint64_t seed,
                uint64_t offset, unsigned long long* counts, bool quad_io) {
  ThreadCounts tc;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t groups = (n + 3) / 4;
  const int64_t full_groups = quad_io ? n / 4 : 0;  // groups read and written as one Quad
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    Quad<In> in = {};
    if (g < full_groups) {
      in = reinterpret_cast<const Quad<In>*>(x)[g];
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (4 * g + k < n) in.v[k] = x[4 * g + k];
    }
    Philox4x32Block r = {{0u, 0u, 0u, 0u}};
    if constexpr (K == RoundKind::Stochastic) r = philox_block(seed, offset + uint64_t(g));
    Quad<Out> out;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      RoundEvents ev;
      out.v[k] = Store<Out>::from(
          round_bits<K, Bits, kSubExp>(Widen<Bits>::from(in.v[k]), p, r.w[k], ev));
      if (kCount && 4 * g + k < n) tc.add(ev);
    }
    if (g < full_groups) {
      reinterpret_cast<Quad<Out>*>(y)[g] = out;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (4 * g + k < n) y[4 * g + k] = out.v[k];
    }
  }
  if constexpr (kCount) {
    flush_counts(tc, counts);
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counts + 3, (unsigned long long)n);
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
    const bool quad_io = quad_aligned<In>(c.x) && quad_aligned<Out>(c.y);
    quantize_kernel<In, Out, Bits, K, decltype(count)::value, decltype(sub_exp)::value>
        <<<grid_size(device, (c.n + 3) / 4), kThreads, 0, stream>>>(
            static_cast<const In*>(c.x), static_cast<Out*>(c.y), c.n, round_params<Bits>(c), c.seed,
            c.offset, reinterpret_cast<unsigned long long*>(counts), quad_io);
  });
  const cudaError_t launch = cudaGetLastError();
  cudaSetDevice(previous);
  check(launch, "kernel launch");
}

}  // namespace lowfp
