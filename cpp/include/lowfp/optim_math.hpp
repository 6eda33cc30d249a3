// Per-element optimizer updates in float32 with torch.optim's own arithmetic (single-tensor
// code paths of torch 2.x on the CPU): the same operations in the same order, every scalar
// rounded to float32 first, and a fused multiply-add exactly where torch's CPU kernels compute
// one: add with alpha (a + alpha b), lerp and addcmul. Elsewhere each operation rounds on its own
// (the build contracts nothing by itself). The square root of Adam's denominator is the caller's:
// on the CPU torch takes it from its vector math library, which is not always correctly rounded
// (see adam_moments).
#pragma once
#include <cmath>
#include <type_traits>

#include "round.hpp"
#include "storage.hpp"

namespace lowfp {

// a b + c rounded once, as torch's kernels compute add(self, other, alpha), lerp and addcmul.
LOWFP_HD float fused_mul_add(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

struct SgdHyper {
  float neg_lr;               // -lr
  float momentum;
  float one_minus_dampening;  // 1 - dampening
  float weight_decay;
  bool nesterov, maximize, first_step;
  bool has_momentum;          // momentum != 0 (in double, as torch.optim tests it)
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
  // How torch associates addcmul and addcdiv: its CPU kernels compute self + (value t1) t2 and
  // self + (value t1) / t2, its CUDA foreach kernels self + value (t1 t2) and
  // self + value (t1 / t2) with one fused multiply-add (ForeachFunctors.cuh). Set for steps on
  // CUDA, where torch.optim's default is the foreach path.
  bool cuda_association;
};

// torch.lerp: self + w (end - self) for |w| < 0.5, else end + (w - 1)(end - self), each with
// one rounding after the difference.
LOWFP_HD float lerp_torch(float self, float end, float w) {
  const bool small = (w < 0.5f) & (w > -0.5f);
  return fused_mul_add(select_float(small, w, w - 1.0f), end - self, select_float(small, self, end));
}

// torch.maximum: NaN when either is NaN.
LOWFP_HD float maximum_torch(float a, float b) {
  return select_float(b != b, b, max_of(a, b));  // (max_of(NaN, b) is already NaN)
}

// -x when c, else x: a sign flip, one operation where a select takes three.
LOWFP_HD float negate_if(bool c, float x) {
  return bit_cast<float>(bit_cast<uint32_t>(x) ^ (uint32_t(c) << 31));
}

template <class S> LOWFP_HD float load_state(const S* p, int64_t i) {
  return bit_cast<float>(Widen<uint32_t>::from(p[i]));
}
// v as a value of the state type S: itself for float32 state, rounded to nearest for bfloat16.
template <class S> LOWFP_HD float to_state(float v) {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, BFloat>, "float32 or bfloat16 state");
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    RoundEvents ignored;
    return bit_cast<float>(round_to_bfloat16_bits<RoundKind::Nearest>(bit_cast<uint32_t>(v), 0u, ignored));
  }
}
// State in float32, or in bfloat16 rounded to nearest.
template <class S> LOWFP_HD void store_state(S* p, int64_t i, float v) {
  if constexpr (std::is_same_v<S, float>)
    p[i] = v;
  else
    p[i] = Store<S>::from(bit_cast<uint32_t>(to_state<S>(v)));
}

// SGD: returns the new weight; buf is the momentum buffer (ignored when momentum == 0), of state
// type S: with bfloat16 state each in-place update of the buffer rounds to bfloat16, as torch's
// in-place operations on a bfloat16 buffer do (the first step's buffer is the gradient itself,
// float32 until stored, as torch's clone of a float32 gradient).
// kDecayOrNesterov = false: the caller knows weight_decay == 0 and !nesterov, and the two
// selects (four vector operations of about 80 per step) drop out.
template <bool kDecayOrNesterov = true, class S = float>
LOWFP_HD float sgd_update(float w, float g, float& buf, bool has_momentum, const SgdHyper& h) {
  float d = negate_if(h.maximize, g);
  if constexpr (kDecayOrNesterov)  // grad.add(param, alpha=wd)
    d = select_float(h.weight_decay != 0.0f, fused_mul_add(h.weight_decay, w, d), d);
  if (has_momentum) {  // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
    const float kept = to_state<S>(buf * h.momentum);
    buf = select_float(h.first_step, d, to_state<S>(fused_mul_add(h.one_minus_dampening, d, kept)));
    d = kDecayOrNesterov ? select_float(h.nesterov, fused_mul_add(h.momentum, buf, d), buf) : buf;
  }
  return fused_mul_add(h.neg_lr, d, w);  // param.add_(d_p, alpha=-lr)
}

