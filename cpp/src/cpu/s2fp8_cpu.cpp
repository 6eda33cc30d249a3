#include "s2fp8_cpu.hpp"

#include <vector>

#include "driver.hpp"
#include "s2fp8_thresholds.hpp"

namespace lowfp {

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

}  // namespace lowfp
