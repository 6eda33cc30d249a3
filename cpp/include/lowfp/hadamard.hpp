// The random Hadamard transform of the NVFP4 training recipe (docs/design.md §9), one group of 16
// consecutive elements at a time, shared by the CPU and CUDA drivers. Its order of operations is
// the specification (lowfp's torch form, python/lowfp/scaled/quantize.py `hadamard`, performs
// the same ones, so that eager and compiled code give the same bits):
//   forward  H16 · diag(signs) / 4: v_i · s_i, four butterfly stages, then · 1/4;
//   inverse  diag(signs) · H16 / 4: four butterfly stages, · 1/4, then · s_i.
// Stage h (1, 2, 4, 8) replaces each pair (a, b) = (v_j, v_{j+h}), j mod 2h < h, by (a + b, a - b),
// each rounded to T. Contracting a product into an addition cannot change a result: the only
// products before an addition are by signs of ±1, which are exact.
#pragma once

#include "config.hpp"

namespace lowfp {

constexpr int kHadamardSize = 16;

// V: the element type (T), or a type holding several groups' elements that applies each
// operation to every one of them (the CPU driver's lanes).
template <class V, class T>
LOWFP_HD void hadamard16(V (&v)[kHadamardSize], const T (&signs)[kHadamardSize], bool inverse) {
  if (!inverse)
    for (int i = 0; i < kHadamardSize; ++i) v[i] = v[i] * signs[i];
  for (int h = 1; h < kHadamardSize; h *= 2)
    for (int i = 0; i < kHadamardSize; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const V a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  for (int i = 0; i < kHadamardSize; ++i) v[i] = v[i] * T(0.25);
  if (inverse)
    for (int i = 0; i < kHadamardSize; ++i) v[i] = v[i] * signs[i];
}

}  // namespace lowfp
