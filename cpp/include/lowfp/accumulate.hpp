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

// Fused groups of at most this many products, keeping at most this many aligned bits.
constexpr int32_t kAccumulateMaxGroup = 64;
constexpr int32_t kAccumulateMaxAlignBits = 40;

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
  int32_t group;                  // > 0: fused groups of this many products (Sequential, Blocked's
                                  //   blocks; fused_group), else one addition per product
  int32_t align_bits;             // fused groups: the fraction bits each term keeps below the
                                  //   group's largest exponent
  int32_t operand_emin;           // fused groups: the operands' smallest exponent (float32's: -126)
  Rounding mode;                  // the accumulator's rounding mode
  // Nearest rounding of the sums by addition (round.hpp's round_nearest_by_addition, the same
  // results), where nearest_by_addition(acc, add_cap) holds; add_cap: the format's emax + 1
  bool by_addition;
  int32_t add_cap;
  // One sum at a time by addition or in the mode (AccumulateLanes::round_one): the high words of
  // the values in [2^emin, 2^E), E the exponent of the largest finite value, are those whose
  // exponent field minus quiet_field is below quiet_span (as unsigned words); drop_field is
  // normal_drop in a high word's exponent field (quiet_fields).
  uint32_t quiet_field, quiet_span, drop_field;
  int32_t product_add_cap;        // > 0: the products round to nearest by addition with this e_cap
  // The form for directed and stochastic rounding where in_mode_form holds: each sum and rounding
  // is one addition in the accumulator's direction (LaneForm::InMode, Direction).
  bool in_mode;
};

// How a lane loop sums and rounds, chosen once per call.
enum class LaneForm {
  Bits,        // each sum rounded to odd (sum_to_odd), then round_bits: every mode and format
  ByAddition,  // each sum rounded to odd, then nearest by addition (AccumulateParams::by_addition)
  // Directed and stochastic rounding with the floating-point unit's rounding mode set to the
  // accumulator's direction (toward zero for stochastic rounding): each sum is the carrier's
  // addition in that mode, and its rounding to the format one addition more (round_in_mode).
  InMode,
};

// Counts of one element's roundings: events as round_bits sets them, all roundings, and
// additions whose nonzero addend left the sum as it was (swamped).
struct AccumulateCounts {
  int64_t overflow = 0, underflow = 0, nan = 0, roundings = 0, swamped = 0;
};

