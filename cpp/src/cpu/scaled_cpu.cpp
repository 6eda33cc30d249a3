#include "scaled_cpu.hpp"

#include <type_traits>

#include "dispatch.hpp"
#include "driver.hpp"

namespace lowfp {

namespace {

// The same element of kLanes groups, each operation applied to every lane (loops the compiler
// turns into vector instructions): hadamard16 on kLanes groups at once.
constexpr int kLanes = 16;
template <class T>
struct Lanes {
  T l[kLanes];
  Lanes operator+(const Lanes& o) const {
    Lanes r;
    for (int k = 0; k < kLanes; ++k) r.l[k] = l[k] + o.l[k];
    return r;
  }
  Lanes operator-(const Lanes& o) const {
    Lanes r;
    for (int k = 0; k < kLanes; ++k) r.l[k] = l[k] - o.l[k];
    return r;
  }
  Lanes operator*(T s) const {
    Lanes r;
    for (int k = 0; k < kLanes; ++k) r.l[k] = l[k] * s;
    return r;
  }
};

template <class In, class T>
void hadamard_groups(const HadamardCall& c, const T (&signs)[kHadamardSize], int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + kLanes <= g1; g += kLanes) {
    Lanes<T> v[kHadamardSize];
    const In* x = static_cast<const In*>(c.x) + g * kHadamardSize;
    for (int k = 0; k < kLanes; ++k)
      for (int i = 0; i < kHadamardSize; ++i) v[i].l[k] = widen_to<T>(x[k * kHadamardSize + i]);
    hadamard16(v, signs, c.inverse);
    T* y = static_cast<T*>(c.y) + g * kHadamardSize;
    for (int k = 0; k < kLanes; ++k)
      for (int i = 0; i < kHadamardSize; ++i) y[k * kHadamardSize + i] = v[i].l[k];
  }
  for (; g < g1; ++g) hadamard_group<In>(c, signs, g);
}

}  // namespace

void hadamard_cpu(const HadamardCall& c) {
  with_storage_type(c.dtype, [&](auto type) {
    using In = typename decltype(type)::type;
    using T = std::conditional_t<std::is_same_v<In, double>, double, float>;
    T signs[kHadamardSize];
    for (int i = 0; i < kHadamardSize; ++i) signs[i] = T(c.signs[i]);
    parallel_items(c.groups, c.groups * kHadamardSize, [&](int, int64_t g0, int64_t g1) {
      hadamard_groups<In>(c, signs, g0, g1);
    });
  });
}

namespace {

// Adds a scaled call's counts: {overflow, underflow, nan, numel}, then, when the call counts
// blocks, {blocks whose scale saturated, blocks}; nothing when counts is null.
void add_scaled_counts(const ScaledCall& call, const PerThread<EventCounts>& parts,
                       const PerThread<int64_t>& saturated, int64_t blocks, int64_t* counts) {
  if (counts == nullptr) return;
  add_counts(sum(parts), call.rows * call.cols, counts);
  if (!call.count_blocks) return;
  for (const Slot<int64_t>& s : saturated) counts[4] += s.v;
  counts[5] += blocks;
}

// The blocks' scales of a call that chooses among candidates (BlockChoice), in place of their
// largest magnitudes in call.scales: each block's candidates rounding its elements.
void choose_block_scales(const ScaledCall& call, double t,
                         PerThread<int64_t>& saturated) {
  const int64_t blocks = call.block_grid_rows() * call.block_grid_cols();
  const double empty = empty_block_scale(call.scale, t);
  // (the candidates' elements by the float64 strategy's forms of rounding: the same bits)
  with_float64_forms(call, [&](auto type, auto kind, auto faster_c, auto once_c) {
    using In = typename decltype(type)::type;
    constexpr RoundKind K = decltype(kind)::value;
    constexpr bool kFaster = decltype(faster_c)::value, kOnce = decltype(once_c)::value;
    const int64_t work = blocks * call.block_rows * call.block_cols * 2;  // (two roundings each)
    PerThread<int64_t> chosen_saturated(threads_for(work));
    parallel_items(blocks, work, [&](int th, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const double a = call.scales[b];
        bool sat = false;
        call.scales[b] = a > 0.0 ? four_over_six_scale<In, K, kFaster, kOnce>(call, b, a, t, sat) : empty;
        chosen_saturated[th].v += int64_t(sat);
      }
    });
    for (const Slot<int64_t>& s : chosen_saturated) saturated[0].v += s.v;
  });
}

}  // namespace

void scaled_cpu(const ScaledCall& call, const ScaledCpuForms& forms, double* tensor_scale, int64_t* counts) {
  const Kernel& k = kernel();
  const ScaledPlan plan = plan_scaled(call, forms);
  const int64_t n = call.rows * call.cols;
  const int64_t grid_rows = call.block_grid_rows(), gc = call.block_grid_cols();
  const int64_t blocks = grid_rows * gc;
  if (!call.tensor_scale && call.scale.choice == BlockChoice::Fixed &&
      grid_rows >= 4 * int64_t(threads_for(n))) {
    // Without a tensor scale each row of blocks is independent: its largest magnitudes, scales
    // and elements in one visit, while its inputs are still in cache (one read of x, not two).
    PerThread<EventCounts> parts(threads_for(n));
    PerThread<int64_t> saturated(threads_for(n));
    parallel_items(grid_rows, n, [&](int th, int64_t b0, int64_t b1) {
      for (int64_t br = b0; br < b1; ++br) {
        k.scaled_amax(call, br, br + 1);
        k.scaled_scales(call, 1.0, br * gc, (br + 1) * gc, saturated[th].v);
        k.scaled_elements(call, forms, plan, br * call.block_rows,
                          min_of(call.rows, (br + 1) * call.block_rows), parts[th].v);
      }
    });
    *tensor_scale = 1.0;
    add_scaled_counts(call, parts, saturated, blocks, counts);
    return;
  }
  PerThread<double> largest(threads_for(n));
  parallel_items(grid_rows, n, [&](int th, int64_t b0, int64_t b1) {
    largest[th].v = k.scaled_amax(call, b0, b1);
  });
  double t = 1.0;
  if (call.tensor_scale) {
    double a = 0.0;
    for (const Slot<double>& s : largest) a = max_of(a, s.v);
    t = lowfp::tensor_scale(call.scale, a);  // (the parameter tensor_scale hides it)
  }
  *tensor_scale = t;
  PerThread<int64_t> saturated(threads_for(blocks * 64));  // (a block's scale: some 64 elements' work)
  if (call.scale.choice == BlockChoice::Fixed) {
    parallel_items(blocks, blocks * 64, [&](int th, int64_t b0, int64_t b1) {
      k.scaled_scales(call, t, b0, b1, saturated[th].v);
    });
  } else {
    choose_block_scales(call, t, saturated);
  }
  ScaledCall with_t = call;
  with_t.t = t;
  PerThread<EventCounts> parts(threads_for(n));
  parallel_items(call.rows, n, [&](int th, int64_t r0, int64_t r1) {
    k.scaled_elements(with_t, forms, plan, r0, r1, parts[th].v);
  });
  add_scaled_counts(call, parts, saturated, blocks, counts);
}

}  // namespace lowfp
