// S2FP8 on the GPU (docs/design.md §4): a reduction kernel, a one-thread kernel turning the sums into
// alpha, beta, mu, m, and an element kernel, enqueued on one stream. The math is
// cpp/include/lowfp/s2fp8.hpp's; the reduction is made of integer sums and a max, so its result
// does not depend on how the work is split and equals the CPU's bit for bit. For 16/32-bit x the
// element kernel may take one of the CPU's per-call forms, built on the host once the statistics
// are known (such a call waits for them): from kGpuHostFormMin elements, the threshold form
// (s2fp8_thresholds.cpp) in the deterministic modes and the fast stochastic form
// (s2fp8_stochastic.hpp) with stochastic rounding. Otherwise nothing waits.
#include <vector>

#include "common.cuh"
#include "dispatch.hpp"
#include "lowfp/philox.hpp"
#include "lowfp/s2fp8.hpp"
#include "lowfp/s2fp8_stochastic.hpp"
#include "s2fp8_cuda.hpp"
#include "s2fp8_thresholds.hpp"

namespace lowfp {
namespace {

// Eight threads per reduction group (s2fp8.hpp), four groups per warp pass. A group's rows r
// (0..15) of product lanes 4p + k (p = 0, 1; k = 0..3) are quads 2r + p. Thread u of a group
// (lane % 8) loads rows 4(u / 2) .. 4(u / 2) + 3 of parity p = u % 2, so the tree's first two
// levels are its own, and levels 3 and 4 pair threads u ^ 2 and u ^ 4. Every thread then takes
// the logarithm of one of the 32 lane products of its warp's four groups: one log2 per 16
// elements, spread over all lanes.
template <class T>
__global__ void __launch_bounds__(kThreads)
s2fp8_reduce_kernel(const T* x, int64_t n, bool quad_io, unsigned long long* sums) {
  static_assert(kS2fp8Group == 128 && kS2fp8Lanes == 8, "a group is 8 threads x 4 rows x 4 lanes");
  constexpr bool kSubnormal = std::is_same_v<T, double>;
  S2fp8Partial part;
  const int lane = threadIdx.x & 31, u = lane & 7, parity = u & 1, row0 = 4 * (u >> 1);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t groups = (n + kS2fp8Group - 1) / kS2fp8Group, full_quads = quad_io ? n / 4 : 0;
  for (int64_t pass = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; 4 * pass < groups;
       pass += warps) {
    const int64_t first_quad = 32 * (4 * pass + (lane >> 3));  // past n for a missing group: ones
    Quad<T> in[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) in[j] = load_group(x, first_quad + 2 * (row0 + j) + parity, n, full_quads);
    double f[4][4];  // [row][k]
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // padding elements are +0: the factor 1
        const uint64_t a = Widen<uint64_t>::from(in[j].v[k]) & ~kF64SignBit;
        const bool use = finite_nonzero_abs(a);
        const S2fp8Factor factor = s2fp8_factor<kSubnormal>(a);
        f[j][k] = factor.f;
        part.exp_sum += factor.e;
        part.count += int64_t(use);
        part.max_abs = max_of(part.max_abs, use ? a : uint64_t(0));
      }
    double p[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      p[k] = (f[0][k] * f[1][k]) * (f[2][k] * f[3][k]);  // levels 1 and 2
      p[k] *= __shfl_xor_sync(0xffffffffu, p[k], 2);       // level 3
      p[k] *= __shfl_xor_sync(0xffffffffu, p[k], 4);       // level 4: the lane products
    }
    // Thread u offers product lane 4 p + (u / 2); lane t takes product lane t % 8 of its group.
    const int mine = u >> 1;
    const double offer = mine == 0 ? p[0] : mine == 1 ? p[1] : mine == 2 ? p[2] : p[3];
    const int source = (lane & ~7) | (2 * (lane & 3) + ((lane >> 2) & 1));
    part.low += s2fp8_fixed_log(__shfl_sync(0xffffffffu, offer, source));
    part.carry();
  }
  // Warp sums: high, count and exp_sum as two's-complement adds, low < 2^32 per thread, max of bits.
  uint64_t high = uint64_t(part.high), low = part.low, count = uint64_t(part.count);
  uint64_t exp_sum = uint64_t(part.exp_sum), max_abs = part.max_abs;
  for (int offset = 16; offset > 0; offset >>= 1) {
    high += __shfl_down_sync(0xffffffffu, high, offset);
    low += __shfl_down_sync(0xffffffffu, low, offset);
    count += __shfl_down_sync(0xffffffffu, count, offset);
    exp_sum += __shfl_down_sync(0xffffffffu, exp_sum, offset);
    max_abs = max_of<uint64_t>(max_abs, __shfl_down_sync(0xffffffffu, max_abs, offset));
  }
  if (lane == 0 && count != 0) {
    high += low >> 32;  // the warp's low below 2^32, so the global low sum cannot overflow
    low &= 0xFFFFFFFFull;
    atomicAdd(sums + kSumLogHigh, (unsigned long long)high);
    atomicAdd(sums + kSumLogLow, (unsigned long long)low);
    atomicAdd(sums + kSumCount, (unsigned long long)count);
    atomicAdd(sums + kSumExp, (unsigned long long)exp_sum);
    atomicMax(sums + kSumMaxAbs, (unsigned long long)max_abs);
  }
}

__global__ void s2fp8_stats_kernel(int64_t* sums, double log_max, double* params) {
  // The warps' low words were added without carries: leave the sums in the CPU's form (low < 2^32).
  const uint64_t low = uint64_t(sums[kSumLogLow]);
  sums[kSumLogHigh] += int64_t(low >> 32);
  sums[kSumLogLow] = int64_t(low & 0xFFFFFFFFull);
  const S2fp8Stats s = s2fp8_stats(sums, log_max);
  params[kAlpha] = s.alpha;
  params[kBeta] = s.beta;
  params[kMu] = s.mu;
  params[kMax] = s.m;
}

// x and y may alias (in place): each element is read by the thread that writes it.
template <class T, RoundKind K, bool kCount, bool kSubExp>
__global__ void __launch_bounds__(kThreads)
s2fp8_transform_kernel(const T* x, T* y, int64_t n, bool quad_io, const double* params,
                       RoundParams<uint64_t> p, RoundParams<uint64_t> p_store, uint64_t seed,
                       uint64_t offset, unsigned long long* counts) {
  const S2fp8Stats s{params[kAlpha], params[kBeta], params[kMu], params[kMax]};
  const double inv_alpha = 1.0 / s.alpha;
  round_elements<K, kCount>(x, y, n, quad_io, seed, offset, counts, [&](T v, uint32_t word, RoundEvents& ev) {
    return s2fp8_store<T>(s2fp8_element<K, kSubExp>(Widen<uint64_t>::from(v), s, inv_alpha, p, word, ev),
                          p_store);
  });
}

// The threshold form (S2fp8Thresholds, built on the host once the statistics are known): x' and
// the events from |x|'s bits by two table reads, as the CPU's kernel does.
template <class T, bool kCount>
__global__ void __launch_bounds__(kThreads)
s2fp8_lookup_kernel(const T* x, T* y, int64_t n, bool quad_io, S2fp8Thresholds th,
                    unsigned long long* counts) {
  using Raw = RawOf<T>;
  constexpr uint32_t kInf = kInfRaw<T>, kAbs = kSignRaw<T> - 1;
  constexpr int kSignShift = 8 * sizeof(Raw) - 1;
  ThreadCounts tc;
  transform_groups(x, y, n, quad_io, [&](int64_t g, const Quad<T>& in) {
    Quad<T> out;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t xb = bit_cast<Raw>(in.v[k]), a = xb & kAbs, neg = xb >> kSignShift;
      const uint32_t a_raised = th.raised(a);
      const uint32_t v = th.value_index(a_raised, __ldg(th.entries + th.entry_index(a_raised, neg)));
      out.v[k] = bit_cast<T>(a - 1 < kInf - 1 ? Raw(th.signed_value(__ldg(th.values + v), xb))
                                             : s2fp8_pass_through<T>(Raw(xb)));
      if (kCount && 4 * g + k < n) {
        // (selects: indexing the by-value parameter with neg would copy it to local memory)
        const uint32_t above = neg ? th.above[1] : th.above[0];
        const uint32_t under_lo = neg ? th.under_lo[1] : th.under_lo[0];
        const uint32_t under_hi = neg ? th.under_hi[1] : th.under_hi[0];
        const bool nan = a > kInf;
        tc.overflow += uint32_t(a >= above && !nan);  // above max, as RoundEvents
        tc.underflow += uint32_t(a - under_lo < under_hi - under_lo);
        tc.nan += uint32_t(nan);
      }
    }
    return out;
  });
  if constexpr (kCount) finish_counts(tc, counts, n);
}

