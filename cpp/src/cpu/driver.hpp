// What the CPU drivers (*_cpu.cpp) share: the kernels of the instruction-set level this CPU runs,
// the thread count, and the ways of splitting a call over threads.
#pragma once
#include <omp.h>

#include <cstdint>
#include <vector>

#include "kernels.hpp"

namespace lowfp {

// One level's kernels (kernels.hpp).
struct Kernel {
  void (*quantize)(const QuantizeCall&, int64_t, int64_t, EventCounts&);
  void (*s2fp8_reduce)(const S2fp8Call&, int64_t, int64_t, S2fp8Partial&);
  void (*s2fp8_transform)(const S2fp8Call&, const S2fp8Stats&, const S2fp8Forms&, int64_t, int64_t,
                          EventCounts&);
  void (*extra_bits_step)(const ExtraBitsStep&, int64_t, int64_t, int64_t, EventCounts&);
  void (*extra_bits_split)(const ExtraBitsParams&, Rounding, const ExtraBitsSplit&, int64_t, int64_t,
                           EventCounts&);
  void (*extra_bits_merge)(const ExtraBitsParams&, const ExtraBitsMerge&, int64_t, int64_t);
  bool (*any_non_finite)(DType, const void*, int64_t, int64_t);
  double (*scaled_amax)(const ScaledCall&, int64_t, int64_t);
  void (*scaled_scales)(const ScaledCall&, double, int64_t, int64_t, int64_t&);
  void (*scaled_elements)(const ScaledCall&, const ScaledCpuForms&, const ScaledPlan&, int64_t, int64_t,
                          EventCounts&);
  void (*accumulate)(const AccumulateCall&, int64_t, int64_t, AccumulateCounts&);
  const char* name;
};

// The best level this CPU runs, or the one LOWFP_CPU_KERNEL names (tests compare them all);
// chosen at the first call.
const Kernel& kernel();
const char* cpu_kernel_name();

// lowfp.set_num_threads (0: the default below).
void set_num_threads(int n);
// The thread count when set_num_threads has none (torch's, from the Python layer; 0: every core).
void set_default_threads(int n);
int get_num_threads();

// Threads worth starting for n elements: at most get_num_threads(), and at least kMinPerThread
// elements each (below that, starting threads costs more than it saves). Per-thread outputs are
// sized by it too, so a large set_num_threads costs nothing.
constexpr int64_t kMinPerThread = 1 << 13;
int threads_for(int64_t n);

// Runs fn(thread, begin, end) over contiguous ranges of whole tiles (so every range starts on a
// Philox block boundary) on as many threads as the size is worth; returns the thread count.
template <class Fn>
int parallel_tiles(int64_t n, Fn&& fn) {
  const int threads = threads_for(n);
  if (threads <= 1) {
    fn(0, int64_t(0), n);
    return 1;
  }
  const int64_t tiles = (n + kTile - 1) / kTile;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const int64_t begin = tiles * t / nt * kTile, end = min_of(tiles * (t + 1) / nt * kTile, n);
    if (begin < end) fn(t, begin, end);
  }
  return threads;
}

// fn(thread, begin, end) over contiguous ranges of [0, n) items (rows, block rows, blocks of 32
// elements), on as many threads as `elements` (what the items hold) is worth. Results that depend
// on an element's index only (Philox offsets follow it) do not change with the split.
template <class Fn>
int parallel_items(int64_t n, int64_t elements, Fn&& fn) {
  const int threads = int(min_of<int64_t>(threads_for(elements), max_of<int64_t>(n, 1)));
  if (threads <= 1) {
    fn(0, int64_t(0), n);
    return 1;
  }
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t b0 = n * t / nt, b1 = n * (t + 1) / nt;
    if (b0 < b1) fn(t, b0, b1);
  }
  return threads;
}

// Per-thread outputs, each on a cache line of its own, so that kernels adding to theirs as they
// go (per chunk, say) never write a line another thread writes.
template <class T>
struct alignas(64) Slot {
  T v;
};
template <class T>
using PerThread = std::vector<Slot<T>>;

EventCounts sum(const PerThread<EventCounts>& parts);

// Adds {overflow, underflow, nan} and n to a counts buffer (int64[4]; nothing when null).
void add_counts(const EventCounts& c, int64_t n, int64_t* counts);

}  // namespace lowfp
