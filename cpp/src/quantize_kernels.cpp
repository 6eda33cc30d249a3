// The quantize loop, compiled once per instruction-set level (LOWFP_ISA_NS names the copy).
// Each loop body is the shared element math of cpp/include/lowfp/, inlined into a plain loop the
// compiler vectorises; the storage type, carrier, rounding kind and counting are template
// parameters so no branch on them remains inside the loop.
#include <type_traits>

#include "lowfp/half.hpp"
#include "lowfp/philox.hpp"
#include "lowfp/round.hpp"
#include "quantize_cpu.hpp"

#ifndef LOWFP_ISA_NS
#error "compile with -DLOWFP_ISA_NS=<namespace>"
#endif

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

struct Half { uint16_t v; };
struct BFloat { uint16_t v; };

template <class Bits> struct Widen;
template <> struct Widen<uint32_t> {
  static uint32_t from(Half h) { return half_to_float_bits(h.v); }
  static uint32_t from(BFloat h) { return bfloat16_to_float_bits(h.v); }
  static uint32_t from(float f) { return bit_cast<uint32_t>(f); }
};
template <> struct Widen<uint64_t> {
  static uint64_t f32(uint32_t b) { return bit_cast<uint64_t>(double(bit_cast<float>(b))); }
  static uint64_t from(Half h) { return f32(half_to_float_bits(h.v)); }
  static uint64_t from(BFloat h) { return f32(bfloat16_to_float_bits(h.v)); }
  static uint64_t from(float f) { return bit_cast<uint64_t>(double(f)); }
  static uint64_t from(double f) { return bit_cast<uint64_t>(f); }
};

// Narrowing stores only see values on the format's grid, which fits the storage type.
template <class Out> struct Store;
template <> struct Store<Half> {
  static Half from(uint32_t b) { return Half{float_bits_to_half(b)}; }
  static Half from(uint64_t b) { return from(bit_cast<uint32_t>(float(bit_cast<double>(b)))); }
};
template <> struct Store<BFloat> {
  static BFloat from(uint32_t b) { return BFloat{float_bits_to_bfloat16(b)}; }
  static BFloat from(uint64_t b) { return from(bit_cast<uint32_t>(float(bit_cast<double>(b)))); }
};
template <> struct Store<float> {
  static float from(uint32_t b) { return bit_cast<float>(b); }
  static float from(uint64_t b) { return float(bit_cast<double>(b)); }
};
template <> struct Store<double> {
  static double from(uint64_t b) { return bit_cast<double>(b); }
};

template <class In, class Out, class Bits, RoundKind Kind, bool kCount>
void run(const QuantizeCall& c, int64_t begin, int64_t end, EventCounts& counts) {
  const In* x = static_cast<const In*>(c.x);
  Out* y = static_cast<Out*>(c.y);
  RoundParams<Bits> p;
  if constexpr (std::is_same_v<Bits, uint32_t>) p = c.p32; else p = c.p64;
  alignas(64) uint32_t rand[kTile];
  int64_t overflow = 0, underflow = 0, nan = 0;
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t len = min_of(kTile, end - t0);
    if constexpr (Kind == RoundKind::Stochastic) {
      // t0 is a multiple of 4: element t0 + j uses word j % 4 of block offset + (t0 + j) / 4.
      const uint64_t block0 = c.offset + uint64_t(t0) / 4;
      const int64_t blocks = (len + 3) / 4;
      for (int64_t j = 0; j < blocks; ++j) {
        const Philox4x32Block r = philox_block(c.seed, block0 + uint64_t(j));
        rand[4 * j + 0] = r.w[0];
        rand[4 * j + 1] = r.w[1];
        rand[4 * j + 2] = r.w[2];
        rand[4 * j + 3] = r.w[3];
      }
    }
    const In* xt = x + t0;
    Out* yt = y + t0;
    // Per-tile counts in the carrier's lane width (a tile cannot overflow them): int64 sums
    // would halve the vector width of the whole loop.
    Bits tile_overflow = 0, tile_underflow = 0, tile_nan = 0;
    for (int64_t i = 0; i < len; ++i) {
      RoundEvents ev;
      const uint32_t r = Kind == RoundKind::Stochastic ? rand[i] : 0u;
      const Bits v = round_bits<Kind, Bits>(Widen<Bits>::from(xt[i]), p, r, ev);
      yt[i] = Store<Out>::from(v);
      if constexpr (kCount) {
        tile_overflow += Bits(ev.overflow);
        tile_underflow += Bits(ev.underflow);
        tile_nan += Bits(ev.nan);
      }
    }
    overflow += int64_t(tile_overflow);
    underflow += int64_t(tile_underflow);
    nan += int64_t(tile_nan);
  }
  counts.overflow += overflow;
  counts.underflow += underflow;
  counts.nan += nan;
}

template <class In, class Out, class Bits>
void run_mode(const QuantizeCall& c, int64_t b, int64_t e, EventCounts& k) {
  switch (round_kind(c.mode)) {
    case RoundKind::Nearest:
      return c.count ? run<In, Out, Bits, RoundKind::Nearest, true>(c, b, e, k)
                     : run<In, Out, Bits, RoundKind::Nearest, false>(c, b, e, k);
    case RoundKind::Directed:
      return c.count ? run<In, Out, Bits, RoundKind::Directed, true>(c, b, e, k)
                     : run<In, Out, Bits, RoundKind::Directed, false>(c, b, e, k);
    default:
      return c.count ? run<In, Out, Bits, RoundKind::Stochastic, true>(c, b, e, k)
                     : run<In, Out, Bits, RoundKind::Stochastic, false>(c, b, e, k);
  }
}

// The carrier is float64 exactly when one side is float64 (QuantizeCall::wide).
template <class In>
void run_in(const QuantizeCall& c, int64_t b, int64_t e, EventCounts& k) {
  if (c.wide) {
    switch (c.y_dtype) {
      case DType::Float16: return run_mode<In, Half, uint64_t>(c, b, e, k);
      case DType::BFloat16: return run_mode<In, BFloat, uint64_t>(c, b, e, k);
      case DType::Float32: return run_mode<In, float, uint64_t>(c, b, e, k);
      case DType::Float64: return run_mode<In, double, uint64_t>(c, b, e, k);
    }
  } else if constexpr (!std::is_same_v<In, double>) {
    switch (c.y_dtype) {
      case DType::Float16: return run_mode<In, Half, uint32_t>(c, b, e, k);
      case DType::BFloat16: return run_mode<In, BFloat, uint32_t>(c, b, e, k);
      default: return run_mode<In, float, uint32_t>(c, b, e, k);
    }
  }
}

}  // namespace

void quantize_range(const QuantizeCall& c, int64_t begin, int64_t end, EventCounts& counts) {
  switch (c.x_dtype) {
    case DType::Float16: return run_in<Half>(c, begin, end, counts);
    case DType::BFloat16: return run_in<BFloat>(c, begin, end, counts);
    case DType::Float32: return run_in<float>(c, begin, end, counts);
    case DType::Float64: return run_in<double>(c, begin, end, counts);
  }
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
