// Scaled formats on the GPU (docs/design.md §9), with the element and scale math of
// cpp/include/lowfp/scaled.hpp; elements take the float64 carrier, or in the one-pass forms one
// of the CPU's float32 carriers where a call allows it (ScaledCall::narrow for power-of-two
// scales, ScaledCall::checked for scales in a format), whose results the CPU's other carriers
// equal (tests/test_scaled.py, tests/test_scaled_strategies.py), so CPU = GPU bit for bit. Four
// forms of a call:
// - 1-D blocks along the rows whose width is a power of two from 4 to 128 dividing the row (MX,
//   NVFP4) and a single scale candidate: one pass (row_blocks_kernel in scaled_rows.cu), a group of lanes per block
//   holding one or two quads of it each (row_blocks_schedule.hpp), the block's largest magnitude
//   by shuffles, its scale and elements from registers (the per-thread code in
//   scaled_one_pass.hpp, which a test runs on the CPU); a tensor scale takes a coalesced
//   reduction first.
// - Blocks down the columns (block_cols 1, a GEMM operand along its reduction axis): one pass
//   (column_blocks_kernel in scaled_columns.cu), a thread per block, consecutive threads on consecutive columns.
// - Blocks of 256 to 2^16 elements whose rows are whole quads (a row's scale, 128 × 128 tiles) and
//   a single scale candidate: one pass a block (tile_blocks_kernel in scaled_tiles.cu), a thread block reading the
//   block coalesced for its largest magnitude and again to round it.
// - Any other blocks: each block's largest finite magnitude by a thread block of its own reading
//   its rows coalesced (the whole grid for a single block), the scales in place, then the elements
//   in a grid-stride loop (a single block's in groups of four).
#include <type_traits>

#include "lowfp/philox.hpp"
#include "scaled_cuda.hpp"
#include "scaled_device.cuh"

namespace lowfp {
namespace {

// The largest finite magnitude of the call's elements into *target and, when not null, *also
// (both zeroed before): the whole grid reading quads of consecutive elements.
template <class In>
__global__ void __launch_bounds__(kThreads)
tensor_amax_kernel(ScaledCall c, bool quad_io, unsigned long long* target, unsigned long long* also) {
  using U = RawOf<In>;
  const U* x = static_cast<const U*>(c.x);
  const U exponent = U(exponent_mask(c.dtype));
  const int64_t n = c.rows * c.cols, groups = (n + 3) / 4, full_groups = quad_io ? n / 4 : 0;
  U m = 0;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const Quad<U> v = load_group(x, g, n, full_groups);  // (a short last group reads 0s)
#pragma unroll
    for (int k = 0; k < 4; ++k) m = max_of(m, finite_magnitude(v.v[k], exponent));
  }
  const double a = raw_value<In>(m);
  warp_max_into(target, a);
  if (also != nullptr) warp_max_into(also, a);
}

// Each block's largest finite magnitude into c.scales, one thread block per block (grid-stride
// over the blocks), its threads reading the block row by row (BlockShare); the tensor's into
// *tensor_max when not null (zeroed before).
template <class In>
__global__ void __launch_bounds__(kThreads)
block_amax_kernel(ScaledCall c, unsigned long long* tensor_max) {
  using U = RawOf<In>;
  const U* x = static_cast<const U*>(c.x);
  const U exponent = U(exponent_mask(c.dtype));
  const int64_t gc = c.block_grid_cols(), blocks = c.block_grid_rows() * gc;
  __shared__ uint64_t warp_maxima[kThreads / 32];
  U tensor_m = 0;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const ScaledBlock at = c.block(b);
    U m = 0;
    BlockShare(at.w, threadIdx.x, blockDim.x).each(at.h, at.w, [&](int64_t r, int64_t u) {
      m = max_of(m, finite_magnitude(x[(at.r0 + r) * c.cols + at.c0 + u], exponent));
    });
    tensor_m = max_of(tensor_m, m);
    const uint64_t bm = thread_block_max(bit_cast<uint64_t>(raw_value<In>(m)), warp_maxima);
    if (threadIdx.x == 0) c.scales[b] = bit_cast<double>(bm);
    __syncthreads();
  }
  if (tensor_max != nullptr) warp_max_into(tensor_max, raw_value<In>(tensor_m));
}

