#include "accumulate_cpu.hpp"

#include "driver.hpp"

namespace lowfp {

void accumulate_cpu(const AccumulateCall& c, int64_t* counts) {
  const int64_t rows = c.batch * c.m;
  const int64_t work = rows * c.n * (c.k > 0 ? c.k : 1);  // (products: each element's work)
  PerThread<AccumulateCounts> parts(threads_for(work));
  const auto fn = kernel().accumulate;
  parallel_items(rows, work, [&](int t, int64_t r0, int64_t r1) { fn(c, r0, r1, parts[t].v); });
  if (counts == nullptr) return;
  for (const Slot<AccumulateCounts>& s : parts) {
    counts[0] += s.v.overflow;
    counts[1] += s.v.underflow;
    counts[2] += s.v.nan;
    counts[3] += s.v.roundings;
    counts[4] += s.v.swamped;
  }
}

}  // namespace lowfp