// The fast stochastic form (S2fp8FastStochastic and its table, built on the host): x' read from
// the table at the grid index of the rounded Y, or by the float64 path where the form leaves the
// element ambiguous (a few in a thousand: the branch diverges rarely per warp).
template <class T, bool kCount>
__global__ void __launch_bounds__(kThreads)
s2fp8_stochastic_kernel(const T* x, T* y, int64_t n, bool quad_io, S2fp8FastStochastic form,
                        const uint32_t* values, S2fp8Stats s, RoundParams<uint64_t> p,
                        RoundParams<uint64_t> p_store, uint64_t seed, uint64_t offset,
                        unsigned long long* counts) {
  using Raw = RawOf<T>;
  const double inv_alpha = 1.0 / s.alpha;
  ThreadCounts tc;
  transform_groups(x, y, n, quad_io, [&](int64_t g, const Quad<T>& in) {
    const Philox4x32Block r = philox_block(seed, offset + uint64_t(g));
    Quad<T> out;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t xb = Widen<uint32_t>::from(in.v[k]), a = xb & 0x7FFFFFFFu;
      const bool finite_nonzero = a - 1 < 0x7F7FFFFFu;
      const uint32_t grid =
          finite_nonzero ? s2fp8_fast_grid_index(s2fp8_fast_log_y(xb, form), r.w[k], form) : 0u;
      const uint32_t idx = s2fp8_fast_table_index(grid, xb, form);
      const bool counted = kCount && 4 * g + k < n;
      if (idx < kS2fp8Ambiguous) {
        const uint32_t value = s2fp8_fast_signed_value(__ldg(values + idx), xb, form);
        out.v[k] = bit_cast<T>(finite_nonzero ? Raw(value)
                                              : s2fp8_pass_through<T>(bit_cast<Raw>(in.v[k])));
        if (counted) {  // as RoundEvents: an infinite x overflows, NaN is counted as NaN only
          tc.overflow += uint32_t((finite_nonzero && s2fp8_fast_above_max(grid, form)) || a == 0x7F800000u);
          tc.underflow += uint32_t(finite_nonzero && s2fp8_fast_underflow(grid));
          tc.nan += uint32_t(a > 0x7F800000u);
        }
      } else {
        RoundEvents ev;
        const uint64_t v = s2fp8_element<RoundKind::Stochastic, false>(
            Widen<uint64_t>::from(in.v[k]), s, inv_alpha, p, r.w[k], ev);
        out.v[k] = s2fp8_store<T>(v, p_store);
        if (counted) tc.add(ev);
      }
    }
    return out;
  });
  if constexpr (kCount) finish_counts(tc, counts, n);
}

