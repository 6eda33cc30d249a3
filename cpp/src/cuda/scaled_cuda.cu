// Scaled formats on the GPU (docs/design.md §9), with the element and scale math of
// cpp/include/lowfp/scaled.hpp. Three launches on the stream: each block's largest finite
// magnitude (into the scales buffer, and the tensor's by an atomic max on its bits), the scales
// (in place), then the elements in a grid-stride loop. Every element takes the float64 carrier,
// whose results the CPU's float32 carrier equals (tests/test_scaled.py), so CPU = GPU bit for bit.
#include <type_traits>

#include "common.cuh"
#include "dispatch.hpp"
#include "lowfp/philox.hpp"
#include "lowfp/scaled.hpp"
#include "scaled_cuda.hpp"

namespace lowfp {
namespace {

template <class In>
__global__ void __launch_bounds__(kThreads)
amax_kernel(ScaledCall c, unsigned long long* tensor_max) {
  using U = RawOf<In>;
  const U* x = static_cast<const U*>(c.x);
  const U magnitude = U(U(~U(0)) >> 1), exponent = U(exponent_mask(c.dtype));
  const int64_t gc = c.block_grid_cols(), blocks = c.block_grid_rows() * gc;
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r0 = (b / gc) * c.block_rows, c0 = (b % gc) * c.block_cols;
    const int64_t r1 = min_of(c.rows, r0 + c.block_rows), c1 = min_of(c.cols, c0 + c.block_cols);
    U m = 0;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = c0; i < c1; ++i) {
        const U a = U(x[r * c.cols + i] & magnitude);
        m = max_of(m, select(a < exponent, a, U(0)));
      }
    In v;
    memcpy(&v, &m, sizeof(U));
    const double a = bit_cast<double>(Widen<uint64_t>::from(v));
    c.scales[b] = a;
    if (tensor_max != nullptr) atomicMax(tensor_max, (unsigned long long)bit_cast<uint64_t>(a));
  }
}

// The tensor scale from the tensor's largest magnitude (bits in *tensor_max), as scaled_cpu.
__device__ double tensor_scale_of(const ScaledCall& c, const unsigned long long* tensor_max) {
  if (tensor_max == nullptr) return 1.0;
  return tensor_scale(c.scale, bit_cast<double>(uint64_t(*tensor_max)));
}

// The scales pass: each block's largest finite magnitude a in c.scales becomes its scale,
// scale_of(block, a, t, saturated) (a > 0; the empty scale otherwise), the saturated blocks counted.
template <class ScaleOf>
__device__ void scales_pass(const ScaledCall& c, const unsigned long long* tensor_max,
                            unsigned long long* counts, ScaleOf scale_of) {
  const double t = tensor_scale_of(c, tensor_max);
  const double empty = empty_block_scale(c.scale, t);
  const int64_t blocks = c.block_grid_rows() * c.block_grid_cols();
  uint64_t saturated = 0;
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    bool sat = false;
    const double a = c.scales[b];
    c.scales[b] = a > 0.0 ? scale_of(b, a, t, sat) : empty;
    saturated += sat;
  }
  if (counts != nullptr && c.count_blocks) {
    saturated = warp_sum(saturated);
    if ((threadIdx.x & 31) == 0 && saturated) atomicAdd(counts + 4, (unsigned long long)saturated);
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counts + 5, (unsigned long long)blocks);
  }
}

__global__ void __launch_bounds__(kThreads)
scales_kernel(ScaledCall c, const unsigned long long* tensor_max, unsigned long long* counts) {
  scales_pass(c, tensor_max, counts, [&](int64_t, double a, double t, bool& sat) {
    return block_scale(c.scale, a, t, sat);
  });
}

// For a call that chooses among candidate scales (BlockChoice): one thread a block, rounding its
// elements for each candidate (four_over_six_scale, as on the CPU).
template <class In, RoundKind K>
__global__ void __launch_bounds__(kThreads)
choose_scales_kernel(ScaledCall c, const unsigned long long* tensor_max, unsigned long long* counts) {
  scales_pass(c, tensor_max, counts, [&](int64_t b, double a, double t, bool& sat) {
    return four_over_six_scale<In, K>(c, b, a, t, sat);
  });
}

