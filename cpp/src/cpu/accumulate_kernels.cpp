// The emulated-accumulation loop (docs/design.md §10), compiled once per instruction-set level
// like quantize_kernels.cpp: the rows of C in chunks of kLanes columns, each chunk's sums side by
// side (lowfp/accumulate.hpp's accumulate_lanes), so that every step is a vector operation.
#include "isa.hpp"

#include <cfenv>

#include "accumulate_call.hpp"
#include "dispatch.hpp"
#include "philox_lanes.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// Output columns side by side: eight AVX-512 vectors of sums in flight, so that each addition's
// latency (the sum rounded to odd, then to the format) overlaps the others'. The columns left over
// go kNarrowLanes at a time (one AVX-512 vector: narrow GEMMs such as attention's, 8 columns per
// head, would otherwise run one column at a time), then one by one.
constexpr int kLanes = 64;
constexpr int kNarrowLanes = 8;

// The stochastic lanes' words from vector registers (philox_lanes.hpp).
struct VectorPhilox {
  template <int kN>
  static void fill(uint64_t seed, const uint64_t (&block)[kN], uint32_t (&w)[4][kN]) {
    philox_blocks_at(seed, block, w);
  }
};

template <RoundKind Kind, bool kSub, LaneForm kForm, int kWidth>
void columns(const AccumulateCall& c, const float* a_row, const float* b_mat, float* c_row, int64_t r, int64_t j,
             AccumulateCounts& counts) {
  double sums[kWidth];
  accumulate_lanes<Kind, kSub, kWidth, kForm, VectorPhilox>(c.p, a_row, c.a_k, b_mat + j * c.b_col, c.b_k, c.b_col, c.k, c.seed,
                                       c.offset, uint64_t(r * c.n + j), sums, counts);
  for (int l = 0; l < kWidth; ++l) c_row[j + l] = stored_sum(sums[l]);
}

template <RoundKind Kind, bool kSub, LaneForm kForm>
void rows(const AccumulateCall& c, int64_t r0, int64_t r1, AccumulateCounts& counts) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t batch = r / c.m, i = r % c.m;
    const float* a_row = c.a + batch * c.a_batch + i * c.a_row;
    const float* b_mat = c.b + batch * c.b_batch;
    float* c_row = c.c + r * c.n;
    int64_t j = 0;
    for (; j + kLanes <= c.n; j += kLanes) columns<Kind, kSub, kForm, kLanes>(c, a_row, b_mat, c_row, r, j, counts);
    for (; j + kNarrowLanes <= c.n; j += kNarrowLanes)
      columns<Kind, kSub, kForm, kNarrowLanes>(c, a_row, b_mat, c_row, r, j, counts);
    for (; j < c.n; ++j) columns<Kind, kSub, kForm, 1>(c, a_row, b_mat, c_row, r, j, counts);
  }
}

// The floating-point unit's rounding mode for the rows of one thread, restored when they are done
// (LaneForm::InMode). The rows' loops are a call of their own (rows_in_mode, never inlined), so
// that no floating-point operation of theirs moves across the change of mode.
class RoundingModeScope {
 public:
  explicit RoundingModeScope(int mode) : saved_(std::fegetround()) { std::fesetround(mode); }
  ~RoundingModeScope() { std::fesetround(saved_); }
  RoundingModeScope(const RoundingModeScope&) = delete;
  RoundingModeScope& operator=(const RoundingModeScope&) = delete;

 private:
  int saved_;
};

template <RoundKind Kind>
__attribute__((noinline)) void rows_in_mode(const AccumulateCall& c, int64_t r0, int64_t r1,
                                            AccumulateCounts& counts) {
  rows<Kind, false, LaneForm::InMode>(c, r0, r1, counts);
}

void in_mode(const AccumulateCall& c, int64_t r0, int64_t r1, AccumulateCounts& counts) {
  switch (c.p.mode) {
    case Rounding::Stochastic: {
      const RoundingModeScope scope(FE_TOWARDZERO);
      rows_in_mode<RoundKind::Stochastic>(c, r0, r1, counts);
      return;
    }
    case Rounding::TowardZero: {
      const RoundingModeScope scope(FE_TOWARDZERO);
      rows_in_mode<RoundKind::TowardZero>(c, r0, r1, counts);
      return;
    }
    default: {  // (up or down: in_mode_form holds for no other mode)
      const RoundingModeScope scope(c.p.mode == Rounding::Up ? FE_UPWARD : FE_DOWNWARD);
      rows_in_mode<RoundKind::Directed>(c, r0, r1, counts);
      return;
    }
  }
}

}  // namespace

void accumulate_range(const AccumulateCall& c, int64_t r0, int64_t r1, AccumulateCounts& counts) {
  if (c.p.in_mode) {
    in_mode(c, r0, r1, counts);
    return;
  }
  with_round_kind(c.p.mode, [&](auto kind) {
    constexpr RoundKind K = decltype(kind)::value;
    if constexpr (K == RoundKind::Nearest) {
      if (c.p.by_addition) {  // (which nearest_by_addition holds only without subnormal exponents)
        rows<K, false, LaneForm::ByAddition>(c, r0, r1, counts);
        return;
      }
    }
    with_flag(c.p.acc.subnormal_exponent,
              [&](auto sub) { rows<K, decltype(sub)::value, LaneForm::Bits>(c, r0, r1, counts); });
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