// The statistics on the host: waits for the stream.
S2fp8Stats stats_on_host(const double* params, cudaStream_t stream) {
  double host[kParamSize];
  check(cudaMemcpyAsync(host, params, sizeof(host), cudaMemcpyDeviceToHost, stream), "copy");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return {host[kAlpha], host[kBeta], host[kMu], host[kMax]};
}

// A host-built table on the device for the kernels enqueued after it on the stream; free_table
// releases it in stream order once they are enqueued.
uint32_t* upload_table(const std::vector<uint32_t>& storage, cudaStream_t stream) {
  void* table = nullptr;
  const size_t bytes = storage.size() * sizeof(uint32_t);
  check(cudaMallocAsync(&table, bytes, stream), "cudaMallocAsync");
  check(cudaMemcpyAsync(table, storage.data(), bytes, cudaMemcpyHostToDevice, stream), "copy");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // storage is pageable
  return static_cast<uint32_t*>(table);
}

void free_table(uint32_t* table, cudaStream_t stream) { check(cudaFreeAsync(table, stream), "cudaFreeAsync"); }

// Below this many elements the float64 kernel costs less than a host-built form: the wait for
// the statistics, the build and the table's upload cost a fixed time that the form's saving per
// element repays only on large tensors (measured on an H100, bench/profile_gpu.py).
constexpr int64_t kGpuHostFormMin = int64_t(1) << 24;

}  // namespace

