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
    uint64_t above_max = 0, underflow = 0, nan = 0;
    for (int64_t i = 0; i < len; ++i) {  // scalar: 64-bit per-lane shifts
      RoundEvents ev;
      const uint32_t r = Kind == RoundKind::Stochastic ? rand[i] : 0u;
      y_bits[i] = round_bits<Kind, uint64_t, kSubExp>(y_bits[i], p, r, ev);
      if constexpr (kCount) {
        above_max += uint64_t(ev.above_max);
        underflow += uint64_t(ev.underflow);
        nan += uint64_t(ev.nan);
      }
    }
    T* yt = y + t0;  // may alias xt: element i is read before it is written
    for (int64_t i = 0; i < len; ++i)  // vectorised
      yt[i] = s2fp8_store<T>(s2fp8_unsqueeze(Widen<uint64_t>::from(xt[i]), y_bits[i], s, inv_alpha),
                             c.p_store);
    counts.overflow += int64_t(above_max) - int64_t(nan);  // see RoundEvents
    counts.underflow += int64_t(underflow);
    counts.nan += int64_t(nan);
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

void s2fp8_transform_range(const S2fp8Call& c, const S2fp8Stats& s, int64_t begin, int64_t end,
                           EventCounts& counts) {
  dispatch_s2fp8(c.q, [&](auto in, auto, auto, auto kind, auto count, auto sub_exp) {
    transform<typename decltype(in)::type, decltype(kind)::value, decltype(count)::value,
              decltype(sub_exp)::value>(c, s, begin, end, counts);
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
