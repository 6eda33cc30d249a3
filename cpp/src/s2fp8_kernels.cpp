// The S2FP8 loops (DESIGN §4), compiled once per instruction-set level like quantize_kernels.cpp:
// the reduction over log2|x| and the element transform, both the shared math of
// cpp/include/lowfp/s2fp8.hpp in plain loops the compiler vectorises.
#include "dispatch.hpp"
#include "lowfp/s2fp8.hpp"
#include "philox_lanes.hpp"
#include "quantize_cpu.hpp"

#ifndef LOWFP_ISA_NS
#error "compile with -DLOWFP_ISA_NS=<namespace>"
#endif

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

template <class In>
void reduce(const In* x, int64_t begin, int64_t end, S2fp8Partial& total) {
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t len = min_of(kTile, end - t0);
    S2fp8Partial tile;  // low stays below kTile * 2^32 within a tile
    for (int64_t i = 0; i < len; ++i)
      tile.add(Widen<uint64_t>::from(x[t0 + i]) & ~kF64SignBit);
    tile.carry();
    total.high += tile.high;
    total.low += tile.low;
    total.carry();
    total.count += tile.count;
    total.max_abs = max_of(total.max_abs, tile.max_abs);
  }
}

// Rounds a tile of Y values in place in their carrier (Bits), adding the events to counts when
// kCount. rand: one Philox word per element, read only for stochastic rounding. The counters
// have the carrier's width so that the loop vectorises in its lanes.
template <RoundKind Kind, class Bits, bool kSubExp, bool kCount>
void round_tile(Bits* v, int64_t len, const RoundParams<Bits>& p, const uint32_t* rand,
                EventCounts& counts) {
  Bits above_max = 0, underflow = 0, nan = 0;
  for (int64_t i = 0; i < len; ++i) {
    RoundEvents ev;
    const uint32_t r = Kind == RoundKind::Stochastic ? rand[i] : 0u;
    v[i] = round_bits<Kind, Bits, kSubExp>(v[i], p, r, ev);
    if constexpr (kCount) {
      above_max += Bits(ev.above_max);
      underflow += Bits(ev.underflow);
      nan += Bits(ev.nan);
    }
  }
  counts.overflow += int64_t(above_max) - int64_t(nan);  // see RoundEvents
  counts.underflow += int64_t(underflow);
  counts.nan += int64_t(nan);
}

template <class T, RoundKind Kind, bool kCount, bool kSubExp>
void transform(const S2fp8Call& c, const S2fp8Stats& s, int64_t begin, int64_t end,
               EventCounts& counts) {
  const T* x = static_cast<const T*>(c.q.x);
  T* y = static_cast<T*>(c.q.y);
  const RoundParams<uint64_t>& p = c.q.p64;
  const double inv_alpha = 1.0 / s.alpha;
  alignas(64) uint32_t rand[kTile];
  alignas(64) uint64_t y_bits[kTile];
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t len = min_of(kTile, end - t0);
    if constexpr (Kind == RoundKind::Stochastic)
      philox_fill(rand, c.q.seed, c.q.offset + uint64_t(t0) / 4, (len + 3) / 4);
    const T* xt = x + t0;
    for (int64_t i = 0; i < len; ++i)  // vectorised
      y_bits[i] = s2fp8_squeeze(Widen<uint64_t>::from(xt[i]), s);
    // scalar: gcc does not vectorise the 64-bit per-lane shifts
    round_tile<Kind, uint64_t, kSubExp, kCount>(y_bits, len, p, rand, counts);
    T* yt = y + t0;  // may alias xt: element i is read before it is written
    for (int64_t i = 0; i < len; ++i)  // vectorised
      yt[i] = s2fp8_store<T>(s2fp8_unsqueeze(Widen<uint64_t>::from(xt[i]), y_bits[i], s, inv_alpha),
                             c.p_store);
  }
}

// The bits of +inf in each storage type.
template <class T> constexpr RawOf<T> kInfBits = 0;
template <> constexpr uint16_t kInfBits<Half> = 0x7C00;
template <> constexpr uint16_t kInfBits<BFloat> = 0x7F80;
template <> constexpr uint32_t kInfBits<float> = 0x7F800000u;
template <> constexpr uint64_t kInfBits<double> = kF64ExpMask;

