#include "driver.hpp"

#include <cstdlib>
#include <cstring>
#include <thread>

namespace lowfp {
namespace {

#define LOWFP_KERNEL(ns, name)                                                     \
  {                                                                                \
    ns::quantize_range, ns::s2fp8_reduce_range, ns::s2fp8_transform_range,         \
        ns::extra_bits_step_range, ns::extra_bits_split_range, ns::extra_bits_merge_range, \
        ns::any_non_finite_range, ns::scaled_amax_range, ns::scaled_scales_range,         \
        ns::scaled_elements_range, ns::accumulate_range, name                            \
  }

bool cpu_has(const char* level) {
#if defined(__x86_64__) && defined(LOWFP_MULTI_ISA)
  __builtin_cpu_init();
  if (std::strcmp(level, "avx512") == 0) return __builtin_cpu_supports("x86-64-v4");
  if (std::strcmp(level, "avx2") == 0) return __builtin_cpu_supports("x86-64-v3");
#endif
  return std::strcmp(level, "baseline") == 0;
}

Kernel pick_kernel() {
  const Kernel all[] = {
#if defined(LOWFP_MULTI_ISA)
      LOWFP_KERNEL(isa_avx512, "avx512"),
      LOWFP_KERNEL(isa_avx2, "avx2"),
#endif
      LOWFP_KERNEL(isa_baseline, "baseline"),
  };
  const char* want = std::getenv("LOWFP_CPU_KERNEL");
  for (const Kernel& k : all)
    if (cpu_has(k.name) && (want == nullptr || *want == '\0' || std::strcmp(want, k.name) == 0))
      return k;
  return all[sizeof(all) / sizeof(all[0]) - 1];
}

int g_num_threads = 0;      // lowfp.set_num_threads; 0: the default below
int g_default_threads = 0;  // torch's thread count, handed over by the Python layer; 0: every core

}  // namespace

const Kernel& kernel() {
  static const Kernel k = pick_kernel();
  return k;
}

const char* cpu_kernel_name() { return kernel().name; }

void set_num_threads(int n) { g_num_threads = n > 0 ? n : 0; }

void set_default_threads(int n) { g_default_threads = n > 0 ? n : 0; }

int get_num_threads() {
  if (g_num_threads > 0) return g_num_threads;
  if (g_default_threads > 0) return g_default_threads;
  // Read once: hardware_concurrency() reads /sys on Linux, and every call asks.
  static const int cores = [] {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw > 0 ? int(hw) : 1;
  }();
  return cores;
}

int threads_for(int64_t n) {
  const int64_t want = (n + kMinPerThread - 1) / kMinPerThread;
  return int(min_of<int64_t>(get_num_threads(), max_of<int64_t>(want, 1)));
}

EventCounts sum(const PerThread<EventCounts>& parts) {
  EventCounts total;
  for (const Slot<EventCounts>& c : parts) total.add(c.v);
  return total;
}

void add_counts(const EventCounts& c, int64_t n, int64_t* counts) {
  if (counts == nullptr) return;
  counts[0] += c.overflow;
  counts[1] += c.underflow;
  counts[2] += c.nan;
  counts[3] += n;
}

}  // namespace lowfp
