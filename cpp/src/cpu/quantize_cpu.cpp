#include "quantize_cpu.hpp"

#include "s2fp8_thresholds.hpp"

#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace lowfp {
namespace {

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
  void (*scaled_elements)(const ScaledCall&, int64_t, int64_t, EventCounts&);
  const char* name;
};

#define LOWFP_KERNEL(ns, name)                                                     \
  {                                                                                \
    ns::quantize_range, ns::s2fp8_reduce_range, ns::s2fp8_transform_range,         \
        ns::extra_bits_step_range, ns::extra_bits_split_range, ns::extra_bits_merge_range, \
        ns::any_non_finite_range, ns::scaled_amax_range, ns::scaled_scales_range,         \
        ns::scaled_elements_range, name                                                  \
  }

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

const Kernel& kernel() {
  static const Kernel k = pick_kernel();
  return k;
}

int g_num_threads = 0;      // lowfp.set_num_threads; 0: the default below
int g_default_threads = 0;  // torch's thread count, handed over by the Python layer; 0: every core

// Below this many elements per thread, starting threads costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;

}  // namespace

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

namespace {

// Threads worth starting for n elements: at most get_num_threads(), and at least kMinPerThread
// elements each. Per-thread outputs are sized by it too, so a large set_num_threads costs nothing.
int threads_for(int64_t n) {
  const int64_t want = (n + kMinPerThread - 1) / kMinPerThread;
  return int(min_of<int64_t>(get_num_threads(), max_of<int64_t>(want, 1)));
}

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

// Per-thread outputs, each on a cache line of its own, so that kernels adding to theirs as they
// go (per chunk, say) never write a line another thread writes.
template <class T>
struct alignas(64) Slot {
  T v;
};
template <class T>
using PerThread = std::vector<Slot<T>>;

EventCounts sum(const PerThread<EventCounts>& parts) {
  EventCounts total;
  for (const Slot<EventCounts>& c : parts) total.add(c.v);
  return total;
}

}  // namespace

void add_counts(const EventCounts& c, int64_t n, int64_t* counts) {
  if (counts == nullptr) return;
  counts[0] += c.overflow;
  counts[1] += c.underflow;
  counts[2] += c.nan;
  counts[3] += n;
}

void quantize_cpu(const QuantizeCall& call, int64_t* counts) {
  PerThread<EventCounts> per_thread(threads_for(call.n));
  const auto fn = kernel().quantize;
  parallel_tiles(call.n, [&](int t, int64_t begin, int64_t end) {
    fn(call, begin, end, per_thread[t].v);
  });
  add_counts(sum(per_thread), call.n, counts);
}

void s2fp8_cpu(const S2fp8Call& call, int64_t* sums, double* params, int64_t* counts) {
  const Kernel& k = kernel();
  PerThread<S2fp8Partial> parts(threads_for(call.q.n));
  parallel_tiles(call.q.n, [&](int t, int64_t begin, int64_t end) {
    k.s2fp8_reduce(call, begin, end, parts[t].v);
  });
  S2fp8Partial total;  // integer sums and a max: the same whatever the split
  for (const Slot<S2fp8Partial>& p : parts) total.add(p.v);
  sums[kSumLogHigh] = total.high;
  sums[kSumLogLow] = int64_t(total.low);
  sums[kSumCount] = total.count;
  sums[kSumMaxAbs] = int64_t(total.max_abs);
  sums[kSumExp] = total.exp_sum;
  const S2fp8Stats s = s2fp8_stats(sums, call.log_max);
  params[kAlpha] = s.alpha;
  params[kBeta] = s.beta;
  params[kMu] = s.mu;
  params[kMax] = s.m;
  std::vector<uint32_t> storage;
  S2fp8Thresholds thresholds;
  S2fp8StochasticForm stochastic;
  S2fp8Forms forms;
  if (s2fp8_build_thresholds(call, s, thresholds, storage)) forms.thresholds = &thresholds;
  else if (s2fp8_build_stochastic(call, s, stochastic, storage)) forms.stochastic = &stochastic;
  PerThread<EventCounts> per_thread(threads_for(call.q.n));
  parallel_tiles(call.q.n, [&](int t, int64_t begin, int64_t end) {
    k.s2fp8_transform(call, s, forms, begin, end, per_thread[t].v);
  });
  add_counts(sum(per_thread), call.q.n, counts);
}