// The code below has internal linkage: each file compiled for an instruction-set level (and CUDA)
// keeps its own copy, where the linker would otherwise keep one of them for all.
namespace {

// a + b rounded to odd at 53 bits (a and b finite): the sum truncated toward zero, its last bit
// set when inexact. An exact zero sum is +0, or -0 when both addends are -0 (RN's rule).
// Infinite or NaN operands: the float64 sum.
//
// On the CPU, from the RN sum moved to its odd neighbour toward the exact sum when inexact
// (TwoSum gives the error exactly; it vectorises). On a GPU each float64 addition names its
// rounding: an inexact sum lies between its roundings down and up, adjacent values of which
// exactly one is odd, and an exact one is both. So the result is the rounding down where that is
// odd, else the rounding up, whose exact zero sums follow RN's sign rule (the rounding down of
// x + -x is -0, even) and whose infinities and NaNs are RN's.
LOWFP_HD double sum_to_odd(double a, double b) {
#if defined(__CUDA_ARCH__)
  const double down = __dadd_rd(a, b), up = __dadd_ru(a, b);
  return (__double2loint(down) & 1) ? down : up;
#else
  const double hi = a + b;
  const double bv = hi - a;
  const double lo = (a - (hi - bv)) + (b - bv);  // (a + b) - hi exactly (no overflow: |a|, |b| < 2^300)
  const uint64_t h = bit_cast<uint64_t>(hi);
  // (branch-free, for the lane loops: whether inexact and even, and the step toward the exact sum)
  const uint64_t odd_needed = uint64_t(lo != 0.0) & uint64_t(lo == lo) & ~h & 1u;
  const uint64_t step = select((lo > 0.0) == (hi > 0.0), uint64_t(1), ~uint64_t(0));
  return bit_cast<double>(h + (step & (uint64_t(0) - odd_needed)));
#endif
}

// The accumulator's roundings per output element for K products.
LOWFP_HD int64_t accumulate_roundings(const AccumulateParams& p, int64_t k) {
  if (p.order == AccumulateOrder::Pairwise) return k > 0 ? 2 * k - 1 : 0;
  if (p.group > 0) {  // one rounding per group: per block when blocked
    auto groups = [&](int64_t n) { return (n + p.group - 1) / p.group; };
    if (p.order != AccumulateOrder::Blocked) return groups(k);
    return (k / p.block) * groups(p.block) + groups(k % p.block);
  }
  return p.compensated ? 4 * k : k;
}

// 2^k for k in [-1022, 1023], by its bits.
LOWFP_HD double exact_pow2(int32_t k) { return bit_cast<double>(uint64_t(k + 1023) << 52); }

// x rounded toward zero to an integer (|x| < 2^62; an infinity or a NaN gives 0).
LOWFP_HD double trunc_of(double x) {
  const double finite = x - x == 0.0 ? x : 0.0;
  return double(int64_t(finite));
}

// The exponent a fused group aligns x by: floor(log2 |x|), held at emin and below (MMA-Sim's rule
// for Hopper: a value below its format's normal range takes the format's emin), -126 for 0.
LOWFP_HD int32_t aligned_exponent(double x, int32_t emin) {
  const int32_t e = int32_t((bit_cast<uint64_t>(x) >> 52) & 0x7ffu) - 1023;
  return x == 0.0 ? -126 : (e < emin ? emin : e);
}

// An output element as stored: float32 (exact: every format here fits it); a NaN as the quiet
// NaN 0x7fc00000, whatever sign or payload the additions left it.
LOWFP_HD float stored_sum(double v) { return v == v ? float(v) : bit_cast<float>(0x7fc00000u); }

// The direction of LaneForm::InMode's additions. The CPU's driver sets the floating-point unit's
// rounding mode for the call, so a + b rounds in it (Fpu: one instance serves up and down). CUDA
// has no such mode, but each float64 addition names its direction (__dadd_rz, __dadd_ru,
// __dadd_rd), so its kernels take the direction as a template parameter. Every other operation of
// the form is exact (products of float32 operands, powers of two, conversions of 32-bit words),
// so the two give the same bits.
enum class Direction { Fpu, TowardZero, Up, Down };

// a + b rounded in kDir (on the CPU: in the floating-point unit's mode).
template <Direction kDir>
LOWFP_HD double add_in(double a, double b) {
#if defined(__CUDA_ARCH__)
  static_assert(kDir != Direction::Fpu, "CUDA's additions name their direction");
  if constexpr (kDir == Direction::TowardZero) return __dadd_rz(a, b);
  else if constexpr (kDir == Direction::Up) return __dadd_ru(a, b);
  else return __dadd_rd(a, b);
#else
  return a + b;
#endif
}

// LaneForm::InMode. With the carrier's additions rounded in the accumulator's direction (toward
// zero for stochastic rounding), a + b is the exact sum rounded in that direction at 53 bits, and
// rounding that again in the same direction to the format's coarser grid gives the rounding of the
// exact sum (nested grids, one direction). Stochastic rounding needs the dropped fraction's top
// sr_bits <= 51 - m bits, which the sum truncated at 53 bits keeps. An exact zero sum is +0 in
// every mode but downward, where the sign is fixed to the spec's (RN's: -0 only from -0 + -0).
template <RoundKind Kind, Direction kDir>
LOWFP_HD double sum_in_mode(double a, double b) {
  const double s = add_in<kDir>(a, b);
  if constexpr (Kind == RoundKind::Directed) {  // (up or down: the fix is an identity rounding up)
    const uint64_t zero = bit_cast<uint64_t>(a) & bit_cast<uint64_t>(b) & (uint64_t(1) << 63);
    return bit_cast<double>(select(s == 0.0, zero, bit_cast<uint64_t>(s)));
  }
  return s;
}

// v (a sum in the mode, or an exact value) rounded to the format in the mode, by addition as
// round.hpp's magnitude_by_addition: c = 2^(e + 52 - m) with e = v's exponent held in [emin, e_cap]
// has the format's step at v as its ulp, so the carrier's rounding of v + c is the rounding to
// that step (where in_mode_form holds). Directed: (v + c') - c' with c' = c carrying v's sign,
// whose rounding direction then acts on v itself. Stochastic: up with probability
// floor(f 2^R) / 2^R (f: the dropped fraction, R = sr_bits; round.hpp's round_bits), that is when
// f + (2^R - 1 - r) / 2^R >= 1 for the word's top R bits r: the magnitude plus that many 2^-R
// steps, truncated to the step (exact: the sum keeps every bit down to 2^-R steps).
// value_in_mode is that rounding with the constant c = c_bits given, before events and overflow
// (the rounded value with x's sign); round_in_mode takes c from v's exponent and gives
// rounded_result's events, overflow and NaNs.
template <RoundKind Kind, Direction kDir>
LOWFP_HD uint64_t value_in_mode(uint64_t x, uint64_t c_bits, const RoundParams<uint64_t>& p, uint32_t rand) {
  constexpr uint64_t kSign = uint64_t(1) << 63;
  if constexpr (Kind == RoundKind::Stochastic) {
    const double c = bit_cast<double>(c_bits);
    const int64_t r_bits = 32 - int64_t(p.sr_shift);
    const double step_fraction = bit_cast<double>(c_bits - (uint64_t(52 + r_bits) << 52));  // 2^-R steps
    // (the word widened first: a signed 64-bit conversion is one vector instruction, an
    // unsigned 32-bit one is not)
    const double noise = double(int64_t(uint64_t(~rand) >> p.sr_shift)) * step_fraction;  // (exact)
    const double a = bit_cast<double>(x & ~kSign);
    return bit_cast<uint64_t>(add_in<kDir>(add_in<kDir>(add_in<kDir>(a, noise), c), -c)) | (x & kSign);
  } else {
    const double signed_c = bit_cast<double>(c_bits | (x & kSign));
    return bit_cast<uint64_t>(add_in<kDir>(add_in<kDir>(bit_cast<double>(x), signed_c), -signed_c));
  }
}

template <RoundKind Kind, Direction kDir>
LOWFP_HD uint64_t round_in_mode(uint64_t x, const RoundParams<uint64_t>& p, int32_t e_cap, uint32_t rand,
                                RoundEvents& ev) {
  constexpr uint64_t kSign = uint64_t(1) << 63;
  const uint64_t c_bits = addition_constant_bits(x & ~kSign, p, e_cap);
  return rounded_result(x, value_in_mode<Kind, kDir>(x, c_bits, p, rand) & ~kSign, p, ev);
}

// AccumulateParams' quiet_field, quiet_span and drop_field of the accumulator's format (host side).
inline void quiet_fields(AccumulateParams& p) {
  const uint32_t emin_field = uint32_t(p.acc.emin + 1023), max_field = uint32_t(p.acc.max_bits >> 52);
  p.quiet_field = emin_field << 20;
  p.quiet_span = max_field > emin_field ? (max_field - emin_field) << 20 : 0u;
  p.drop_field = uint32_t(p.acc.normal_drop) << 20;
}

// Whether a call may take LaneForm::InMode (host side): rounding toward zero, up, down or
// stochastic; sequential or pairwise orders (the blocked outer sum and Kahan's corrections need
// round-to-nearest sums), additions of exact products one at a time; a format whose steps by
// addition are the ones round_bits takes (round.hpp's steps_by_addition).
inline bool in_mode_form(const AccumulateParams& p) {
  const bool mode = p.mode == Rounding::TowardZero || p.mode == Rounding::Up || p.mode == Rounding::Down ||
                    p.mode == Rounding::Stochastic;
  const bool order = p.order == AccumulateOrder::Sequential || p.order == AccumulateOrder::Pairwise;
  return mode && order && steps_by_addition(p.acc, p.add_cap) && !p.compensated && p.group == 0 &&
         !p.has_product;
}

// Where a lane loop's Philox blocks come from: philox.hpp's philox_blocks by default; the CPU's
// kernels pass their vector-register generator (philox_lanes.hpp's philox_blocks_at).
struct PhiloxLaneBlocks {
  template <int kN>
  LOWFP_HD static void fill(uint64_t seed, const uint64_t (&block)[kN], uint32_t (&w)[4][kN]) {
    philox_blocks(seed, block, w);
  }
};

// The sums of kLanes output elements of one row of C, in consecutive columns, side by side: each
// step is a loop over the lanes, which the CPU's compiler turns into vector instructions (CUDA
// runs one lane per thread). kSub: the accumulator's RoundParams::subnormal_exponent. kDir:
// LaneForm::InMode's direction.
template <RoundKind Kind, bool kSub, int kLanes, LaneForm kForm = LaneForm::Bits, class Blocks = PhiloxLaneBlocks,
          Direction kDir = Direction::Fpu>
struct AccumulateLanes {
  static_assert(kForm != LaneForm::ByAddition || (Kind == RoundKind::Nearest && !kSub),
                "nearest by addition: AccumulateParams::by_addition");
  static_assert(kForm != LaneForm::InMode || (Kind != RoundKind::Nearest && !kSub),
                "in the rounding mode: AccumulateParams::in_mode");
  const AccumulateParams& p;
  AccumulateCounts& counts;
  uint64_t seed;
  // Stochastic: lane l's i-th draw is word w_l + i of the stream, w_l = (first_element + l) ·
  // roundings per element (docs/design.md §10), in block offset + (w_l + i) / 4. Each four draws
  // 4j .. 4j + 3 of a lane lie in its blocks first_block + j and + j + 1 (from word `phase` of
  // the first on), so every lane takes one new block per four draws, all lanes at once and
  // without branches per lane.
  uint64_t first_block[kLanes];
  uint32_t phase[kLanes];
  uint32_t current[4][kLanes], next[4][kLanes];  // blocks first_block + j and + j + 1
  uint32_t window[4][kLanes];                    // each lane's draws 4j .. 4j + 3
  int64_t draws = 0;
  bool aligned = true;  // every lane's first word is a block's first: the window is one block
  const uint64_t smallest_normal;  // the bits of 2^emin, the accumulator's smallest normal value

