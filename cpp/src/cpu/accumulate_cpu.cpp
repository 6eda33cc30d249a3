#include "accumulate_cpu.hpp"

#include <type_traits>

#include "dispatch.hpp"
#include "driver.hpp"

namespace lowfp {

namespace {

template <RoundKind Kind, class In>
void rows(const AccumulateCall& c, int64_t r0, int64_t r1, AccumulateCounts& counts) {
  const In* a = static_cast<const In*>(c.a);
  const In* b = static_cast<const In*>(c.b);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t batch = r / c.m, i = r % c.m;
    const In* a_row = a + batch * c.a_batch + i * c.a_row;
    const In* b_mat = b + batch * c.b_batch;
    float* c_row = c.c + r * c.n;
    for (int64_t j = 0; j < c.n; ++j)
      c_row[j] = stored_sum(accumulate_element<Kind>(c.p, a_row, c.a_k, b_mat + j * c.b_col, c.b_k, c.k,
                                                c.seed, c.offset, uint64_t(r * c.n + j), counts));
  }
}

}  // namespace

void accumulate_cpu(const AccumulateCall& c, int64_t* counts) {
  const int64_t rows_total = c.batch * c.m;
  const int64_t work = rows_total * c.n * (c.k > 0 ? c.k : 1);  // (products: each element's work)
  PerThread<AccumulateCounts> parts(threads_for(work));
  with_storage_type(c.dtype, [&](auto type) {
    using In = typename decltype(type)::type;
    if constexpr (!std::is_same_v<In, double>) {  // (prepare_accumulate refuses float64)
      with_round_kind(c.p.mode, [&](auto kind) {
        parallel_items(rows_total, work, [&](int t, int64_t r0, int64_t r1) {
          rows<decltype(kind)::value, In>(c, r0, r1, parts[t].v);
        });
      });
    }
  });
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
