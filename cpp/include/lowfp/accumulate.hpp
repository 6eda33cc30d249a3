// GEMM accumulation (docs/design.md §10): C = A·B with every addition's exact sum rounded once to
// an accumulator format, in an order the spec fixes whatever the kernel's tiling. Shared by the
// CPU and CUDA drivers: one output element, given its row of A and column of B.
//
// Operands have at most 24 significand bits (float32, bfloat16, float16), so a product is exact in
// float64; a sum of two float64 values is rounded to odd at 53 bits (sum_to_odd), from which a
// rounding to a format of m <= 19 mantissa bits, any mode with up to 51 - m random bits, gives the
// rounding of the exact sum.
#pragma once
#include <cstdint>

#include "philox.hpp"
#include "round.hpp"
#include "storage.hpp"

namespace lowfp {

// The order of the additions of one output element (docs/design.md §10).
enum class AccumulateOrder : int32_t {
  Sequential = 0,  // s_0 = +0, s_k = round(s_{k-1} + p_k), k = 1..K
  Pairwise = 1,    // a tree whose left subtrees hold a power of two of leaves: round(p_k) at the
                   //   leaves, round(left + right) at each node
  Blocked = 2,     // blocks of `block` products summed sequentially, each block's sum added to an
                   //   outer sum (s_0 = +0, nearest rounding to the outer format)
};

// Accumulator formats of at most this many mantissa bits (with sr_bits <= 51 - m, exact from the
// sum rounded to odd).
constexpr int32_t kAccumulateMaxMantissa = 19;

struct AccumulateParams {
  RoundParams<uint64_t> acc;      // the accumulator's format, rounding mode and overflow policy
  RoundParams<uint64_t> outer;    // Blocked: the outer sum's format, nearest
  RoundParams<uint64_t> product;  // the products' format, nearest (when has_product)
  bool has_product;
  AccumulateOrder order;
  int64_t block;                  // Blocked: products per block
  bool compensated;               // Kahan's compensated sum (Sequential, Blocked's blocks)
  Rounding mode;                  // the accumulator's rounding mode
};

// a + b rounded to odd at 53 bits (a and b finite): the RN sum, moved to its odd neighbour toward
// the exact sum when inexact (TwoSum gives the error exactly). An exact zero sum is +0, or -0
// when both addends are -0 (RN's rule). Infinite or NaN operands: the float64 sum.
LOWFP_HD double sum_to_odd(double a, double b) {
  const double hi = a + b;
  const double bv = hi - a;
  const double lo = (a - (hi - bv)) + (b - bv);  // (a + b) - hi exactly (no overflow: |a|, |b| < 2^300)
  uint64_t h = bit_cast<uint64_t>(hi);
  if (lo == lo && lo != 0.0 && (h & 1u) == 0u) h = (lo > 0.0) == (hi > 0.0) ? h + 1u : h - 1u;
  return bit_cast<double>(h);
}

// Counts of one element's roundings: events as round_bits sets them, all roundings, and
// additions whose nonzero addend left the sum as it was (swamped).
struct AccumulateCounts {
  int64_t overflow = 0, underflow = 0, nan = 0, roundings = 0, swamped = 0;
  LOWFP_HD void add(const RoundEvents& ev) {
    overflow += ev.overflow();
    underflow += ev.underflow;
    nan += ev.nan;
    roundings += 1;
  }
};

// v rounded by p (the float64 carrier; any subnormal_exponent).
template <RoundKind Kind>
LOWFP_HD double round_in_float64(double v, const RoundParams<uint64_t>& p, uint32_t rand,
                                 AccumulateCounts& counts) {
  RoundEvents ev;
  const uint64_t bits = bit_cast<uint64_t>(v);
  const uint64_t r = p.subnormal_exponent ? round_bits<Kind, uint64_t, true>(bits, p, rand, ev)
                                          : round_bits<Kind, uint64_t, false>(bits, p, rand, ev);
  counts.add(ev);
  return bit_cast<double>(r);
}

// The accumulator's roundings of one output element, in order: its t-th takes Philox word
// word0 + t (element e's word0 = e · its roundings per element, docs/design.md §10).
template <RoundKind Kind>
struct Accumulator {
  const AccumulateParams& p;
  uint64_t seed, offset, word;  // offset: a Philox block offset; word: the next word's index
  Philox4x32Block block{};
  uint64_t block_index = ~uint64_t(0);
  AccumulateCounts& counts;