  LOWFP_HD AccumulateLanes(const AccumulateParams& params, AccumulateCounts& c, uint64_t s, uint64_t offset,
                           uint64_t first_element, int64_t k)
      : p(params), counts(c), seed(s), smallest_normal(uint64_t(params.acc.emin + 1023) << 52) {
    if constexpr (Kind == RoundKind::Stochastic) {
      const uint64_t per = uint64_t(accumulate_roundings(params, k));
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t word = (first_element + uint64_t(l)) * per;
        first_block[l] = offset + word / 4;
        phase[l] = uint32_t(word % 4);
        aligned &= phase[l] == 0;
      }
    }
  }

  // Draws 4j .. 4j + 3 of every lane into window.
  LOWFP_HD void refill(int64_t j) {
    uint64_t b[kLanes];
    if (aligned) {
      for (int l = 0; l < kLanes; ++l) b[l] = first_block[l] + uint64_t(j);
      Blocks::fill(seed, b, window);
      return;
    }
    if (j == 0) {
      for (int l = 0; l < kLanes; ++l) b[l] = first_block[l];
      Blocks::fill(seed, b, current);
    } else {
      for (int w = 0; w < 4; ++w)
        for (int l = 0; l < kLanes; ++l) current[w][l] = next[w][l];
    }
    for (int l = 0; l < kLanes; ++l) b[l] = first_block[l] + uint64_t(j) + 1;
    Blocks::fill(seed, b, next);
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < kLanes; ++l) {
        uint32_t v = current[i][l];
        for (int q = 1; q < 4; ++q) {  // word phase + i of the two blocks side by side
          const int at = i + q;
          v = select(phase[l] == uint32_t(q), at < 4 ? current[at][l] : next[at - 4][l], v);
        }
        window[i][l] = v;
      }
  }

  // Each lane's next random word (0 unless stochastic).
  LOWFP_HD void draw(uint32_t (&r)[kLanes]) {
    if constexpr (Kind == RoundKind::Stochastic) {
      const int i = int(draws % 4);
      if (i == 0) refill(draws / 4);
      for (int l = 0; l < kLanes; ++l) r[l] = window[i][l];
      ++draws;
    } else {
      for (int l = 0; l < kLanes; ++l) r[l] = 0u;
    }
  }

  // out = round_E(v) lane by lane (v: exact, or a sum rounded to odd); with `addend`, an addition
  // whose addend that is: swamped when nonzero and out equals `before` bit for bit.
  LOWFP_HD void round(double* out, const double* v, const double* before, const double* addend) {
    uint32_t r[kLanes];
    draw(r);
    const auto value = [&](int l) { return v[l]; };
    if constexpr (kForm != LaneForm::Bits || kLanes < 64) {
      round_lanes<false>(out, value, before, addend, r);
    } else {
      // Every value 0 or at least the format's smallest normal 2^emin (carrier infinities and
      // NaNs included): each then drops the same normal_drop bits, which round_bits' fixed-drop
      // form gives with a shift by one count. (Only for the widest lanes: with 8 lanes, or one
      // per GPU thread, the two forms side by side measured slower than the general one alone.)
      uint64_t below = 0;
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t a = bit_cast<uint64_t>(v[l]) & ~(uint64_t(1) << 63);
        below |= uint64_t(a != 0) & uint64_t(a < smallest_normal);
      }
      if (below == 0) round_lanes<true>(out, value, before, addend, r);
      else round_lanes<false>(out, value, before, addend, r);
    }
  }
  // One lane (a GPU thread; the CPU's last columns) by addition or in the rounding mode, where a
  // branch costs nothing across lanes: a value v in [2^emin, 2^E) rounds with no event and its
  // constant c needs no clamp, so the rounding is its additions alone (round_nearest_by_addition's
  // and round_in_mode's results there; for nearest, c carries v's sign: RN is symmetric). Other
  // values (zeros, the smallest and largest binades, infinities, NaNs) take the general form,
  // whose result replaces the first (one register for both on a GPU).
  LOWFP_HD void round_one(double* out, double v, const double* before, const double* addend, uint32_t rand) {
    const uint64_t x = bit_cast<uint64_t>(v);
    const uint32_t hi = uint32_t(x >> 32);
    uint64_t q;
    if constexpr (kForm == LaneForm::ByAddition) {
      const double c = bit_cast<double>(uint64_t((hi & 0xfff00000u) + p.drop_field) << 32);
      q = bit_cast<uint64_t>((v + c) - c);
    } else {
      q = value_in_mode<Kind, kDir>(x, uint64_t((hi & 0x7ff00000u) + p.drop_field) << 32, p.acc, rand);
    }
    if ((hi & 0x7ff00000u) - p.quiet_field >= p.quiet_span) {
      RoundEvents ev;
      if constexpr (kForm == LaneForm::ByAddition) q = round_nearest_by_addition(x, p.acc, p.add_cap, ev);
      else q = round_in_mode<Kind, kDir>(x, p.acc, p.add_cap, rand, ev);
      counts.overflow += ev.overflow();
      counts.underflow += ev.underflow;
      counts.nan += ev.nan;
    }
    counts.swamped += int64_t(addend != nullptr && addend[0] != 0.0 && q == bit_cast<uint64_t>(before[0]));
    counts.roundings += 1;
    out[0] = bit_cast<double>(q);
  }
  // value(l): lane l's value to round.
  template <bool kFixed, class Value>
  LOWFP_HD void round_lanes(double* out, const Value& value, const double* before, const double* addend,
                            const uint32_t (&rand)[kLanes]) {
    if constexpr (kForm != LaneForm::Bits && kLanes == 1) round_one(out, value(0), before, addend, rand[0]);
    else round_general<kFixed>(out, value, before, addend, rand);
  }
  template <bool kFixed, class Value>
  LOWFP_HD void round_general(double* out, const Value& value, const double* before, const double* addend,
                              const uint32_t (&rand)[kLanes]) {
    // (local arrays, which nothing else points to: the lane loop then vectorises)
    double in[kLanes], q[kLanes], was[kLanes], added[kLanes];
    uint32_t r[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      in[l] = value(l);
      r[l] = rand[l];
      was[l] = before != nullptr ? before[l] : 0.0;
      added[l] = addend != nullptr ? addend[l] : 0.0;
    }
    int64_t over = 0, under = 0, nan = 0, swamped = 0;
    for (int l = 0; l < kLanes; ++l) {
      RoundEvents ev;
      if constexpr (kForm == LaneForm::ByAddition)
        q[l] = bit_cast<double>(round_nearest_by_addition(bit_cast<uint64_t>(in[l]), p.acc, p.add_cap, ev));
      else if constexpr (kForm == LaneForm::InMode)
        q[l] = bit_cast<double>(round_in_mode<Kind, kDir>(bit_cast<uint64_t>(in[l]), p.acc, p.add_cap, r[l], ev));
      else if constexpr (kFixed)
        q[l] = bit_cast<double>(round_bits<Kind, uint64_t, false, true>(bit_cast<uint64_t>(in[l]), p.acc, r[l], ev));
      else
        q[l] = bit_cast<double>(round_bits<Kind, uint64_t, kSub>(bit_cast<uint64_t>(in[l]), p.acc, r[l], ev));
      swamped += int64_t(added[l] != 0.0) & int64_t(bit_cast<uint64_t>(q[l]) == bit_cast<uint64_t>(was[l]));
      over += ev.overflow();
      under += ev.underflow;
      nan += ev.nan;
    }
    for (int l = 0; l < kLanes; ++l) out[l] = q[l];
    counts.overflow += over;
    counts.underflow += under;
    counts.nan += nan;
    counts.roundings += kLanes;
    counts.swamped += swamped;
  }
  // out = round_E(x + y), counting a swamped addition
  LOWFP_HD void add(double* out, const double* x, const double* y) {
    const auto sum = [&](int l) {
      if constexpr (kForm == LaneForm::InMode) return sum_in_mode<Kind, kDir>(x[l], y[l]);
      else return sum_to_odd(x[l], y[l]);
    };
    if constexpr (kForm == LaneForm::Bits && kLanes >= 64) {  // (round chooses the form per step)
      double v[kLanes];
      for (int l = 0; l < kLanes; ++l) v[l] = sum(l);
      round(out, v, x, y);
    } else {  // (the sums straight into the rounding's lane loop)
      uint32_t r[kLanes];
      draw(r);
      round_lanes<false>(out, sum, x, y, r);
    }
  }
  // out = round_E(x - y), no swamping counted (Kahan's corrections)
  LOWFP_HD void sub(double* out, const double* x, const double* y) {
    double v[kLanes];
    for (int l = 0; l < kLanes; ++l) v[l] = sum_to_odd(x[l], -y[l]);
    round(out, v, nullptr, nullptr);
  }
};

