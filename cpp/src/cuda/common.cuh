// Pieces shared by the CUDA drivers: vector access to groups of four elements, per-thread event
// counts reduced per warp into the device counts buffer, launch sizing, device selection.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "lowfp/philox.hpp"
#include "lowfp/round.hpp"
#include "thread_values.hpp"

namespace lowfp {
namespace {

constexpr int kThreads = 256;

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

template <class T> bool quad_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(Quad<T>) == 0;
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

// Group g of four elements: one vector access when it lies in the first full_groups (the caller
// checked alignment), else element by element up to n (the padding of a last group reads as 0).
template <class T>
__device__ Quad<T> load_group(const T* x, int64_t g, int64_t n, int64_t full_groups) {
  Quad<T> in = {};
  if (g < full_groups) {
    in = reinterpret_cast<const Quad<T>*>(x)[g];
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (4 * g + k < n) in.v[k] = x[4 * g + k];
  }
  return in;
}

template <class T>
__device__ void store_group(T* y, int64_t g, int64_t n, int64_t full_groups, const Quad<T>& out) {
  if (g < full_groups) {
    reinterpret_cast<Quad<T>*>(y)[g] = out;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (4 * g + k < n) y[4 * g + k] = out.v[k];
  }
}

// This thread's groups of four elements, grid-stride: y's group g = fn(g, x's group g), read
// and written as whole quads in the first n / 4 groups when quad_io (the caller checked
// alignment). x and y may be the same buffer: each group is read before it is written.
// A thread loads kInFlight groups (g, g + stride, ...) before it transforms them: 16-bit inputs
// take two, so that each thread has as many bytes of loads in flight (16) as a float32 quad.
template <class In, class Out, class Fn>
__device__ void transform_groups(const In* x, Out* y, int64_t n, bool quad_io, Fn&& fn) {
  constexpr int kInFlight = sizeof(In) == 2 ? 2 : 1;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t groups = (n + 3) / 4, full_groups = quad_io ? n / 4 : 0;
  for (int64_t g0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g0 < groups; g0 += kInFlight * stride) {
    Quad<In> in[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (g0 + j * stride < groups) in[j] = load_group(x, g0 + j * stride, n, full_groups);
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (g0 + j * stride < groups) store_group(y, g0 + j * stride, n, full_groups, fn(g0 + j * stride, in[j]));
  }
}

// The end of a counting kernel: this thread's events, and numel once per launch.
__device__ void finish_counts(const ThreadCounts& c, unsigned long long* counts, int64_t n) {
  flush_counts(c, counts);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counts + 3, (unsigned long long)n);
}

// An element-wise rounding over transform_groups: y[i] = element(x[i], word, ev), word element
// i's Philox word (group g's four from block offset + g, docs/design.md §3) for stochastic
// rounding K, else 0; its events ev counted into counts (device int64[4]) when kCount.
template <RoundKind K, bool kCount, class In, class Out, class Fn>
__device__ void round_elements(const In* x, Out* y, int64_t n, bool quad_io, uint64_t seed, uint64_t offset,
                               unsigned long long* counts, Fn&& element) {
  ThreadCounts tc;
  transform_groups(x, y, n, quad_io, [&](int64_t g, const Quad<In>& in) {
    Philox4x32Block r = {{0u, 0u, 0u, 0u}};
    if constexpr (K == RoundKind::Stochastic) r = philox_block(seed, offset + uint64_t(g));
    Quad<Out> out;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      RoundEvents ev;
      out.v[k] = element(in.v[k], r.w[k], ev);
      if (kCount && 4 * g + k < n) tc.add(ev);
    }
    return out;
  });
  if constexpr (kCount) finish_counts(tc, counts, n);
}

// Makes `device` current for the lifetime of the guard (launches go to the tensor's device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace
}  // namespace lowfp
