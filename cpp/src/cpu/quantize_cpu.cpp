#include "quantize_cpu.hpp"

#include <cmath>

#include "driver.hpp"
#include "lowfp/storage.hpp"

namespace lowfp {

void quantize_cpu(const QuantizeCall& call, int64_t* counts) {
  PerThread<EventCounts> per_thread(threads_for(call.n));
  const auto fn = kernel().quantize;
  parallel_tiles(call.n, [&](int t, int64_t begin, int64_t end) {
    fn(call, begin, end, per_thread[t].v);
  });
  add_counts(sum(per_thread), call.n, counts);
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

template <class U>
int64_t count_nans(const void* x, int64_t n, DType t) {
  const U* p = static_cast<const U*>(x);
  const U exponent = U(exponent_mask(t));
  int64_t nans = 0;
  for (int64_t i = 0; i < n; ++i) nans += nan_bits(p[i], exponent);
  return nans;
}

}  // namespace

void count_unchanged_cpu(DType t, const void* x, int64_t n, int64_t* counts) {
  int64_t nans = 0;
  if (any_non_finite_cpu(t, x, n)) {  // (the usual case, no NaN, in one vectorised pass)
    switch (t) {
      case DType::Float16:
      case DType::BFloat16: nans = count_nans<uint16_t>(x, n, t); break;
      case DType::Float32: nans = count_nans<uint32_t>(x, n, t); break;
      case DType::Float64: nans = count_nans<uint64_t>(x, n, t); break;
    }
  }
  counts[2] += nans;
  counts[3] += n;
}

}  // namespace lowfp
