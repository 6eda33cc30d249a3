#include "quantize_cpu.hpp"

#include "driver.hpp"

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

}  // namespace lowfp
