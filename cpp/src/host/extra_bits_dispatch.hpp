// Maps an ExtraBitsStep's runtime choices (16-bit type, rounding kind, optimizer, momentum,
// state dtype, amsgrad) to template arguments, for the CPU and CUDA drivers alike:
// fn(Weights<W16, kGrid>{}, Kind<K>{}, Type<Maker>{}), where Maker::make(step, slot) builds the update
// functor of cpp/include/lowfp/optim_math.hpp for one parameter.
#pragma once
#include "dispatch.hpp"
#include "extra_bits_call.hpp"

namespace lowfp {

struct MakeSgdPlain {
  static constexpr int64_t kStateBytes = 0;  // per element, in each state array
  static LOWFP_HD SgdPlain make(const SgdHyper& h, const AdamHyper&, const ExtraBitsSlot&) {
    return SgdPlain{h};
  }
};

template <class S, bool kDecayOrNesterov>
struct MakeSgdMomentum {
  static constexpr int64_t kStateBytes = sizeof(S);
  static LOWFP_HD SgdMomentum<S, kDecayOrNesterov> make(const SgdHyper& h, const AdamHyper&,
                                                        const ExtraBitsSlot& slot) {
    return SgdMomentum<S, kDecayOrNesterov>{h, static_cast<S*>(slot.state0)};
  }
};

template <class S, bool kAmsgrad>
struct MakeAdam {
  static constexpr int64_t kStateBytes = sizeof(S);
  static LOWFP_HD Adam<S, kAmsgrad> make(const SgdHyper&, const AdamHyper& h,
                                         const ExtraBitsSlot& slot) {
    return Adam<S, kAmsgrad>{h, static_cast<S*>(slot.state0), static_cast<S*>(slot.state1),
                             static_cast<S*>(slot.state2)};
  }
};

// The weights' storage type W16 and whether a weight format F sets their grid.
template <class W16, bool kGrid> struct Weights {
  using type = W16;
  static constexpr bool grid = kGrid;
};

template <class Fn>
void dispatch_weights(const ExtraBitsParams& e, Fn&& fn) {
  if (e.bf16) {
    if (e.grid) fn(Weights<BFloat, true>{});
    else fn(Weights<BFloat, false>{});
  } else {
    if (e.grid) fn(Weights<Half, true>{});
    else fn(Weights<Half, false>{});
  }
}

template <class Fn>
void dispatch_extra_bits_kind(const ExtraBitsParams& e, Rounding mode, Fn&& fn) {
  auto kind = [&](auto w16) {
    switch (round_kind(mode)) {
      case RoundKind::Nearest: return fn(w16, Kind<RoundKind::Nearest>{});
      case RoundKind::Directed: return fn(w16, Kind<RoundKind::TowardZero>{});  // the only one
      default: return fn(w16, Kind<RoundKind::Stochastic>{});
    }
  };
  dispatch_weights(e, kind);
}

template <class Fn>
void dispatch_extra_bits_step(const ExtraBitsStep& s, Fn&& fn) {
  dispatch_extra_bits_kind(s.e, s.mode, [&](auto w16, auto kind) {
    const bool bf16_state = s.state == DType::BFloat16;
    if (s.opt == OptimKind::Sgd) {
      if (!s.has_momentum) return fn(w16, kind, Type<MakeSgdPlain>{});
      // the common SGD (momentum, no weight decay, no Nesterov) without their selects
      const bool general = s.sgd.weight_decay != 0.0f || s.sgd.nesterov;
      if (bf16_state) {
        if (general) return fn(w16, kind, Type<MakeSgdMomentum<BFloat, true>>{});
        return fn(w16, kind, Type<MakeSgdMomentum<BFloat, false>>{});
      }
      if (general) return fn(w16, kind, Type<MakeSgdMomentum<float, true>>{});
      return fn(w16, kind, Type<MakeSgdMomentum<float, false>>{});
    }
    if (bf16_state) {
      if (s.adam.amsgrad) return fn(w16, kind, Type<MakeAdam<BFloat, true>>{});
      return fn(w16, kind, Type<MakeAdam<BFloat, false>>{});
    }
    if (s.adam.amsgrad) return fn(w16, kind, Type<MakeAdam<float, true>>{});
    return fn(w16, kind, Type<MakeAdam<float, false>>{});
  });
}

}  // namespace lowfp