namespace {

// Contiguous block ranges of one buffer of n elements, one per thread (Philox offsets follow the
// element index, so the split does not change results).
template <class Fn>
void parallel_blocks(int64_t n, Fn&& fn) {
  const int64_t blocks = (n + 31) / 32;
  const int threads = threads_for(n);
  if (threads <= 1) {
    fn(0, int64_t(0), blocks);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    if (b0 < b1) fn(t, b0, b1);
  }
}

}  // namespace

EventCounts extra_bits_split_cpu(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a) {
  PerThread<EventCounts> parts(threads_for(a.n));
  const auto fn = kernel().extra_bits_split;
  parallel_blocks(a.n, [&](int t, int64_t b0, int64_t b1) { fn(e, mode, a, b0, b1, parts[t].v); });
  return sum(parts);
}

void extra_bits_merge_cpu(const ExtraBitsParams& e, const ExtraBitsMerge& a) {
  const auto fn = kernel().extra_bits_merge;
  parallel_blocks(a.n, [&](int, int64_t b0, int64_t b1) { fn(e, a, b0, b1); });
}

void extra_bits_gather_cpu(const uint32_t* src, const int64_t* index, int64_t n, uint32_t q,
                           uint32_t* dst) {
  parallel_blocks(n, [&](int, int64_t b0, int64_t b1) {
    uint32_t values[32];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < 32; ++j) {
        const int64_t i = b * 32 + j;
        values[j] = i < n ? unpack_one(src + index[i] / 32 * q, q, uint32_t(index[i] % 32)) : 0u;
      }
      pack_block(values, q, dst + b * q);
    }
  });
}

bool any_non_finite_cpu(DType t, const void* x, int64_t n) {
  PerThread<bool> found(threads_for(n));
  const auto fn = kernel().any_non_finite;
  parallel_tiles(n, [&](int i, int64_t begin, int64_t end) { found[i].v = fn(t, x, begin, end); });
  for (const Slot<bool>& f : found)
    if (f.v) return true;
  return false;
}

namespace {

// fn(thread, begin, end) over contiguous ranges of [0, n) items (rows, block rows), on as many
// threads as `elements` (what the items hold) is worth.
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

}  // namespace

namespace {

// The same element of kLanes groups, each operation applied to every lane (loops the compiler
// turns into vector instructions): hadamard16 on kLanes groups at once.
constexpr int kLanes = 16;
template <class T>
struct Lanes {
  T l[kLanes];
  Lanes operator+(const Lanes& o) const {
    Lanes r;
    for (int k = 0; k < kLanes; ++k) r.l[k] = l[k] + o.l[k];
    return r;
  }
  Lanes operator-(const Lanes& o) const {
    Lanes r;
    for (int k = 0; k < kLanes; ++k) r.l[k] = l[k] - o.l[k];
    return r;
  }
  Lanes operator*(T s) const {
    Lanes r;
    for (int k = 0; k < kLanes; ++k) r.l[k] = l[k] * s;
    return r;
  }
};

template <class In, class T>
void hadamard_groups(const HadamardCall& c, const T (&signs)[kHadamardSize], int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + kLanes <= g1; g += kLanes) {
    Lanes<T> v[kHadamardSize];
    const In* x = static_cast<const In*>(c.x) + g * kHadamardSize;
    for (int k = 0; k < kLanes; ++k)
      for (int i = 0; i < kHadamardSize; ++i) v[i].l[k] = widen_to<T>(x[k * kHadamardSize + i]);
    hadamard16(v, signs, c.inverse);
    T* y = static_cast<T*>(c.y) + g * kHadamardSize;
    for (int k = 0; k < kLanes; ++k)
      for (int i = 0; i < kHadamardSize; ++i) y[k * kHadamardSize + i] = v[i].l[k];
  }
  for (; g < g1; ++g) hadamard_group<In>(c, signs, g);
}

}  // namespace

void hadamard_cpu(const HadamardCall& c) {
  with_storage_type(c.dtype, [&](auto p) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    using T = std::conditional_t<std::is_same_v<In, double>, double, float>;
    T signs[kHadamardSize];
    for (int i = 0; i < kHadamardSize; ++i) signs[i] = T(c.signs[i]);
    parallel_items(c.groups, c.groups * kHadamardSize, [&](int, int64_t g0, int64_t g1) {
      hadamard_groups<In>(c, signs, g0, g1);
    });
  });
}