// v rounded to nearest by q (products' and outer sums' formats), counted; by addition when
// add_cap > 0 (nearest_by_addition(q, add_cap) holds: the same results).
template <int kLanes>
LOWFP_HD void round_nearest_lanes(double* out, const double* v, const RoundParams<uint64_t>& q, int32_t add_cap,
                                  AccumulateCounts& counts) {
  int64_t over = 0, under = 0, nan = 0;
  auto lanes = [&](auto form) {  // (the choice made once, outside the lane loop)
    constexpr int kForm = decltype(form)::value;  // 0: general, 1: with subnormal exponents, 2: by addition
    double in[kLanes], r[kLanes];
    for (int l = 0; l < kLanes; ++l) in[l] = v[l];
    for (int l = 0; l < kLanes; ++l) {
      RoundEvents ev;
      if constexpr (kForm == 2)
        r[l] = bit_cast<double>(round_nearest_by_addition(bit_cast<uint64_t>(in[l]), q, add_cap, ev));
      else
        r[l] = bit_cast<double>(round_bits<RoundKind::Nearest, uint64_t, kForm == 1>(bit_cast<uint64_t>(in[l]), q, 0u, ev));
      over += ev.overflow();
      under += ev.underflow;
      nan += ev.nan;
    }
    for (int l = 0; l < kLanes; ++l) out[l] = r[l];
  };
  if (add_cap > 0) lanes(std::integral_constant<int, 2>{});
  else if (q.subnormal_exponent) lanes(std::integral_constant<int, 1>{});
  else lanes(std::integral_constant<int, 0>{});
  counts.overflow += over;
  counts.underflow += under;
  counts.nan += nan;
  counts.roundings += kLanes;
}