  LOWFP_HD uint32_t next_word() {
    if constexpr (Kind != RoundKind::Stochastic) {
      return 0u;
    } else {
      const uint64_t b = offset + word / 4;
      if (b != block_index) {
        block = philox_block(seed, b);
        block_index = b;
      }
      return block.w[word++ % 4];
    }
  }
  // round(a + b) in the accumulator's format
  LOWFP_HD double add(double a, double b) {
    const uint32_t r = next_word();
    return round_in_float64<Kind>(sum_to_odd(a, b), p.acc, r, counts);
  }
  LOWFP_HD double round(double v) {
    const uint32_t r = next_word();
    return round_in_float64<Kind>(v, p.acc, r, counts);
  }
  // s + y, counting a swamped addition
  LOWFP_HD double add_counted(double s, double y) {
    const double t = add(s, y);
    counts.swamped += int64_t(y != 0.0 && bit_cast<uint64_t>(t) == bit_cast<uint64_t>(s));
    return t;
  }
};

// An output element as stored: float32 (exact: every format here fits it); a NaN as the quiet
// NaN 0x7fc00000, whatever sign or payload the additions left it.
LOWFP_HD float stored_sum(double v) { return v == v ? float(v) : bit_cast<float>(0x7fc00000u); }

// The accumulator's roundings per output element for K products.
LOWFP_HD int64_t accumulate_roundings(const AccumulateParams& p, int64_t k) {
  if (p.order == AccumulateOrder::Pairwise) return k > 0 ? 2 * k - 1 : 0;
  return p.compensated ? 4 * k : k;
}

// One output element: sum over k < K of product(a[k·sa], b[k·sb]) as the params say, its
// roundings counted into counts; element `e` of the output (its stochastic words).
template <RoundKind Kind, class In>
LOWFP_HD double accumulate_element(const AccumulateParams& p, const In* a, int64_t sa, const In* b,
                                   int64_t sb, int64_t K, uint64_t seed, uint64_t offset, uint64_t e,
                                   AccumulateCounts& counts) {
  Accumulator<Kind> acc{p, seed, offset, e * uint64_t(accumulate_roundings(p, K)), {}, ~uint64_t(0),
                        counts};
  auto product = [&](int64_t k) {
    const double x = bit_cast<double>(Widen<uint64_t>::from(a[k * sa]));
    const double y = bit_cast<double>(Widen<uint64_t>::from(b[k * sb]));
    const double exact = x * y;  // (at most 48 significand bits)
    return p.has_product ? round_in_float64<RoundKind::Nearest>(exact, p.product, 0u, counts) : exact;
  };
  // Sequential sums of products [k0, k1) from +0, compensated or not
  auto sequential = [&](int64_t k0, int64_t k1) {
    double s = 0.0, c = 0.0;
    for (int64_t k = k0; k < k1; ++k) {
      const double q = product(k);
      if (p.compensated) {
        const double y = acc.add(q, -c);
        const double t = acc.add_counted(s, y);
        c = acc.add(acc.add(t, -s), -y);
        s = t;
      } else {
        s = acc.add_counted(s, q);
      }
    }
    return s;
  };
  if (p.order == AccumulateOrder::Sequential) return sequential(0, K);
  if (p.order == AccumulateOrder::Blocked) {
    double outer = 0.0;
    for (int64_t k0 = 0; k0 < K; k0 += p.block) {
      const double inner = sequential(k0, min_of(K, k0 + p.block));
      const double next = round_in_float64<RoundKind::Nearest>(sum_to_odd(outer, inner), p.outer, 0u, counts);
      counts.swamped += int64_t(inner != 0.0 && bit_cast<uint64_t>(next) == bit_cast<uint64_t>(outer));
      outer = next;
    }
    return outer;
  }
  // Pairwise, as a binary counter: the leaves in order, two subtrees of equal size merged as
  // soon as both exist, the rest merged from the right at the end (the roundings in post-order).
  constexpr int kDepth = 64;
  double value[kDepth];
  int64_t size[kDepth];
  int depth = 0;
  for (int64_t k = 0; k < K; ++k) {
    value[depth] = acc.round(product(k));
    size[depth++] = 1;
    while (depth >= 2 && size[depth - 1] == size[depth - 2]) {
      value[depth - 2] = acc.add_counted(value[depth - 2], value[depth - 1]);
      size[depth - 2] *= 2;
      --depth;
    }
  }
  while (depth >= 2) {
    value[depth - 2] = acc.add_counted(value[depth - 2], value[depth - 1]);
    --depth;
  }
  return depth == 1 ? value[0] : 0.0;
}

}  // namespace lowfp