// The third loop of transform_narrow: x' from the table, x kept where the table has no answer
// (redo[i] != 0 marks elements for the float64 path). The restrict qualifiers tell the compiler
// that storing y cannot change the table, which lets it vectorise the lookups as gathers; x and
// y may be the same buffer.
template <class T, class Raw = RawOf<T>>
Raw lookup_x_new(const T* xt, Raw* yt, const uint32_t* __restrict y32, const Raw* __restrict table,
                 const S2fp8Table& tab, int64_t len, Raw* __restrict redo) {
  constexpr int kRawBits = 8 * sizeof(Raw);
  constexpr Raw kSign = Raw(Raw(1) << (kRawBits - 1));
  const uint32_t first = tab.first, shift = tab.shift, last = tab.size - 1;
  Raw redo_any = 0;
  for (int64_t i = 0; i < len; ++i) {  // vectorised (a gather) for float32 x
    const Raw x_raw = bit_cast<Raw>(xt[i]);
    const Raw x_abs = Raw(x_raw & ~kSign);
    const Raw y_sign = Raw(Raw(y32[i] >> 31) << (kRawBits - 1));
    const uint32_t y_abs = y32[i] & 0x7FFFFFFFu;
    const uint32_t k = min_of((y_abs >> shift) - first, last);
    const Raw from_table = select(y_abs == 0, y_sign, Raw(table[k] | (x_raw & kSign)));
    // x infinite or NaN, or Y rounded to infinity or NaN (overflow policies inf and nan)
    const Raw bad = Raw(x_abs >= kInfBits<T>) | (Raw(x_abs != 0) & Raw(y_abs >= 0x7F800000u));
    yt[i] = select((x_abs == 0) | (bad != 0), x_raw, from_table);
    redo[i] = bad;
    redo_any |= bad;
  }
  return redo_any;
}

// The float32 path (call.narrow, with a table): Y rounded to odd into float32 and to the format in
// the float32 carrier, both vectorised, and x' read from the table; the same bits and events as
// transform(). x = 0 gives x' = x and Y rounded to 0 a zero with Y's sign, as there. The rare
// rest (x infinite or NaN, Y rounded to infinity or NaN) keeps x's bits in the third loop and is
// redone by the float64 path in a fourth, which only runs for tiles that have any.
template <class T, RoundKind Kind, bool kCount, bool kSubExp>
void transform_narrow(const S2fp8Call& c, const S2fp8Stats& s, const S2fp8Table& tab, int64_t begin,
                      int64_t end, EventCounts& counts) {
  using Raw = RawOf<T>;
  const T* x = static_cast<const T*>(c.q.x);
  T* y = static_cast<T*>(c.q.y);
  const Raw* table = static_cast<const Raw*>(tab.entries);
  const RoundParams<uint32_t>& p = c.q.p32;
  const double inv_alpha = 1.0 / s.alpha;
  alignas(64) uint32_t y32[kTile];
  alignas(64) Raw redo[kTile];
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t len = min_of(kTile, end - t0);
    const T* xt = x + t0;
    for (int64_t i = 0; i < len; ++i)  // vectorised
      y32[i] = s2fp8_to_odd_f32(s2fp8_squeeze(Widen<uint64_t>::from(xt[i]), s));
    round_tile<Kind, uint32_t, false, kCount>(y32, len, p, nullptr, counts);  // vectorised
    Raw* yt = reinterpret_cast<Raw*>(y + t0);  // may alias xt: element i is read before it is written
    const Raw redo_any = lookup_x_new(xt, yt, y32, table, tab, len, redo);
    if (redo_any != 0) {
      T* yt_t = y + t0;
      for (int64_t i = 0; i < len; ++i) {
        if (!redo[i]) continue;
        RoundEvents ignored;  // counted above
        const uint64_t xb = Widen<uint64_t>::from(xt[i]);
        const uint64_t r = round_bits<Kind, uint64_t, kSubExp>(s2fp8_squeeze(xb, s), c.q.p64, 0u, ignored);
        yt_t[i] = s2fp8_store<T>(s2fp8_unsqueeze(xb, r, s, inv_alpha), c.p_store);
      }
    }
  }
}

}  // namespace

void s2fp8_reduce_range(const S2fp8Call& c, int64_t begin, int64_t end, S2fp8Partial& part) {
  switch (c.q.x_dtype) {
    case DType::Float16: return reduce(static_cast<const Half*>(c.q.x), begin, end, part);
    case DType::BFloat16: return reduce(static_cast<const BFloat*>(c.q.x), begin, end, part);
    case DType::Float32: return reduce(static_cast<const float*>(c.q.x), begin, end, part);
    case DType::Float64: return reduce(static_cast<const double*>(c.q.x), begin, end, part);
  }
}

void s2fp8_transform_range(const S2fp8Call& c, const S2fp8Stats& s, const S2fp8Table* table,
                           int64_t begin, int64_t end, EventCounts& counts) {
  dispatch_s2fp8(c.q, [&](auto in, auto, auto, auto kind, auto count, auto sub_exp) {
    using T = typename decltype(in)::type;
    constexpr RoundKind kKind = decltype(kind)::value;
    if constexpr (kKind != RoundKind::Stochastic) {
      if (table != nullptr)
        return transform_narrow<T, kKind, decltype(count)::value, decltype(sub_exp)::value>(
            c, s, *table, begin, end, counts);
    }
    transform<T, kKind, decltype(count)::value, decltype(sub_exp)::value>(c, s, begin, end, counts);
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
