// Per-element optimizer updates in float32, in torch.optim's formulas and operation order
// (single-tensor code paths of torch 2.x; every scalar is rounded to float32 first, as torch's CPU
// kernels do). Compiled without fused multiply-adds, so each operation rounds on its own.
#pragma once
#include <cmath>
#include <type_traits>

#include "round.hpp"
#include "storage.hpp"

namespace lowfp {

struct SgdHyper {
  float neg_lr;               // -lr
  float momentum;
  float one_minus_dampening;  // 1 - dampening
  float weight_decay;
  bool nesterov, maximize, first_step;
};

struct AdamHyper {
  float decay;                // AdamW: 1 - lr * weight_decay (1 when weight_decay == 0)
  float weight_decay;         // Adam: L2 term added to the gradient
  float lerp_weight;          // 1 - beta1
  float beta2, one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;        // -lr / (1 - beta1^step)
  bool decoupled, amsgrad, maximize;
};

// torch.lerp: self + w (end - self) for |w| < 0.5, else end - (end - self)(1 - w).
LOWFP_HD float lerp_torch(float self, float end, float w) {
  const float small = self + w * (end - self);
  const float large = end - (end - self) * (1.0f - w);
  return select_float((w < 0.5f) & (w > -0.5f), small, large);
}

// -x when c, else x: a sign flip, one operation where a select takes three.
LOWFP_HD float negate_if(bool c, float x) {
  return bit_cast<float>(bit_cast<uint32_t>(x) ^ (uint32_t(c) << 31));
}

// SGD: returns the new weight; buf is the momentum buffer (ignored when momentum == 0).
// kDecayOrNesterov = false: the caller knows weight_decay == 0 and !nesterov, and the two
// selects (four vector operations of about 80 per step) drop out.
template <bool kDecayOrNesterov = true>
LOWFP_HD float sgd_update(float w, float g, float& buf, bool has_momentum, const SgdHyper& h) {
  float d = negate_if(h.maximize, g);
  if constexpr (kDecayOrNesterov)
    d = select_float(h.weight_decay != 0.0f, d + h.weight_decay * w, d);  // grad.add(param, alpha=wd)
  if (has_momentum) {
    buf = select_float(h.first_step, d, buf * h.momentum + h.one_minus_dampening * d);
    d = kDecayOrNesterov ? select_float(h.nesterov, d + h.momentum * buf, buf) : buf;
  }
  return w + h.neg_lr * d;  // param.add_(d_p, alpha=-lr)
}

// Adam / AdamW: returns the new weight; m, v (and v_max with amsgrad) are updated in place.
LOWFP_HD float adam_update(float w, float g, float& m, float& v, float& v_max, const AdamHyper& h) {
  g = negate_if(h.maximize, g);
  w = select_float(h.decoupled, w * h.decay, w);                              // param.mul_(1 - lr wd)
  g = select_float(!h.decoupled & (h.weight_decay != 0.0f), g + h.weight_decay * w, g);  // grad.add(param, wd)
  m = lerp_torch(m, g, h.lerp_weight);                                        // exp_avg.lerp_(grad, 1 - b1)
  v = v * h.beta2 + (h.one_minus_beta2 * g) * g;  // exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
  v_max = select_float(h.amsgrad, max_of(v_max, v), v_max);
  const float denom = sqrtf(select_float(h.amsgrad, v_max, v)) / h.bias_correction2_sqrt + h.eps;
  return w + (h.neg_step_size * m) / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
}

// A gradient element g (widened from the 16-bit gradient) unscaled by a loss scale that
// torch.amp.GradScaler handed to the step: g / scale in float32, not rounded back to the 16-bit
// type, as torch's fused optimizers divide (a float16 gradient below float16's normal range keeps
// its value, where unscaling it in float16 would flush it toward zero).
LOWFP_HD float unscale_gradient(float g, float scale) { return g / scale; }

// unscale_gradient for a whole tile (the CPU). GradScaler's scales are powers of two, whose
// reciprocals are exact: g times the reciprocal is then the same correctly rounded number as
// g / scale, and a vector multiply costs less than a division. (On the GPU the division kept
// the step kernels' registers; this struct's three live values added spills.)
struct GradUnscale {
  float scale, inverse;
  bool power_of_two;  // a positive normal float with no significand bits
  LOWFP_HD explicit GradUnscale(float s)
      : scale(s), inverse(1.0f / s),
        power_of_two((bit_cast<uint32_t>(s) & 0x807FFFFFu) == 0 &&
                     (bit_cast<uint32_t>(s) >> 23) - 1u < 254u) {}
  LOWFP_HD float operator()(float g) const {
    return power_of_two ? g * inverse : unscale_gradient(g, scale);
  }
};

template <class S> LOWFP_HD float load_state(const S* p, int64_t i) {
  return bit_cast<float>(Widen<uint32_t>::from(p[i]));
}
// State in float32, or in bfloat16 rounded to nearest.
template <class S> LOWFP_HD void store_state(S* p, int64_t i, float v) {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, BFloat>, "float32 or bfloat16 state");
  if constexpr (std::is_same_v<S, float>) {
    p[i] = v;
  } else {
    RoundEvents ignored;
    p[i] = Store<S>::from(
        round_to_bfloat16_bits<RoundKind::Nearest>(bit_cast<uint32_t>(v), 0u, ignored));
  }
}

// Update functors for the drivers: the new weight from (W', g, element index), reading and
// writing their own state arrays (float32 or bfloat16, rounded to nearest), in three parts:
// load(i) -> State, apply(w, g, State&) and store(i, State). update_element runs them for one
// element; a GPU warp issues the loads of several elements before any store (a compiler cannot
// move a load past a store that may alias it).
// Hyperparameters are held by value: a reference could alias the arrays, which would make the
// compiler reload them every element and give up vectorising.
struct SgdPlain {
  const SgdHyper h;
  struct State {};
  LOWFP_HD State load(int64_t) const { return {}; }
  LOWFP_HD float apply(float w, float g, State&) const {
    float unused = 0.0f;
    return sgd_update(w, g, unused, false, h);
  }
  LOWFP_HD void store(int64_t, const State&) const {}
};

template <class S, bool kDecayOrNesterov>
struct SgdMomentum {
  const SgdHyper h;
  S* buf;
  struct State { float b; };
  LOWFP_HD State load(int64_t i) const { return {load_state(buf, i)}; }
  LOWFP_HD float apply(float w, float g, State& st) const {
    return sgd_update<kDecayOrNesterov>(w, g, st.b, true, h);
  }
  LOWFP_HD void store(int64_t i, const State& st) const { store_state(buf, i, st.b); }
};

template <class S, bool kAmsgrad>
struct Adam {
  const AdamHyper h;
  S* m;
  S* v;
  S* v_max;
  struct State { float m, v, v_max; };
  LOWFP_HD State load(int64_t i) const {
    return {load_state(m, i), load_state(v, i), kAmsgrad ? load_state(v_max, i) : 0.0f};
  }
  LOWFP_HD float apply(float w, float g, State& st) const {
    return adam_update(w, g, st.m, st.v, st.v_max, h);
  }
  LOWFP_HD void store(int64_t i, const State& st) const {
    store_state(m, i, st.m);
    store_state(v, i, st.v);
    if (kAmsgrad) store_state(v_max, i, st.v_max);
  }
};

// One element's step with any of the functors above: the new weight, its state updated.
template <class Update>
LOWFP_HD float update_element(const Update& update, float w, float g, int64_t i) {
  typename Update::State st = update.load(i);
  const float out = update.apply(w, g, st);
  update.store(i, st);
  return out;
}

}  // namespace lowfp