// The blocked order's outer sum: out = round_outer(out + inner) lane by lane, nearest, counted
// (an addition of a nonzero block sum that leaves out as it was is swamped).
template <int kLanes>
LOWFP_HD void add_block_sum(double (&out)[kLanes], const double (&inner)[kLanes], const AccumulateParams& p,
                            AccumulateCounts& counts) {
  double v[kLanes], next[kLanes];
  for (int l = 0; l < kLanes; ++l) v[l] = sum_to_odd(out[l], inner[l]);
  round_nearest_lanes<kLanes>(next, v, p.outer, 0, counts);
  int64_t swamped = 0;
  for (int l = 0; l < kLanes; ++l) {
    swamped += int64_t(inner[l] != 0.0) & int64_t(bit_cast<uint64_t>(next[l]) == bit_cast<uint64_t>(out[l]));
    out[l] = next[l];
  }
  counts.swamped += swamped;
}

// A fused group of n products added to s (docs/design.md §10), lane l's i-th of them
// a[i sa] · b[i sb + l sl]: every term, s and each product (its exponent the sum of its
// operands'), cut toward zero to a multiple of 2^(E - align_bits), E the largest exponent among
// them; their exact sum rounded once by acc (an AccumulateLanes).
template <class Lanes, int kLanes, class In>
LOWFP_HD void add_fused_group(Lanes& acc, const AccumulateParams& p, const In* a, int64_t sa, const In* b, int64_t sb,
                              int64_t sl, int64_t n, double (&s)[kLanes]) {
  double v[kLanes], ip[kLanes];
  int32_t e_max[kLanes];
  bool any[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    e_max[l] = aligned_exponent(s[l], -126);  // (the sum: a float32 value)
    any[l] = false;
  }
  const In* a_k = a;
  const In* b_k = b;
  for (int64_t k = 0; k < n; ++k, a_k += sa, b_k += sb) {
    const int32_t ex = aligned_exponent(bit_cast<double>(Widen<uint64_t>::from(*a_k)), p.operand_emin);
    for (int l = 0; l < kLanes; ++l) {
      const double y = bit_cast<double>(Widen<uint64_t>::from(b_k[l * sl]));
      e_max[l] = max_of(e_max[l], ex + aligned_exponent(y, p.operand_emin));
    }
  }
  double up[kLanes];  // 2^(align_bits - E): the aligned sum is in units of 2^(E - align_bits)
  for (int l = 0; l < kLanes; ++l) {
    up[l] = exact_pow2(p.align_bits - e_max[l]);
    v[l] = trunc_of(s[l] * up[l]);
    ip[l] = s[l];  // (the IEEE sum, for a group with an infinity or a NaN)
  }
  a_k = a;
  b_k = b;
  for (int64_t k = 0; k < n; ++k, a_k += sa, b_k += sb) {
    const double x = bit_cast<double>(Widen<uint64_t>::from(*a_k));
    for (int l = 0; l < kLanes; ++l) {
      const double q = x * bit_cast<double>(Widen<uint64_t>::from(b_k[l * sl]));  // exact
      v[l] += trunc_of(q * up[l]);  // (exact: integers below 2^53)
      ip[l] += q;
      any[l] |= q != 0.0;
    }
  }
  double sum[kLanes], before[kLanes], added[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    // (the IEEE sum is infinite or NaN exactly when a term is: finite terms cannot overflow it)
    const bool special = !(ip[l] - ip[l] == 0.0);
    sum[l] = special ? ip[l] : v[l] * exact_pow2(e_max[l] - p.align_bits);
    before[l] = s[l];
    added[l] = any[l] ? 1.0 : 0.0;
  }
  acc.round(s, sum, before, added);
}