enum class OnePass { Rows, Columns, Tiles };

// Enqueues a call of one of the one-pass forms (row_blocks, column_blocks, tile_blocks): the
// tensor's largest magnitude first for a tensor scale, then the kernel's instance for the call
// (with_one_pass_instance: its storage type, rounding kind, carrier and faster forms).
void one_pass(const ScaledCall& c, OnePass form, int device, cudaStream_t stream, unsigned long long* tmax,
              const unsigned long long* tmax_in, unsigned long long* cnt) {
  const int64_t n = c.rows * c.cols;
  const int64_t blocks = c.block_grid_rows() * c.block_grid_cols();
  const int64_t threads = form == OnePass::Rows      ? n / (4 * RowBlocksSchedule(c.block_cols, 0).quads)
                          : form == OnePass::Columns ? c.block_grid_rows() * c.cols
                                                     : blocks * kThreads;
  const int grid = grid_size(device, threads);
  if (c.tensor_scale)
    with_storage_type(c.dtype, [&](auto type) {
      using In = typename decltype(type)::type;
      tensor_amax_kernel<In><<<grid_size(device, (n + 3) / 4), kThreads, 0, stream>>>(c, quad_aligned<In>(c.x), tmax,
                                                                                     nullptr);
    });
  if (form == OnePass::Rows) row_blocks_cuda(c, grid, stream, tmax_in, cnt);
  else if (form == OnePass::Columns) column_blocks_cuda(c, grid, stream, tmax_in, cnt);
  else tile_blocks_cuda(c, grid, stream, tmax_in, cnt);
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
  count_blocks(c, saturated, blocks, counts);
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

// After the scales: the tensor scale (1 without one, tensor_max null) replaces the largest
// magnitude's bits in their buffer, out.
__global__ void tensor_scale_kernel(ScaledCall c, const unsigned long long* tensor_max,
                                    unsigned long long* out) {
  const double t = tensor_scale_of(c, tensor_max);
  *reinterpret_cast<double*>(out) = t;
}

// The elements pass, after the scales. kSingle: one scale and row-major words (a tensor's scale):
// groups of four consecutive elements, one vector access (quad_io) and one Philox block a group,
// in the checked float32 carrier where kChecked (ScaledCall::checked: float32 inputs, the scale
// in a format); else an element a thread, its block's scale found from its row and column.
template <class In, RoundKind K, bool kCount, bool kPow2, bool kSubExp, bool kSingle, bool kChecked>
__global__ void __launch_bounds__(kThreads)
elements_kernel(ScaledCall c, bool quad_io, const unsigned long long* tensor_max, unsigned long long* counts) {
  const In* x = static_cast<const In*>(c.x);
  In* y = static_cast<In*>(c.y);
  const int64_t n = c.rows * c.cols, gc = c.block_grid_cols();
  ThreadCounts tc;
  if constexpr (kSingle) {
    BlockForms f{};
    f.s = c.scales[0];
    f.inv = inverse_of<kPow2>(f.s);
    if constexpr (kChecked) {
      const double t = tensor_scale_of(c, tensor_max);
      f = checked_forms(f.s, f.s / t, t);  // (s / t: S, exactly)
    }
    transform_groups(x, y, n, quad_io, [&](int64_t g, const Quad<In>& in) {
      Philox4x32Block words = {{0u, 0u, 0u, 0u}};
      if constexpr (K == RoundKind::Stochastic) words = philox_block(c.seed, c.offset + uint64_t(g));
      Quad<In> out = in;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (4 * g + k >= n) continue;  // (a short last group's padding is neither rounded nor stored)
        if constexpr (kChecked) out.v[k] = round_checked<K, kCount>(c, in.v[k], 4 * g + k, f, words.w[k], tc);
        else out.v[k] = round_scaled<In, K, kCount, kPow2, kSubExp>(c, in.v[k], 4 * g + k, f.s, f.inv, words.w[k], tc);
      }
      return out;
    });
  } else {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
      const int64_t r = i / c.cols, col = i % c.cols;
      const double s = c.scales[(r / c.block_rows) * gc + col / c.block_cols];
      uint32_t word = 0u;
      if constexpr (K == RoundKind::Stochastic) {
        const uint64_t w = c.word_index(r, col);
        word = philox_block(c.seed, c.offset + w / 4).w[w % 4];
      }
      y[i] = round_scaled<In, K, kCount, kPow2, kSubExp>(c, x[i], i, s, inverse_of<kPow2>(s), word, tc);
    }
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
  auto* tmax_in = c.tensor_scale ? tmax : nullptr;  // what the scales read (null: t = 1)
  auto* cnt = reinterpret_cast<unsigned long long*>(counts);
  auto* scale_bits = reinterpret_cast<unsigned long long*>(c.scales);
  if (c.tensor_scale) check(cudaMemsetAsync(tmax, 0, sizeof(double), stream), "cudaMemsetAsync");
  if (n == 0) {
    tensor_scale_kernel<<<1, 1, 0, stream>>>(c, nullptr, tmax);
    check(cudaGetLastError(), "kernel launch");
    return;
  }
  const bool rows = row_blocks(c), columns = !rows && column_blocks(c), tiles = !rows && !columns && tile_blocks(c, kThreads);
  if (rows || columns || tiles) {
    one_pass(c, rows ? OnePass::Rows : columns ? OnePass::Columns : OnePass::Tiles, device, stream, tmax, tmax_in, cnt);
  } else {
    with_storage_type(c.dtype, [&](auto type) {
      using In = typename decltype(type)::type;
      if (blocks == 1) {  // one scale for the tensor: the whole grid reduces it
        check(cudaMemsetAsync(scale_bits, 0, sizeof(double), stream), "cudaMemsetAsync");
        tensor_amax_kernel<In><<<grid_size(device, (n + 3) / 4), kThreads, 0, stream>>>(
            c, quad_aligned<In>(c.x), scale_bits, tmax_in);
      } else {
        const int grid = int(min_of<int64_t>(blocks, int64_t(grid_size(device, int64_t(1) << 40))));
        block_amax_kernel<In><<<grid, kThreads, 0, stream>>>(c, tmax_in);
      }
      if (c.scale.choice == BlockChoice::Fixed) {
        scales_kernel<<<grid_size(device, blocks), kThreads, 0, stream>>>(c, tmax_in, cnt);
      } else {
        with_round_kind(c.mode, [&](auto kind) {
          choose_scales_kernel<In, decltype(kind)::value>
              <<<grid_size(device, blocks), kThreads, 0, stream>>>(c, tmax_in, cnt);
        });
      }
      const bool single = blocks == 1 && c.word_run == 0;
      with_round_kind(c.mode, [&](auto kind) {
        with_flag(c.count, [&](auto count) {
          with_flag(c.scale.rule != ScaleRule::Format, [&](auto pow2) {
            with_flag(c.p.subnormal_exponent, [&](auto sub) {
              with_flag(single, [&](auto single_c) {
                constexpr RoundKind K = decltype(kind)::value;
                constexpr bool kPow2 = decltype(pow2)::value, kSub = decltype(sub)::value,
                               kSingle = decltype(single_c)::value;
                // (the checked carrier: c.checked's float32 inputs and scales in a format)
                constexpr bool kMayCheck = std::is_same_v<In, float> && kSingle && !kPow2 && !kSub &&
                                           (K == RoundKind::Nearest || K == RoundKind::Stochastic);
                with_flag(kMayCheck && c.checked, [&](auto checked) {
                  elements_kernel<In, K, decltype(count)::value, kPow2, kSub, kSingle,
                                  decltype(checked)::value && kMayCheck>
                      <<<grid_size(device, single ? (n + 3) / 4 : n), kThreads, 0, stream>>>(
                          c, quad_aligned<In>(c.x) && quad_aligned<In>(c.y), tmax_in, cnt);
                });
              });
            });
          });
        });
      });
    });
  }
  // (after every reader of the largest magnitude)
  tensor_scale_kernel<<<1, 1, 0, stream>>>(c, tmax_in, tmax);
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