// Adam / AdamW in two parts around the square root of the denominator. adam_moments updates m,
// v (and v_max with amsgrad) in place, applies AdamW's decay to w and returns the value whose
// square root adam_finish needs; adam_finish returns the new weight.
LOWFP_HD float adam_moments(float& w, float g, float& m, float& v, float& v_max, const AdamHyper& h) {
  g = negate_if(h.maximize, g);
  w = select_float(h.decoupled, w * h.decay, w);  // param.mul_(1 - lr wd)
  g = select_float(!h.decoupled & (h.weight_decay != 0.0f), fused_mul_add(h.weight_decay, w, g),
                   g);                             // grad.add(param, alpha=wd)
  m = lerp_torch(m, g, h.lerp_weight);             // exp_avg.lerp_(grad, 1 - b1)
  const float kept = v * h.beta2;  // .mul_(b2).addcmul_(g, g, value=1 - b2)
  v = select_float(h.cuda_association, fused_mul_add(h.one_minus_beta2, g * g, kept),
                   fused_mul_add(h.one_minus_beta2 * g, g, kept));
  v_max = select_float(h.amsgrad, maximum_torch(v_max, v), v_max);
  return select_float(h.amsgrad, v_max, v);
}

LOWFP_HD float adam_finish(float w, float m, float root, const AdamHyper& h) {
  const float denom = root / h.bias_correction2_sqrt + h.eps;  // (sqrt / bc2_sqrt).add_(eps)
  // param.addcdiv_(exp_avg, denom, value=-step_size): w + (-step_size m) / denom on the CPU,
  // fma(-step_size, m / denom, w) on CUDA; one division either way, and selects (a ?: here
  // stopped gcc vectorising the nearest and stochastic steps).
  const bool cuda = h.cuda_association;
  const float quotient = select_float(cuda, m, h.neg_step_size * m) / denom;
  return select_float(cuda, fused_mul_add(h.neg_step_size, quotient, w), w + quotient);
}

// Both parts with a correctly rounded square root, as torch's CUDA kernels take it (sqrtf).
LOWFP_HD float adam_update(float w, float g, float& m, float& v, float& v_max, const AdamHyper& h) {
  const float q = adam_moments(w, g, m, v, v_max, h);
  return adam_finish(w, m, sqrtf(q), h);
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

// Update functors for the drivers: the new weight from (W', g, element index), reading and
// writing their own state arrays (float32 or bfloat16, rounded to nearest), in three parts:
// load(i) -> State, apply(w, g, State&) and store(i, State). update_element runs them for one
// element; a GPU warp issues the loads of several elements before any store (a compiler cannot
// move a load past a store that may alias it).
// Hyperparameters are held by value: a reference could alias the arrays, which would make the
// compiler reload them every element and give up vectorising.
struct SgdPlain {
  static constexpr bool kSquareRootApart = false;
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
  static constexpr bool kSquareRootApart = false;
  const SgdHyper h;
  S* buf;
  struct State { float b; };
  LOWFP_HD State load(int64_t i) const { return {load_state(buf, i)}; }
  LOWFP_HD float apply(float w, float g, State& st) const {
    return sgd_update<kDecayOrNesterov, S>(w, g, st.b, true, h);
  }
  LOWFP_HD void store(int64_t i, const State& st) const { store_state(buf, i, st.b); }
};

// Adam's CPU tiles run its two parts apart (kSquareRootApart), so that the square roots of a
// tile are taken by torch's own vector routine in between.
template <class S, bool kAmsgrad>
struct Adam {
  static constexpr bool kSquareRootApart = true;
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
  // The first part for element i: w becomes the decayed weight, m the new first moment (both
  // for finish), and the return value is what the square root is taken of.
  LOWFP_HD float moments(int64_t i, float& w, float g, float& m_out) const {
    State st = load(i);
    const float q = adam_moments(w, g, st.m, st.v, st.v_max, h);
    store(i, st);
    m_out = st.m;
    return q;
  }
  LOWFP_HD float finish(float w, float m_new, float root) const { return adam_finish(w, m_new, root, h); }
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
