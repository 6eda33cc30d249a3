#include "quantize_cpu.hpp"

#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace lowfp {
namespace {

using KernelFn = void (*)(const QuantizeCall&, int64_t, int64_t, EventCounts&);

struct Kernel {
  KernelFn fn;
  const char* name;
};

bool cpu_has(const char* level) {
#if defined(__x86_64__) && defined(LOWFP_MULTI_ISA)
  __builtin_cpu_init();
  if (std::strcmp(level, "avx512") == 0) return __builtin_cpu_supports("x86-64-v4");
  if (std::strcmp(level, "avx2") == 0) return __builtin_cpu_supports("x86-64-v3");
#endif
  return std::strcmp(level, "baseline") == 0;
}

// The best level this CPU runs, or the one LOWFP_CPU_KERNEL names (tests compare them all).
Kernel pick_kernel() {
  const Kernel all[] = {
#if defined(LOWFP_MULTI_ISA)
      {isa_avx512::quantize_range, "avx512"},
      {isa_avx2::quantize_range, "avx2"},
#endif
      {isa_baseline::quantize_range, "baseline"},
  };
  const char* want = std::getenv("LOWFP_CPU_KERNEL");
  for (const Kernel& k : all)
    if (cpu_has(k.name) && (want == nullptr || *want == '\0' || std::strcmp(want, k.name) == 0))
      return k;
  return all[sizeof(all) / sizeof(all[0]) - 1];
}

const Kernel& kernel() {
  static const Kernel k = pick_kernel();
  return k;
}

int g_num_threads = 0;  // 0: every core

// Below this many elements per thread, starting threads costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;

}  // namespace

const char* cpu_kernel_name() { return kernel().name; }

void set_num_threads(int n) { g_num_threads = n > 0 ? n : 0; }

int get_num_threads() {
  if (g_num_threads > 0) return g_num_threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? int(hw) : 1;
}

void quantize_cpu(const QuantizeCall& call, int64_t* counts) {
  const KernelFn fn = kernel().fn;
  const int64_t n = call.n;
  const int64_t want = (n + kMinPerThread - 1) / kMinPerThread;
  const int threads = int(min_of<int64_t>(get_num_threads(), max_of<int64_t>(want, 1)));
  EventCounts total;
  if (threads <= 1) {
    fn(call, 0, n, total);
  } else {
    // Contiguous ranges made of whole tiles, so every tile starts on a Philox block boundary.
    const int64_t tiles = (n + kTile - 1) / kTile;
    std::vector<EventCounts> per_thread(threads);
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int nt = omp_get_num_threads();
      const int64_t t_begin = tiles * t / nt, t_end = tiles * (t + 1) / nt;
      const int64_t begin = t_begin * kTile, end = min_of(t_end * kTile, n);
      if (begin < end) fn(call, begin, end, per_thread[t]);
    }
    for (const EventCounts& c : per_thread) total.add(c);
  }
  if (counts != nullptr) {
    counts[0] += total.overflow;
    counts[1] += total.underflow;
    counts[2] += total.nan;
    counts[3] += n;
  }
}

}  // namespace lowfp
