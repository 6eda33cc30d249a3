// One scaled-format rounding (docs/design.md §9) as the drivers see it: a buffer viewed as
// (rows, cols), row-major, cut into blocks of block_rows × block_cols (the last ones may be short),
// one scale per block.
#pragma once
#include <cstdint>

#include "lowfp/hadamard.hpp"
#include "lowfp/scaled.hpp"

namespace lowfp {

struct ScaledCall {
  const void* x;
  void* y;                       // s · q in x's dtype (may be x)
  DType dtype;
  int64_t rows, cols, block_rows, block_cols;
  ScaleSpec scale;
  bool tensor_scale;             // a float32 second-level scale t = amax / (max_S · max_E)
  RoundParams<uint64_t> p;       // E, with the call's rounding mode and overflow policy
  RoundParams<uint64_t> out;     // nearest to dtype (16-bit outputs: s · q may be off its grid)
  // The float32 carrier (same results, twice the lanes): power-of-two scales, an input of at
  // most 32 bits and E's finest step at least 2^-22, so that x · 2^-k is exact or below 2^-126
  // (where only its sign and being nonzero decide E's rounding, with 32 random bits too) and
  // s · q is exact in float32 (see scaled_kernels.cpp).
  bool narrow;
  RoundParams<uint32_t> p32, out32;
  // Nearest with ties to even, and nearest_by_addition(p32 or p, addition_cap) (round.hpp) in
  // the call's carrier: E's rounding by addition
  bool nearest_by_addition;
  int32_t addition_cap;          // E's largest exponent + 1
  // Nearest rounding, scales in a format, and nearest_divides_once (scaled.hpp): x / s need not
  // be rounded to odd
  bool divide_once;
  // Float32 inputs, scales in a format, E's rounding by addition, E's finest step at least
  // 2^-22 and m <= 18, and q · S exact in float32 when there is a tensor scale: the elements may
  // be rounded in float32 with a quotient checked against E's midpoints (scaled_kernels.cpp)
  bool checked;
  // Float32 inputs, scales in a format, nearest rounding that saturates, E with at most
  // kFewMagnitudes magnitudes and a signed zero, and every mu · s exact in float64 (scaled.hpp):
  // the elements may be rounded by comparisons (scaled_kernels.cpp)
  bool few;
  FewMagnitudes magnitudes;      // E's, when few
  // Float32 inputs, nearest rounding, and every mu · s of E's event points exact in float64
  // (power-of-two scales, or m + 2 + the scale's bits <= 53): the counts may come from
  // comparisons of |x| with the event points times each block's scale (scaled_kernels.cpp)
  bool count_by_comparison;
  EventPoints events;
  // When few and S has at most kFewKeys values from its smallest to its largest positive one:
  // S = s / t keyed by its float64 bits >> few_key_shift, less few_key0 (S's m mantissa bits and
  // exponent; distinct for S's values, subnormals included), few_keys keys (else 0)
  int32_t few_key_shift;
  int64_t few_key0, few_keys;
  double t;                      // the tensor scale (1 without one), known after the scales
  Rounding mode;
  bool count;
  bool count_blocks;             // the counts buffer holds the block counts too (6, not 4)
  uint64_t seed, offset;         // stochastic: element i = r·cols + c takes word (offset·4 + i) % 4
                                 // of Philox block offset + i / 4 (offset: a block offset)
  double* scales;                // per block, row-major over the block grid: s (t included)
  float* q;                      // optional (nullptr): the elements q, row-major (E fits float32)
  LOWFP_HD int64_t block_grid_cols() const { return (cols + block_cols - 1) / block_cols; }
  LOWFP_HD int64_t block_grid_rows() const { return (rows + block_rows - 1) / block_rows; }
};

// The random Hadamard transform (lowfp/hadamard.hpp) of each group of 16 consecutive elements of
// x, a contiguous buffer of `groups` groups of dtype, into y: float64 for float64 x, float32 for
// the others (16-bit inputs widened exactly).
struct HadamardCall {
  const void* x;
  DType dtype;
  void* y;
  int64_t groups;
  double signs[kHadamardSize];  // (each converted to y's type)
  bool inverse;
};

// An input element in the transform's type T (float64 for float64 inputs, float32 for the
// others; exact).
template <class T, class In>
LOWFP_HD T widen_to(In x) {
  if constexpr (sizeof(T) == 8)
    return x;
  else
    return bit_cast<float>(Widen<uint32_t>::from(x));
}

// The transform of group g of c, T the type of c.y, In the storage type of c.dtype.
template <class In, class T>
LOWFP_HD void hadamard_group(const HadamardCall& c, const T (&signs)[kHadamardSize], int64_t g) {
  const In* x = static_cast<const In*>(c.x) + g * kHadamardSize;
  T v[kHadamardSize];
  for (int i = 0; i < kHadamardSize; ++i) v[i] = widen_to<T>(x[i]);
  hadamard16(v, signs, c.inverse);
  T* y = static_cast<T*>(c.y) + g * kHadamardSize;
  for (int i = 0; i < kHadamardSize; ++i) y[i] = v[i];
}

// fn(a null pointer to the storage type of dtype t): the drivers' dispatch on the input dtype.
template <class Fn>
void with_storage_type(DType t, Fn&& fn) {
  switch (t) {
    case DType::Float16: return fn(static_cast<const Half*>(nullptr));
    case DType::BFloat16: return fn(static_cast<const BFloat*>(nullptr));
    case DType::Float32: return fn(static_cast<const float*>(nullptr));
    default: return fn(static_cast<const double*>(nullptr));
  }
}

// At most this many keys of scale values for the comparison path's cache of thresholds (E4M3: 144).
constexpr int64_t kFewKeys = 1024;

// Element formats of at most this many mantissa bits: with 32 random bits their stochastic
// rounding of a float64 quotient is exact (docs/design.md §9).
constexpr int32_t kScaledMaxElementMantissa = 19;

// A scaled rounding as the caller asks for it, without its buffers: lowfp prepares one per
// (format, rounding, overflow, sr_bits, dtype) and reuses it for every tensor.
struct ScaledRequest {
  FormatSpec element;
  Overflow overflow;
  Rounding mode;
  int32_t sr_bits;
  ScaleRule rule;
  FormatSpec scale_format;  // rule Format: S (float32 scales: fp(8,23,0,ieee)); else unused
  bool tensor_scale;
  DType dtype;
};

// Checks r (std::invalid_argument: pybind11's ValueError) and builds the call, its buffers,
// shape, blocks, seed and offset left for with_buffers.
ScaledCall prepare_scaled_call(const ScaledRequest& r);

// A prepared call on x (rows × cols, row-major, in blocks of block_rows × block_cols) into y,
// writing one scale per block into scales (required), the elements into q when not null,
// counting when counts_size is 4 (element counts) or 6 (block counts too), not when it is 0;
// seed and offset as ScaledCall's. Throws std::invalid_argument on a negative shape, an empty
// block, a missing scales buffer or another counts size.
ScaledCall with_buffers(ScaledCall c, const void* x, void* y, int64_t rows, int64_t cols,
                        int64_t block_rows, int64_t block_cols, uint64_t seed, uint64_t offset,
                        double* scales, float* q, int32_t counts_size);

}  // namespace lowfp
