// The quantize loop, compiled once per instruction-set level (LOWFP_ISA_NS names the copy).
// Each loop body is the shared element math of cpp/include/lowfp/, inlined into a plain loop the
// compiler vectorises; the storage types, carrier, rounding kind and counting are template
// parameters (dispatch.hpp) so no branch on them remains inside the loop.
#include "isa.hpp"

#include <cstring>
#include <type_traits>

#include "dispatch.hpp"
#include "half_lanes.hpp"
#include "philox_lanes.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// float16 tiles in a float32 carrier go through float32 buffers converted by F16C (half_lanes.hpp).
template <class T, class Bits>
constexpr bool kViaFloat = kF16cTiles<T> && std::is_same_v<Bits, uint32_t>;

// What a tile's loop counts. Overflow and NaN need a magnitude above max_bits (a rounding lands
// on one of |x|'s two grid neighbours or past the largest), which few tiles hold; underflow is
// common (any distribution around zero), so:
//  - Underflow: underflows and the tile's largest magnitude, whose test after the loop says
//    whether the tile needs the loop again with All (two vector operations fewer per counter);
//  - UnderflowOnly: underflows, in a tile whose largest magnitude is known not to pass max_bits;
//  - All: every event, and the largest magnitude too (see run).
enum class Counting { None, Underflow, UnderflowOnly, All };

template <class Bits>
struct TileCounts {
  // In the carrier's lane width (a tile cannot overflow them): int64 sums would halve the vector
  // width of the whole loop.
  Bits above_max = 0, underflow = 0, nan = 0;
  Bits largest = 0;  // the largest carrier magnitude (Counting::Underflow and All)
};

// Not inlined: a counting run calls two forms.
template <class Src, class Dst, class Bits, RoundKind Kind, Counting kCounts, bool kSubExp,
          ElementForm kForm>
__attribute__((noinline)) TileCounts<Bits> round_tile(const QuantizeCall& c,
                                                      const RoundParams<Bits>& p, const Src* xt,
                                                      Dst* yt, const uint32_t* rand, int64_t len) {
  using C = CarrierTraits<Bits>;
  TileCounts<Bits> t;
  for (int64_t i = 0; i < len; ++i) {
    RoundEvents ev;
    const uint32_t r = Kind == RoundKind::Stochastic ? rand[i] : 0u;
    const Bits x = Widen<Bits>::from(xt[i]);
    yt[i] = Store<Dst>::from(round_element<Kind, Bits, kSubExp, kForm>(x, p, r, c.addition_cap, ev));
    if constexpr (kCounts == Counting::Underflow || kCounts == Counting::All) {
      const Bits a = x & ~C::kSign;
      t.largest = t.largest > a ? t.largest : a;
    }
    if constexpr (kCounts != Counting::None) t.underflow += Bits(ev.underflow);
    if constexpr (kCounts == Counting::All) {
      t.above_max += Bits(ev.above_max);
      t.nan += Bits(ev.nan);
    }
  }
  return t;
}

// The largest carrier magnitude among a tile's elements.
template <class Src, class Bits>
Bits tile_largest(const Src* xt, int64_t len) {
  Bits largest = 0;
  for (int64_t i = 0; i < len; ++i) {
    const Bits a = Widen<Bits>::from(xt[i]) & ~CarrierTraits<Bits>::kSign;
    largest = largest > a ? largest : a;
  }
  return largest;
}

template <class In, class Out, class Bits, RoundKind Kind, bool kCount, bool kSubExp,
          ElementForm kForm>
