// Shared by the CPU and CUDA drivers: every function in this directory is host+device and
// allocation-free, so one formula serves both backends.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LOWFP_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Forced: the CPU loops vectorise only once the element math is inlined into them.
#define LOWFP_HD inline __attribute__((always_inline))
#else
#define LOWFP_HD inline
#endif

namespace lowfp {

// Bit-exact reinterpretation; memcpy is understood by both gcc's vectoriser and nvcc.
template <class To, class From>
LOWFP_HD To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
#if defined(__CUDACC__) || !defined(__GNUC__)
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
#else
  return __builtin_bit_cast(To, from);  // unlike memcpy, vectorises for 64-bit lanes too
#endif
}

// Fully unroll a short constant-trip loop (CUDA and gcc spell it differently).
#if defined(__CUDACC__)
#define LOWFP_UNROLL _Pragma("unroll")
#else
#define LOWFP_UNROLL _Pragma("GCC unroll 32")
#endif

// Branch-free select for integers: gcc if-converts these reliably where it leaves ?: as control
// flow that blocks loop vectorisation.
template <class T>
LOWFP_HD T select(bool c, T a, T b) {
  const T mask = T(0) - T(c);
  return (a & mask) | (b & ~mask);
}
// The same for floats, through their bit patterns (a ?: on a loop-invariant bool can stop gcc
// vectorising a float loop).
LOWFP_HD float select_float(bool c, float a, float b) {
  return bit_cast<float>(select(c, bit_cast<uint32_t>(a), bit_cast<uint32_t>(b)));
}
// Plain conditionals become MIN/MAX_EXPR, which vectorise without narrowing shift counts.
template <class T>
LOWFP_HD T min_of(T a, T b) { return a < b ? a : b; }
template <class T>
LOWFP_HD T max_of(T a, T b) { return a < b ? b : a; }

// a b + c, fused where the target has the instruction and rounded twice where that would be a
// library call: only for the float32 fast forms, whose error bounds hold either way (measured
// both ways), never for math that must be exact.
LOWFP_HD float fast_mul_add(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#elif defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

}  // namespace lowfp
