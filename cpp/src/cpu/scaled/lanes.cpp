// ScaledStrategy::Lanes: Narrow's float32 carrier for float32 inputs rounded to nearest by
// addition or stochastically by steps, without q, written lane by lane in vectors of 16.
#include "scaled/tile.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// One tile, in GCC vectors of 16 lanes: round.hpp's magnitude_by_addition (nearest) or
// round_stochastic_by_steps (stochastic, where ScaledCall::steps32 holds) and rounded_result,
// lane by lane, so that kCount's events come from the masks the rounding computes anyway (no
// per-lane counters in memory, no separate counting pass). kBlock 16 or 32: each block's 2^±k
// broadcast (the tile starts a block); 0: from the per-element buffers (place32). A ragged end is
// padded with zeros, which count nothing. (The stochastic lanes repeat round_stochastic_by_steps'
// formula on GCC vectors, whose comparisons give masks, not the header's bools.)
// kSignedZero: E has -0 (RoundParams::no_negative_zero false); kInfStays: inf_stays_inf.
template <RoundKind Kind, bool kCount, bool kSignedZero, bool kInfStays, int64_t kBlock>
void run_tile(const ScaledCall& c, const Tile& k, const TileScales& t,
              EventCounts& counts) {
  const int64_t first = k.first, n = k.len;
  static_assert(Kind == RoundKind::Nearest || Kind == RoundKind::Stochastic, "nearest or stochastic");
  using C = CarrierTraits<uint32_t>;
  using Ints16 = int32_t __attribute__((vector_size(64)));
  const float* x = static_cast<const float*>(c.x) + first;
  float* y = static_cast<float*>(c.y) + first;
  const RoundParams<uint32_t>& p = c.p32;
  const Lanes16 magnitude = Lanes16{} + ~C::kSign, sign_bit = Lanes16{} + C::kSign,
                inf = Lanes16{} + C::kInf,
                max_bits = Lanes16{} + p.max_bits, over_pos = Lanes16{} + p.overflow_pos,
                over_neg = Lanes16{} + p.overflow_neg;
  // magnitude_by_addition's exponent clamp and step, on biased exponent fields
  const Lanes16 e_low = Lanes16{} + uint32_t(p.emin + C::kExpBias),
                e_high = Lanes16{} + uint32_t(c.addition_cap + C::kExpBias),
                drop = Lanes16{} + uint32_t(p.normal_drop);
  // round_stochastic_by_steps' constants (ScaledCall::steps32)
  const int32_t m = C::kMantBits - p.normal_drop;
  const Ints16 drop_at_zero = Ints16{} + (p.normal_drop + p.emin + C::kExpBias),
               normal_drop = Ints16{} + p.normal_drop, max_shift = Ints16{} + C::kMaxShift,
               mant_bits = Ints16{} + C::kMantBits, thirty_two = Ints16{} + 32;
  const Lanes16 low_bits = Lanes16{} + ((1u << p.sr_shift) - 1u), below_step = Lanes16{} + p.below_step,
                below_max = below_step - 1u;
  const Floats16 to_fraction = Floats16{} + bit_cast<float>(uint32_t(C::kExpBias + 32 + m - p.emin) << C::kMantBits);
  LaneTally above, under, nans;
  auto vector = [&](const float* src, float* dst, const uint32_t* rand, const Floats16& s,
                    const Floats16& inv) {
    Floats16 xv;
    std::memcpy(&xv, src, sizeof xv);
    const Lanes16 xb = bit_cast<Lanes16>(xv);
    Lanes16 q = bit_cast<Lanes16>(xv * inv);  // exact, or below 2^-126 (ScaledCall::narrow)
    Lanes16 mag;
    if constexpr (Kind == RoundKind::Nearest) {
      const Lanes16 a = q & magnitude;
      Lanes16 e = a >> C::kMantBits;
      e = e < e_low ? e_low : e;
      e = e > e_high ? e_high : e;
      const Floats16 step = bit_cast<Floats16>((e + drop) << C::kMantBits);
      mag = bit_cast<Lanes16>((bit_cast<Floats16>(a) + step) - step);
    } else {
      // A quotient that underflowed to 0 stays nonzero (nonzero_quotient, in lanes)
      q = (q << 1) == 0u ? ((xb << 1) != 0u ? (xb & sign_bit) | 1u : q) : q;
      const Lanes16 a = q & magnitude;
      Lanes16 rw;
      std::memcpy(&rw, rand, sizeof rw);
      const Ints16 ex = Ints16(a >> C::kMantBits);
      const Ints16 d = drop_at_zero - ex < normal_drop ? normal_drop : drop_at_zero - ex;
      const Lanes16 r = rw | low_bits;
      const Lanes16 dm = Lanes16(d < max_shift ? d : max_shift);
      const Ints16 noise_shift = thirty_two - d;
      const Lanes16 noise = ~r >> Lanes16(noise_shift < 0 ? Ints16{} : noise_shift);
      const Lanes16 stepped = ((a + noise) >> dm) << dm;
      const Lanes16 below = __builtin_convertvector(
          bit_cast<Floats16>(a < below_step ? a : below_max) * to_fraction, Lanes16);
      mag = d <= mant_bits ? stepped : (r < below ? below_step : Lanes16{});
    }
    // rounded_result. (Each mask written where it is used: GCC then keeps it in a mask register,
    // where a named vector of it made a vector and compared it again at every use.)
    const Lanes16 a = q & magnitude, sign = q & sign_bit;
    Lanes16 rounded = mag | sign;
    if constexpr (!kSignedZero) rounded = mag == 0u ? mag : rounded;
    Lanes16 overflowed = sign != 0u ? over_neg : over_pos;
    if constexpr (kInfStays) overflowed = a == inf ? q : overflowed;
    // (mag > max_bits: overflow, or NaN)
    const Lanes16 r = a > inf ? q : (mag > max_bits ? overflowed : rounded);
    const Floats16 out = bit_cast<Floats16>(r) * s;  // exact (ScaledCall::narrow)
    std::memcpy(dst, &out, sizeof out);
    if constexpr (kCount) {
      above.greater(mag, max_bits);
      nans.greater(a, inf);
      // a nonzero x whose result is 0 (its quotient may have underflowed to 0 already)
      under.zero_where_nonzero(mag, xb);
    }
  };
  auto padded = [&](int64_t i, int64_t stop, const Floats16& s, const Floats16& inv) {
    alignas(64) float in[16] = {}, out[16];
    alignas(64) uint32_t rand[16] = {};
    std::memcpy(in, x + i, sizeof(float) * size_t(stop - i));
    if constexpr (Kind == RoundKind::Stochastic)
      std::memcpy(rand, t.rand + i, sizeof(uint32_t) * size_t(stop - i));
    vector(in, out, rand, s, inv);
    std::memcpy(y + i, out, sizeof(float) * size_t(stop - i));
  };
  if constexpr (kBlock > 0) {
    static_assert(kBlock % 16 == 0, "whole vectors per block");
    const int64_t whole = n / kBlock;
    for (int64_t b = 0; b < whole; ++b) {
      const Floats16 s = Floats16{} + t.block_s32[b], inv = Floats16{} + t.block_inv32[b];
      for (int64_t i = b * kBlock; i < (b + 1) * kBlock; i += 16) vector(x + i, y + i, t.rand + i, s, inv);
    }
    if (whole * kBlock < n) {  // a ragged last block
      const Floats16 s = Floats16{} + t.block_s32[whole], inv = Floats16{} + t.block_inv32[whole];
      for (int64_t i = whole * kBlock; i < n; i += 16) padded(i, min_of(i + 16, n), s, inv);
    }
  } else {
    const float* s32 = t.s32_buf + t.at32;
    const float* inv32 = t.inv32_buf + t.at32;
    auto at = [](const float* v, int64_t i, int64_t stop) {
      alignas(64) float lanes[16] = {};
      std::memcpy(lanes, v + i, sizeof(float) * size_t(stop - i));
      Floats16 f;
      std::memcpy(&f, lanes, sizeof f);
      return f;
    };
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      Floats16 s, inv;
      std::memcpy(&s, s32 + i, sizeof s);
      std::memcpy(&inv, inv32 + i, sizeof inv);
      vector(x + i, y + i, t.rand + i, s, inv);
    }
    if (i < n) padded(i, n, at(s32, i, n), at(inv32, i, n));
  }
  if constexpr (kCount) {
    counts.overflow += above.total() - nans.total();  // (see RoundEvents)
    counts.underflow += under.total();
    counts.nan += nans.total();
  }
}

}  // namespace