void run(const QuantizeCall& c, int64_t begin, int64_t end, EventCounts& counts) {
  constexpr bool kInViaFloat = kViaFloat<In, Bits>, kOutViaFloat = kViaFloat<Out, Bits>;
  using Src = std::conditional_t<kInViaFloat, float, In>;
  using Dst = std::conditional_t<kOutViaFloat, float, Out>;
  const In* x = static_cast<const In*>(c.x);
  Out* y = static_cast<Out*>(c.y);
  const RoundParams<Bits> p = round_params<Bits>(c);
  alignas(64) uint32_t rand[kTile];
  alignas(64) Src in_tile[kInViaFloat ? kTile : 1];
  alignas(64) float out_tile[kOutViaFloat ? kTile : 1];
  // A tile rounded with Counting::Underflow that turns out to hold a magnitude above max_bits is
  // rounded again with All, from its input. After such a tile the next ones count All until one
  // holds none (a tensor with many overflows pays one comparison per element, not every tile
  // twice). Where the result overwrites the input element for element (in place), a first pass
  // over the tile finds its largest magnitude, which leaves the tile in L1 for the one rounding
  // pass that counts what it holds. Where the result overlaps the input otherwise, each tile's
  // results are staged in a buffer (in L1) and copied out after the tile's counts are known.
  const auto* x_bytes = static_cast<const unsigned char*>(c.x);
  const auto* y_bytes = static_cast<const unsigned char*>(c.y);
  const bool in_place = kCount && !kOutViaFloat && !kInViaFloat && sizeof(In) == sizeof(Out) && c.x == c.y;
  const bool stage_results = kCount && !kOutViaFloat && !in_place &&
                             !(x_bytes + c.n * int64_t(sizeof(In)) <= y_bytes ||
                               y_bytes + c.n * int64_t(sizeof(Out)) <= x_bytes);
  alignas(64) Dst staged[kCount && !kOutViaFloat ? kTile : 1];
  bool count_all = false;
  int64_t overflow = 0, underflow = 0, nan = 0;
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t len = min_of(kTile, end - t0);
    if constexpr (Kind == RoundKind::Stochastic) {
      // t0 is a multiple of 4: element t0 + j uses word j % 4 of block offset + (t0 + j) / 4.
      philox_fill(rand, c.seed, c.offset + uint64_t(t0) / 4, (len + 3) / 4);
    }
    const Src* xt = readable_tile(x + t0, len, in_tile);
    Dst* yt;
    if constexpr (kOutViaFloat) yt = out_tile;
    else yt = stage_results ? staged : y + t0;
    if constexpr (kCount) {
      TileCounts<Bits> t;
      if (in_place) {
        t = tile_largest<Src, Bits>(xt, len) > p.max_bits
                ? round_tile<Src, Dst, Bits, Kind, Counting::All, kSubExp, kForm>(c, p, xt, yt, rand, len)
                : round_tile<Src, Dst, Bits, Kind, Counting::UnderflowOnly, kSubExp, kForm>(c, p, xt, yt, rand, len);
      } else if (!count_all) {
        t = round_tile<Src, Dst, Bits, Kind, Counting::Underflow, kSubExp, kForm>(c, p, xt, yt, rand, len);
        count_all = t.largest > p.max_bits;
      }
      if (count_all) {
        t = round_tile<Src, Dst, Bits, Kind, Counting::All, kSubExp, kForm>(c, p, xt, yt, rand, len);
        count_all = t.largest > p.max_bits;
      }
      overflow += int64_t(t.above_max) - int64_t(t.nan);  // see RoundEvents
      underflow += int64_t(t.underflow);
      nan += int64_t(t.nan);
      if constexpr (!kOutViaFloat) {
        if (stage_results) std::memcpy(y + t0, staged, size_t(len) * sizeof(Dst));
      }
    } else {
      round_tile<Src, Dst, Bits, Kind, Counting::None, kSubExp, kForm>(c, p, xt, yt, rand, len);
    }
    if constexpr (kOutViaFloat) {
      float_tile_to_half(out_tile, y + t0, len);
    }
  }
  counts.overflow += overflow;
  counts.underflow += underflow;
  counts.nan += nan;
}

}  // namespace

void quantize_range(const QuantizeCall& c, int64_t begin, int64_t end, EventCounts& counts) {
  dispatch_quantize(c, [&](auto in, auto out, auto bits, auto kind, auto count, auto sub_exp) {
    using In = typename decltype(in)::type;
    using Out = typename decltype(out)::type;
    using Bits = typename decltype(bits)::type;
    constexpr RoundKind K = decltype(kind)::value;
    constexpr bool kCount = decltype(count)::value, kSubExp = decltype(sub_exp)::value;
    with_element_form<In, Out, Bits, K, kSubExp>(c, [&](auto form) {
      run<In, Out, Bits, K, kCount, kSubExp, decltype(form)::value>(c, begin, end, counts);
    });
  });
}

namespace {

// An OR of per-element flags in the storage width, so the loop vectorises (no early exit: a
// non-finite gradient is the rare case, and the loop is memory-bound).
template <class U>
bool any_non_finite_in(const U* x, int64_t begin, int64_t end, U exponent) {
  U any = 0;
  for (int64_t i = begin; i < end; ++i) any |= U(non_finite_bits(x[i], exponent));
  return any != 0;
}

}  // namespace

bool any_non_finite_range(DType t, const void* x, int64_t begin, int64_t end) {
  const uint64_t mask = exponent_mask(t);
  switch (t) {
    case DType::Float16:
    case DType::BFloat16:
      return any_non_finite_in(static_cast<const uint16_t*>(x), begin, end, uint16_t(mask));
    case DType::Float32:
      return any_non_finite_in(static_cast<const uint32_t*>(x), begin, end, uint32_t(mask));
    default:
      return any_non_finite_in(static_cast<const uint64_t*>(x), begin, end, mask);
  }
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