namespace {

// Adds a scaled call's counts: {overflow, underflow, nan, numel}, then, when the call counts
// blocks, {blocks whose scale saturated, blocks}; nothing when counts is null.
void add_scaled_counts(const ScaledCall& call, const PerThread<EventCounts>& parts,
                       const PerThread<int64_t>& saturated, int64_t blocks, int64_t* counts) {
  if (counts == nullptr) return;
  add_counts(sum(parts), call.rows * call.cols, counts);
  if (!call.count_blocks) return;
  for (const Slot<int64_t>& s : saturated) counts[4] += s.v;
  counts[5] += blocks;
}

}  // namespace

void scaled_cpu(const ScaledCall& call, double* tensor_scale, int64_t* counts) {
  const Kernel& k = kernel();
  const int64_t n = call.rows * call.cols;
  const int64_t grid_rows = call.block_grid_rows(), gc = call.block_grid_cols();
  const int64_t blocks = grid_rows * gc;
  if (!call.tensor_scale && grid_rows >= 4 * int64_t(threads_for(n))) {
    // Without a tensor scale each row of blocks is independent: its largest magnitudes, scales
    // and elements in one visit, while its inputs are still in cache (one read of x, not two).
    PerThread<EventCounts> parts(threads_for(n));
    PerThread<int64_t> saturated(threads_for(n));
    parallel_items(grid_rows, n, [&](int th, int64_t b0, int64_t b1) {
      for (int64_t br = b0; br < b1; ++br) {
        k.scaled_amax(call, br, br + 1);
        k.scaled_scales(call, 1.0, br * gc, (br + 1) * gc, saturated[th].v);
        k.scaled_elements(call, br * call.block_rows,
                          min_of(call.rows, (br + 1) * call.block_rows), parts[th].v);
      }
    });
    *tensor_scale = 1.0;
    add_scaled_counts(call, parts, saturated, blocks, counts);
    return;
  }
  PerThread<double> largest(threads_for(n));
  parallel_items(grid_rows, n, [&](int th, int64_t b0, int64_t b1) {
    largest[th].v = k.scaled_amax(call, b0, b1);
  });
  double t = 1.0;
  if (call.tensor_scale) {
    double a = 0.0;
    for (const Slot<double>& s : largest) a = max_of(a, s.v);
    t = lowfp::tensor_scale(call.scale, a);  // (the parameter tensor_scale hides it)
  }
  *tensor_scale = t;
  PerThread<int64_t> saturated(threads_for(blocks * 64));  // (a block's scale: some 64 elements' work)
  parallel_items(blocks, blocks * 64, [&](int th, int64_t b0, int64_t b1) {
    k.scaled_scales(call, t, b0, b1, saturated[th].v);
  });
  ScaledCall with_t = call;
  with_t.t = t;
  PerThread<EventCounts> parts(threads_for(n));
  parallel_items(call.rows, n, [&](int th, int64_t r0, int64_t r1) {
    k.scaled_elements(with_t, r0, r1, parts[th].v);
  });
  add_scaled_counts(call, parts, saturated, blocks, counts);
}

EventCounts extra_bits_step_cpu(const ExtraBitsStep& s) {
  // Work items of up to kChunkBlocks blocks from every parameter, shared out dynamically.
  constexpr int64_t kChunkBlocks = 256;
  struct Chunk { int64_t slot, b0, b1; };
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (size_t i = 0; i < s.slots.size(); ++i) {
    const int64_t blocks = (s.slots[i].n + 31) / 32;
    total += s.slots[i].n;
    for (int64_t b = 0; b < blocks; b += kChunkBlocks)
      chunks.push_back({int64_t(i), b, min_of(b + kChunkBlocks, blocks)});
  }
  const auto fn = kernel().extra_bits_step;
  const int threads = threads_for(total);
  PerThread<EventCounts> parts(threads);
  const int64_t n_chunks = int64_t(chunks.size());
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
  for (int64_t c = 0; c < n_chunks; ++c)
    fn(s, chunks[c].slot, chunks[c].b0, chunks[c].b1, parts[omp_get_thread_num()].v);
  return sum(parts);
}

}  // namespace lowfp
