// The loop of the element-wise CUDA kernels (quantize, S2FP8's elements, a scaled call's single
// block) over groups of four consecutive elements, written for nvcc and for the host compiler:
// common.cuh's transform_groups and round_elements call it with their thread's place in the grid,
// and tests/cpp/element_groups_on_threads.cpp runs it on the CPU thread by thread.
#pragma once
#include <cstdint>

#include "lowfp/philox.hpp"
#include "lowfp/round.hpp"
#include "thread_values.hpp"

namespace lowfp {

// Group g of four elements: one vector access when it lies in the first full_groups (the caller
// checked alignment), else element by element up to n (the padding of a last group reads as 0).
template <class T>
LOWFP_HD Quad<T> load_group(const T* x, int64_t g, int64_t n, int64_t full_groups) {
  Quad<T> in = {};
  if (g < full_groups) {
    in = reinterpret_cast<const Quad<T>*>(x)[g];
  } else {
    LOWFP_UNROLL
    for (int k = 0; k < 4; ++k)
      if (4 * g + k < n) in.v[k] = x[4 * g + k];
  }
  return in;
}

template <class T>
LOWFP_HD void store_group(T* y, int64_t g, int64_t n, int64_t full_groups, const Quad<T>& out) {
  if (g < full_groups) {
    reinterpret_cast<Quad<T>*>(y)[g] = out;
  } else {
    LOWFP_UNROLL
    for (int k = 0; k < 4; ++k)
      if (4 * g + k < n) y[4 * g + k] = out.v[k];
  }
}

// Thread `thread` of `threads`' groups of four elements, grid-stride: y's group g = fn(g, x's
// group g), read and written as whole quads in the first n / 4 groups when quad_io (the caller
// checked alignment). x and y may be the same buffer: each group is read before it is written,
// by the thread that writes it. A thread loads kInFlight groups (g, g + threads, ...) before it
// transforms them: 16-bit inputs take two, so that each thread has as many bytes of loads in
// flight (16) as a float32 quad.
template <class In, class Out, class Fn>
LOWFP_HD void transform_thread_groups(const In* x, Out* y, int64_t n, bool quad_io, int64_t thread, int64_t threads,
                                      Fn&& fn) {
  constexpr int kInFlight = sizeof(In) == 2 ? 2 : 1;
  const int64_t groups = (n + 3) / 4, full_groups = quad_io ? n / 4 : 0;
  for (int64_t g0 = thread; g0 < groups; g0 += kInFlight * threads) {
    Quad<In> in[kInFlight];
    LOWFP_UNROLL
    for (int j = 0; j < kInFlight; ++j)
      if (g0 + j * threads < groups) in[j] = load_group(x, g0 + j * threads, n, full_groups);
    LOWFP_UNROLL
    for (int j = 0; j < kInFlight; ++j)
      if (g0 + j * threads < groups) store_group(y, g0 + j * threads, n, full_groups, fn(g0 + j * threads, in[j]));
  }
}

// An element-wise rounding over transform_thread_groups: y[i] = element(x[i], word, ev), word
// element i's Philox word (group g's four from block offset + g, docs/design.md §3) for
// stochastic rounding K, else 0; the events ev of elements below n counted into tc when kCount.
template <RoundKind K, bool kCount, class In, class Out, class Fn>
LOWFP_HD void round_thread_groups(const In* x, Out* y, int64_t n, bool quad_io, uint64_t seed, uint64_t offset,
                                  int64_t thread, int64_t threads, ThreadCounts& tc, Fn&& element) {
  transform_thread_groups(x, y, n, quad_io, thread, threads, [&](int64_t g, const Quad<In>& in) {
    Philox4x32Block r = {{0u, 0u, 0u, 0u}};
    if constexpr (K == RoundKind::Stochastic) r = philox_block(seed, offset + uint64_t(g));
    Quad<Out> out;
    LOWFP_UNROLL
    for (int k = 0; k < 4; ++k) {
      RoundEvents ev;
      out.v[k] = element(in.v[k], r.w[k], ev);
      if (kCount && 4 * g + k < n) tc.add(ev);
    }
    return out;
  });
}

}  // namespace lowfp
