// Run-time choices as template arguments, for the CPU and CUDA drivers alike: a flag
// (with_flag), a rounding mode's kind (with_round_kind), a QuantizeCall's storage types,
// carrier, rounding kind, counting and whether carrier subnormals need their true exponent
// (dispatch_quantize: fn(Type<In>{}, Type<Out>{}, Type<Bits>{}, Kind<k>{}, Flag<count>{},
// Flag<subnormal_exponent>{})), and its element form (with_element_form).
#pragma once
#include <type_traits>

#include "lowfp/round.hpp"
#include "lowfp/storage.hpp"
#include "quantize_call.hpp"

namespace lowfp {

template <class T> struct Type { using type = T; };
template <RoundKind K> struct Kind { static constexpr RoundKind value = K; };
template <bool B> struct Flag { static constexpr bool value = B; };

// fn(Flag<v>{}): a run-time flag as a template parameter.
template <class Fn>
void with_flag(bool v, Fn&& fn) {
  if (v) fn(Flag<true>{});
  else fn(Flag<false>{});
}

// fn(Type<T>{}), T the storage type of t.
template <class Fn>
void with_storage_type(DType t, Fn&& fn) {
  switch (t) {
    case DType::Float16: return fn(Type<Half>{});
    case DType::BFloat16: return fn(Type<BFloat>{});
    case DType::Float32: return fn(Type<float>{});
    default: return fn(Type<double>{});
  }
}

// fn(Kind<round_kind(mode)>{}).
template <class Fn>
void with_round_kind(Rounding mode, Fn&& fn) {
  switch (round_kind(mode)) {
    case RoundKind::Nearest: return fn(Kind<RoundKind::Nearest>{});
    case RoundKind::Directed: return fn(Kind<RoundKind::Directed>{});
    default: return fn(Kind<RoundKind::Stochastic>{});
  }
}

// fn(Flag<a>{}, Flag<b>{}).
template <class Fn>
void dispatch_flags(bool a, bool b, Fn&& fn) {
  const auto with_a = [&](auto fa) { b ? fn(fa, Flag<true>{}) : fn(fa, Flag<false>{}); };
  a ? with_a(Flag<true>{}) : with_a(Flag<false>{});
}

// How a quantize loop rounds each element, chosen once per call (QuantizeCall) for the CPU and
// CUDA loops alike; every form gives round_bits' results and events where the call selects it:
//  - General: round_bits;
//  - Addition, AdditionSymmetric: nearest by addition (round_nearest_by_addition), the second
//    with the overflow policy's symmetric form (rounded_result_symmetric);
//  - StochasticStepsSymmetric: stochastic rounding as a sum (round_stochastic_by_steps), with the
//    symmetric form;
//  - Bfloat16: the bfloat16 format with its parameters folded in (round_to_bfloat16_bits).
enum class ElementForm { General, Addition, AdditionSymmetric, StochasticStepsSymmetric, Bfloat16 };
template <ElementForm F> struct Form { static constexpr ElementForm value = F; };

// Where the bfloat16 form is compiled: float32 in, float32 or bfloat16 out, nearest or stochastic
// (QuantizeCall::bfloat16_by_bits).
template <class In, class Out, class Bits, RoundKind K, bool kSubExp>
constexpr bool kHasBfloat16Form =
    std::is_same_v<In, float> && (std::is_same_v<Out, float> || std::is_same_v<Out, BFloat>) &&
    std::is_same_v<Bits, uint32_t> && (K == RoundKind::Nearest || K == RoundKind::Stochastic) && !kSubExp;

// One element of a quantize loop of carrier Bits, rounding kind K and subnormal exponents kSubExp,
// in the form kForm (with_element_form); rand: its Philox word (stochastic rounding), e_cap:
// QuantizeCall::addition_cap.
template <RoundKind K, class Bits, bool kSubExp, ElementForm kForm>
LOWFP_HD Bits round_element(Bits x, const RoundParams<Bits>& p, uint32_t rand, int32_t e_cap, RoundEvents& ev) {
  if constexpr (kForm == ElementForm::General) {
    return round_bits<K, Bits, kSubExp>(x, p, rand, ev);
  } else if constexpr (kForm == ElementForm::Bfloat16) {
    return round_to_bfloat16_bits<K>(x, rand, ev);
  } else if constexpr (kForm == ElementForm::StochasticStepsSymmetric) {
    return round_stochastic_by_steps<true>(x, p, rand, ev);
  } else {
    return round_nearest_by_addition<Bits, kForm == ElementForm::AdditionSymmetric>(x, p, e_cap, ev);
  }
}

// fn(Form<f>{}) with f the element form of call c for a loop of storage types In, Out, carrier
// Bits, rounding kind K and subnormal exponents kSubExp (nearest by addition and bfloat16 folded
// exist for the float32 carrier only).
template <class In, class Out, class Bits, RoundKind K, bool kSubExp, class Fn>
void with_element_form(const QuantizeCall& c, Fn&& fn) {
  if constexpr (K == RoundKind::Stochastic && !kSubExp) {
    if (c.stochastic_by_steps) return fn(Form<ElementForm::StochasticStepsSymmetric>{});
  }
  if constexpr (std::is_same_v<Bits, uint32_t> && !kSubExp) {
    if constexpr (K == RoundKind::Nearest) {
      if (c.nearest_by_addition) {
        if (c.symmetric_overflow) return fn(Form<ElementForm::AdditionSymmetric>{});
        return fn(Form<ElementForm::Addition>{});
      }
    }
    if constexpr (kHasBfloat16Form<In, Out, Bits, K, kSubExp>) {
      if (c.bfloat16_by_bits) return fn(Form<ElementForm::Bfloat16>{});
    }
  }
  fn(Form<ElementForm::General>{});
}

namespace detail {

template <class Bits>
const RoundParams<Bits>& round_params_of(const QuantizeCall& c) {
  if constexpr (std::is_same_v<Bits, uint32_t>) return c.p32;
  else return c.p64;
}

template <class In, class Out, class Bits, class Fn>
void dispatch_mode(const QuantizeCall& c, Fn&& fn) {
  const bool sub_exp = round_params_of<Bits>(c).subnormal_exponent;
  auto with_count = [&](auto kind) {
    dispatch_flags(c.count, sub_exp, [&](auto count, auto sub) {
      fn(Type<In>{}, Type<Out>{}, Type<Bits>{}, kind, count, sub);
    });
  };
  with_round_kind(c.mode, with_count);
}

// The carrier is float64 exactly when one side is float64 (QuantizeCall::wide).
template <class In, class Fn>
void dispatch_out(const QuantizeCall& c, Fn&& fn) {
  if (c.wide) {
    switch (c.y_dtype) {
      case DType::Float16: return dispatch_mode<In, Half, uint64_t>(c, fn);
      case DType::BFloat16: return dispatch_mode<In, BFloat, uint64_t>(c, fn);
      case DType::Float32: return dispatch_mode<In, float, uint64_t>(c, fn);
      case DType::Float64: return dispatch_mode<In, double, uint64_t>(c, fn);
    }
  } else if constexpr (!std::is_same_v<In, double>) {
    switch (c.y_dtype) {
      case DType::Float16: return dispatch_mode<In, Half, uint32_t>(c, fn);
      case DType::BFloat16: return dispatch_mode<In, BFloat, uint32_t>(c, fn);
      default: return dispatch_mode<In, float, uint32_t>(c, fn);
    }
  }
}

}  // namespace detail

template <class Fn>
void dispatch_quantize(const QuantizeCall& c, Fn&& fn) {
  switch (c.x_dtype) {
    case DType::Float16: return detail::dispatch_out<Half>(c, fn);
    case DType::BFloat16: return detail::dispatch_out<BFloat>(c, fn);
    case DType::Float32: return detail::dispatch_out<float>(c, fn);
    case DType::Float64: return detail::dispatch_out<double>(c, fn);
  }
}

// S2FP8 calls: x and y share their storage type; Y is rounded in the float64 carrier.
template <class Fn>
void dispatch_s2fp8(const QuantizeCall& c, Fn&& fn) {
  switch (c.x_dtype) {
    case DType::Float16: return detail::dispatch_mode<Half, Half, uint64_t>(c, fn);
    case DType::BFloat16: return detail::dispatch_mode<BFloat, BFloat, uint64_t>(c, fn);
    case DType::Float32: return detail::dispatch_mode<float, float, uint64_t>(c, fn);
    case DType::Float64: return detail::dispatch_mode<double, double, uint64_t>(c, fn);
  }
}

// For x of a 16- or 32-bit storage type (those with S2FP8's per-call forms): fn(Type<T>{})'s
// result; for float64 x, `wide`.
template <class R, class Fn>
R dispatch_narrow(DType x_dtype, R wide, Fn&& fn) {
  switch (x_dtype) {
    case DType::Float16: return fn(Type<Half>{});
    case DType::BFloat16: return fn(Type<BFloat>{});
    case DType::Float32: return fn(Type<float>{});
    case DType::Float64: break;
  }
  return wide;
}

// The rounding constants for the carrier Bits.
template <class Bits>
const RoundParams<Bits>& round_params(const QuantizeCall& c) {
  return detail::round_params_of<Bits>(c);
}

}  // namespace lowfp
