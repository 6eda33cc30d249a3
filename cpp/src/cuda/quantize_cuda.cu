// The quantize kernel: the shared element math of cpp/include/lowfp/ in a grid-stride loop over
// groups of four elements (vector loads and stores; one Philox block per group when rounding
// stochastically). Counts are reduced per warp and added to the device buffer with atomics.
#include <type_traits>

#include "common.cuh"
#include "dispatch.hpp"
#include "lowfp/philox.hpp"
#include "quantize_cuda.hpp"

namespace lowfp {
namespace {

// Each thread takes one group of four consecutive elements per grid-stride step. Stochastic
// rounding draws group g's four words from Philox block offset + g (docs/design.md §3), so every word is
// drawn once.
// x and y are not __restrict__: quantize_(x) and out=x pass the same buffer (each element is read
// by the thread that writes it, before it writes it). kForm: the call's element form
// (with_element_form), with the format's largest exponent + 1 e_cap.
template <class In, class Out, class Bits, RoundKind K, bool kCount, bool kSubExp, ElementForm kForm>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const In* x, Out* y, int64_t n, RoundParams<Bits> p, int32_t e_cap, uint64_t seed,
                uint64_t offset, unsigned long long* counts, bool quad_io) {
  round_elements<K, kCount>(x, y, n, quad_io, seed, offset, counts, [&](In v, uint32_t word, RoundEvents& ev) {
    return Store<Out>::from(round_element<K, Bits, kSubExp, kForm>(Widen<Bits>::from(v), p, word, e_cap, ev));
  });
}

// any_non_finite in one launch: each block ORs its elements' flags, ORs the result into
// scratch[0] and takes a ticket from scratch[1]; the last block to finish (which, after the
// fence, sees every other block's OR) writes the answer and the counts and puts both scratch
// words back to zero for the next call on the stream.
template <class U>
__global__ void any_non_finite_kernel(const U* x, int64_t n, U exponent, bool* out,
                                      long long* counts, int64_t n_counts, unsigned* scratch) {
  U any = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    any |= U(non_finite_bits(x[i], exponent));
  const int block_any = __syncthreads_or(any != 0);
  if (threadIdx.x != 0) return;
  if (block_any) atomicOr(scratch, 1u);
  __threadfence();
  if (atomicAdd(scratch + 1, 1u) != gridDim.x - 1) return;
  const unsigned found = atomicExch(scratch, 0u);
  atomicExch(scratch + 1, 0u);
  *out = found != 0;
  for (int64_t i = 0; i < n_counts; ++i) counts[i] += found;
}

// count_unchanged in one launch: each warp adds its elements' NaNs to counts[2] by one atomic, and
// the first thread adds n to counts[3].
template <class U>
__global__ void __launch_bounds__(kThreads)
count_unchanged_kernel(const U* x, int64_t n, U exponent, unsigned long long* counts) {
  uint64_t nans = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    nans += nan_bits(x[i], exponent);
  nans = warp_sum(nans);
  if ((threadIdx.x & 31) == 0 && nans != 0) atomicAdd(counts + 2, (unsigned long long)nans);
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counts + 3, (unsigned long long)n);
}

}  // namespace

void count_unchanged_cuda(DType t, const void* x, int64_t n, int64_t* counts, int device, uintptr_t stream_handle) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int blocks = n == 0 ? 1 : grid_size(device, n);
  auto* c = reinterpret_cast<unsigned long long*>(counts);
  switch (t) {
    case DType::Float16:
    case DType::BFloat16:
      count_unchanged_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(x), n,
                                                              uint16_t(exponent_mask(t)), c);
      break;
    case DType::Float32:
      count_unchanged_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint32_t*>(x), n,
                                                              uint32_t(exponent_mask(t)), c);
      break;
    default:
      count_unchanged_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint64_t*>(x), n,
                                                              uint64_t(exponent_mask(t)), c);
      break;
  }
  check(cudaGetLastError(), "kernel launch");
}

void any_non_finite_cuda(DType t, const void* x, int64_t n, bool* out, int64_t* counts,
                         int64_t n_counts, uint32_t* scratch, int device, uintptr_t stream_handle) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int blocks = n == 0 ? 1 : grid_size(device, n);
  auto launch = [&](auto* bits) {
    using U = std::remove_const_t<std::remove_pointer_t<decltype(bits)>>;
    any_non_finite_kernel<U><<<blocks, kThreads, 0, stream>>>(
        static_cast<const U*>(x), n, U(exponent_mask(t)), out,
        reinterpret_cast<long long*>(counts), n_counts, scratch);
  };
  switch (t) {
    case DType::Float16:
    case DType::BFloat16: launch(static_cast<const uint16_t*>(nullptr)); break;
    case DType::Float32: launch(static_cast<const uint32_t*>(nullptr)); break;
    default: launch(static_cast<const uint64_t*>(nullptr)); break;
  }
  check(cudaGetLastError(), "kernel launch");
}

void quantize_cuda(const QuantizeCall& c, int64_t* counts, int device, uintptr_t stream_handle) {
  if (c.n == 0) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  dispatch_quantize(c, [&](auto in, auto out, auto bits, auto kind, auto count, auto sub_exp) {
    using In = typename decltype(in)::type;
    using Out = typename decltype(out)::type;
    using Bits = typename decltype(bits)::type;
    constexpr RoundKind K = decltype(kind)::value;
    constexpr bool kSubExp = decltype(sub_exp)::value;
    const bool quad_io = quad_aligned<In>(c.x) && quad_aligned<Out>(c.y);
    with_element_form<In, Out, Bits, K, kSubExp>(c, [&](auto form) {
      quantize_kernel<In, Out, Bits, K, decltype(count)::value, kSubExp, decltype(form)::value>
          <<<grid_size(device, (c.n + 3) / 4), kThreads, 0, stream>>>(
              static_cast<const In*>(c.x), static_cast<Out*>(c.y), c.n, round_params<Bits>(c), c.addition_cap,
              c.seed, c.offset, reinterpret_cast<unsigned long long*>(counts), quad_io);
    });
  });
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