// kLanes output elements: lane l sums K products a[k·sa] · b[k·sb + l·sl] as the params say
// (docs/design.md §10), into out[l]; element first_element + l of the output (its stochastic
// words); the roundings counted into counts. kForm: by_addition or in_mode, else Bits. Blocks:
// the stochastic words' generator (PhiloxLaneBlocks). kDir: InMode's direction (Direction).
template <RoundKind Kind, bool kSub, int kLanes, LaneForm kForm = LaneForm::Bits, class Blocks = PhiloxLaneBlocks,
          Direction kDir = Direction::Fpu, class In>
LOWFP_HD void accumulate_lanes(const AccumulateParams& p, const In* a, int64_t sa, const In* b, int64_t sb,
                               int64_t sl, int64_t K, uint64_t seed, uint64_t offset,
                               uint64_t first_element, double (&out)[kLanes], AccumulateCounts& counts) {
  AccumulateLanes<Kind, kSub, kLanes, kForm, Blocks, kDir> acc(p, counts, seed, offset, first_element, K);
  // (in_mode_form leaves out products' formats, fused groups, Kahan's corrections and the blocked
  // order: folded away here, so that its loops hold none of their branches)
  constexpr bool kAny = kForm != LaneForm::InMode;
  // The products of step k, whose operands are at a_k = a + k sa and b_k = b + k sb (pointers the
  // loops step, where an index times a stride would be a 64-bit multiply per step on a GPU)
  auto product = [&](const In* a_k, const In* b_k, double (&q)[kLanes]) {
    const double x = bit_cast<double>(Widen<uint64_t>::from(*a_k));
    for (int l = 0; l < kLanes; ++l)
      q[l] = x * bit_cast<double>(Widen<uint64_t>::from(b_k[l * sl]));  // (exact: 48 bits)
    if (kAny && p.has_product) round_nearest_lanes<kLanes>(q, q, p.product, p.product_add_cap, counts);
  };
  auto fused_group = [&](int64_t k0, int64_t k1, double (&s)[kLanes]) {
    add_fused_group(acc, p, a + k0 * sa, sa, b + k0 * sb, sb, sl, k1 - k0, s);
  };
  // Sequential sums of products [k0, k1) from +0 into s, compensated or not, or in fused groups
  auto sequential = [&](int64_t k0, int64_t k1, double (&s)[kLanes]) {
    double c[kLanes], q[kLanes], y[kLanes], t[kLanes], d[kLanes];
    for (int l = 0; l < kLanes; ++l) s[l] = c[l] = 0.0;
    if (kAny && p.group > 0) {
      for (int64_t g = k0; g < k1; g += p.group) fused_group(g, min_of(k1, g + p.group), s);
      return;
    }
    const In* a_k = a + k0 * sa;
    const In* b_k = b + k0 * sb;
    for (int64_t k = k0; k < k1; ++k, a_k += sa, b_k += sb) {
      product(a_k, b_k, q);
      if (kAny && p.compensated) {
        acc.sub(y, q, c);  // y = round(p - c)
        acc.add(t, s, y);  // t = round(s + y)
        acc.sub(d, t, s);  // c = round(round(t - s) - y)
        acc.sub(c, d, y);
        for (int l = 0; l < kLanes; ++l) s[l] = t[l];
      } else {
        acc.add(s, s, q);
      }
    }
  };
  if (p.order == AccumulateOrder::Sequential) {
    sequential(0, K, out);
    return;
  }
  if (kAny && p.order == AccumulateOrder::Blocked) {
    double inner[kLanes];
    for (int l = 0; l < kLanes; ++l) out[l] = 0.0;
    for (int64_t k0 = 0; k0 < K; k0 += p.block) {
      sequential(k0, min_of(K, k0 + p.block), inner);
      add_block_sum<kLanes>(out, inner, p, counts);
    }
    return;
  }
  // Pairwise, as a binary counter: the leaves in order, two subtrees of equal size merged as
  // soon as both exist, the rest merged from the right at the end (the roundings in post-order).
  // The tree depends on K only, so every lane merges at the same steps.
  constexpr int kDepth = 64;
  double value[kDepth][kLanes];
  int64_t size[kDepth];
  int depth = 0;
  const In* a_k = a;
  const In* b_k = b;
  for (int64_t k = 0; k < K; ++k, a_k += sa, b_k += sb) {
    double q[kLanes];
    product(a_k, b_k, q);
    acc.round(value[depth], q, nullptr, nullptr);
    size[depth++] = 1;
    while (depth >= 2 && size[depth - 1] == size[depth - 2]) {
      acc.add(value[depth - 2], value[depth - 2], value[depth - 1]);
      size[depth - 2] *= 2;
      --depth;
    }
  }
  while (depth >= 2) {
    acc.add(value[depth - 2], value[depth - 2], value[depth - 1]);
    --depth;
  }
  for (int l = 0; l < kLanes; ++l) out[l] = depth == 1 ? value[0][l] : 0.0;
}

}  // namespace

}  // namespace lowfp