void s2fp8_cuda(const S2fp8Call& c, int64_t* sums, double* params, int64_t* counts, int device,
                uintptr_t stream_handle) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto* sums_u = reinterpret_cast<unsigned long long*>(sums);
  check(cudaMemsetAsync(sums, 0, kSumSize * sizeof(int64_t), stream), "cudaMemsetAsync");
  const int grid = grid_size(device, max_of<int64_t>((c.q.n + 3) / 4, 1));  // a thread per quad
  const bool try_thresholds = c.q.n >= kGpuHostFormMin && s2fp8_threshold_form_allowed(c);
  const bool try_stochastic = c.q.n >= kGpuHostFormMin && s2fp8_stochastic_form_allowed(c);
  dispatch_s2fp8(c.q, [&](auto in, auto, auto, auto kind, auto count, auto sub_exp) {
    using T = typename decltype(in)::type;
    constexpr bool kCount = decltype(count)::value;
    const T* x = static_cast<const T*>(c.q.x);
    T* y = static_cast<T*>(c.q.y);
    auto* counts_u = reinterpret_cast<unsigned long long*>(counts);
    const bool quad_io = quad_aligned<T>(x) && quad_aligned<T>(y);
    if (c.q.n > 0) s2fp8_reduce_kernel<T><<<grid, kThreads, 0, stream>>>(x, c.q.n, quad_io, sums_u);
    s2fp8_stats_kernel<<<1, 1, 0, stream>>>(sums, c.log_max, params);
    if constexpr (!std::is_same_v<T, double>) {
      if (try_thresholds || try_stochastic) {
        const S2fp8Stats s = stats_on_host(params, stream);
        std::vector<uint32_t> storage;
        S2fp8Thresholds th;
        S2fp8StochasticForm form;
        if (try_thresholds && s2fp8_build_thresholds(c, s, th, storage)) {
          uint32_t* table = upload_table(storage, stream);
          th.entries = table + (th.entries - storage.data());
          th.values = table + (th.values - storage.data());
          s2fp8_lookup_kernel<T, kCount><<<grid, kThreads, 0, stream>>>(x, y, c.q.n, quad_io, th, counts_u);
          return free_table(table, stream);
        }
        if (try_stochastic && s2fp8_build_stochastic(c, s, form, storage)) {
          uint32_t* table = upload_table(storage, stream);
          s2fp8_stochastic_kernel<T, kCount><<<grid, kThreads, 0, stream>>>(
              x, y, c.q.n, quad_io, form.k, table + (form.values - storage.data()), s, c.q.p64,
              c.p_store, c.q.seed, c.q.offset, counts_u);
          return free_table(table, stream);
        }
      }
    }
    if (c.q.n > 0)
      s2fp8_transform_kernel<T, decltype(kind)::value, kCount, decltype(sub_exp)::value>
          <<<grid, kThreads, 0, stream>>>(x, y, c.q.n, quad_io, params, c.q.p64, c.p_store,
                                          c.q.seed, c.q.offset, counts_u);
  });
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
