// Pieces shared by the CUDA drivers: vector access to groups of four elements, per-thread event
// counts reduced per warp into the device counts buffer, launch sizing, device selection.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "element_groups.hpp"
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

// This thread's groups of four elements, grid-stride (element_groups.hpp's
// transform_thread_groups at the thread's place in the grid).
template <class In, class Out, class Fn>
__device__ void transform_groups(const In* x, Out* y, int64_t n, bool quad_io, Fn&& fn) {
  transform_thread_groups(x, y, n, quad_io, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                          int64_t(gridDim.x) * blockDim.x, fn);
}

// The end of a counting kernel: this thread's events, and numel once per launch.
__device__ void finish_counts(const ThreadCounts& c, unsigned long long* counts, int64_t n) {
  flush_counts(c, counts);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counts + 3, (unsigned long long)n);
}

// An element-wise rounding (element_groups.hpp's round_thread_groups at this thread's place in
// the grid), its events counted into counts (device int64[4]) when kCount.
template <RoundKind K, bool kCount, class In, class Out, class Fn>
__device__ void round_elements(const In* x, Out* y, int64_t n, bool quad_io, uint64_t seed, uint64_t offset,
                               unsigned long long* counts, Fn&& element) {
  ThreadCounts tc;
  round_thread_groups<K, kCount>(x, y, n, quad_io, seed, offset, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                                 int64_t(gridDim.x) * blockDim.x, tc, element);
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