void scaled_lanes(const ScaledCall& c, int64_t r0, int64_t r1,
                  EventCounts& counts) {
  TileScales t;
  const RoundKind kind = round_kind(c.mode);
  auto go = [&](auto kind_c) {
    constexpr RoundKind K = decltype(kind_c)::value;
    with_flag(c.count, [&](auto count) {
      with_flag(!c.p32.no_negative_zero, [&](auto signed_zero) {
        with_flag(c.p32.inf_stays_inf, [&](auto stays) {
          constexpr bool kC = decltype(count)::value, kZ = decltype(signed_zero)::value,
                         kS = decltype(stays)::value;
          const auto run = c.block_cols == 32   ? run_tile<K, kC, kZ, kS, 32>
                           : c.block_cols == 16 ? run_tile<K, kC, kZ, kS, 16>
                                                : run_tile<K, kC, kZ, kS, 0>;
          for_each_tile(c, r0, r1, [&](const Tile& k) {
            t.place32(static_cast<float*>(c.y) + k.first);
            block_forms<true>(k, 1.0, t);  // (2^±k: exact)
            if (c.block_cols != 16 && c.block_cols != 32) spread32(c, k, t);
            if constexpr (K == RoundKind::Stochastic) draw_words(c, k, t);
            run(c, k, t, counts);
          });
        });
      });
    });
  };
  // (the vector loop rounds to nearest by addition, or stochastically: plan.cpp)
  if (kind == RoundKind::Stochastic) go(Kind<RoundKind::Stochastic>{});
  else go(Kind<RoundKind::Nearest>{});
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