// After scales_kernel: the tensor scale (1 without one, tensor_max null) replaces the largest
// magnitude's bits in their buffer, out.
__global__ void tensor_scale_kernel(ScaledCall c, const unsigned long long* tensor_max,
                                    unsigned long long* out) {
  const double t = tensor_scale_of(c, tensor_max);
  *reinterpret_cast<double*>(out) = t;
}

template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp>
__global__ void __launch_bounds__(kThreads)
elements_kernel(ScaledCall c, unsigned long long* counts) {
  const In* x = static_cast<const In*>(c.x);
  In* y = static_cast<In*>(c.y);
  const int64_t n = c.rows * c.cols, gc = c.block_grid_cols();
  ThreadCounts tc;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / c.cols, col = i % c.cols;
    const double s = c.scales[(r / c.block_rows) * gc + col / c.block_cols];
    uint32_t rw = 0u;
    if constexpr (K == RoundKind::Stochastic)
      rw = philox_block(c.seed, c.offset + uint64_t(i) / 4).w[i % 4];
    RoundEvents ev;
    const double q = scaled_element<K, kPow2, kSubExp>(
        bit_cast<double>(Widen<uint64_t>::from(x[i])), s, 1.0 / s, c.p, rw, ev);
    if (c.q != nullptr) c.q[i] = float(q);
    y[i] = store_scaled<In>(q * s, c.out);
    if (kCount) tc.add(ev);
  }
  if constexpr (kCount) finish_counts(tc, counts, n);
}

}  // namespace

void scaled_cuda(const ScaledCall& c, double* tensor_scale, int64_t* counts, int device,
                 uintptr_t stream_handle) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int64_t n = c.rows * c.cols, blocks = c.block_grid_rows() * c.block_grid_cols();
  auto* tmax = reinterpret_cast<unsigned long long*>(tensor_scale);
  auto* cnt = reinterpret_cast<unsigned long long*>(counts);
  check(cudaMemsetAsync(tmax, 0, sizeof(double), stream), "cudaMemsetAsync");
  if (n == 0) {
    tensor_scale_kernel<<<1, 1, 0, stream>>>(c, nullptr, tmax);
    check(cudaGetLastError(), "kernel launch");
    return;
  }
  with_storage_type(c.dtype, [&](auto type) {
    using In = typename decltype(type)::type;
    amax_kernel<In><<<grid_size(device, blocks), kThreads, 0, stream>>>(c, tmax);
    if (c.scale.choice == BlockChoice::Fixed) {
      scales_kernel<<<grid_size(device, blocks), kThreads, 0, stream>>>(c, c.tensor_scale ? tmax : nullptr, cnt);
    } else {
      with_round_kind(c.mode, [&](auto kind) {
        choose_scales_kernel<In, decltype(kind)::value>
            <<<grid_size(device, blocks), kThreads, 0, stream>>>(c, c.tensor_scale ? tmax : nullptr, cnt);
      });
    }
    tensor_scale_kernel<<<1, 1, 0, stream>>>(c, c.tensor_scale ? tmax : nullptr, tmax);
    with_round_kind(c.mode, [&](auto kind) {
      with_flag(c.count, [&](auto count) {
        with_flag(c.scale.rule != ScaleRule::Format, [&](auto pow2) {
          with_flag(c.p.subnormal_exponent, [&](auto sub) {
            elements_kernel<In, decltype(kind)::value, decltype(count)::value, decltype(pow2)::value,
                            decltype(sub)::value><<<grid_size(device, n), kThreads, 0, stream>>>(c, cnt);
          });
        });
      });
    });
  });
  check(cudaGetLastError(), "kernel launch");
}

namespace {

template <class In, class T>
__global__ void __launch_bounds__(kThreads) hadamard_kernel(HadamardCall c) {
  T signs[kHadamardSize];
  for (int i = 0; i < kHadamardSize; ++i) signs[i] = T(c.signs[i]);
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < c.groups;
       g += int64_t(gridDim.x) * blockDim.x)
    hadamard_group<In>(c, signs, g);
}

}  // namespace

void hadamard_cuda(const HadamardCall& c, int device, uintptr_t stream_handle) {
  if (c.groups == 0) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  with_storage_type(c.dtype, [&](auto type) {
    using In = typename decltype(type)::type;
    using T = std::conditional_t<std::is_same_v<In, double>, double, float>;
    hadamard_kernel<In, T><<<grid_size(device, c.groups), kThreads, 0, stream>>>(c);
  });
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
