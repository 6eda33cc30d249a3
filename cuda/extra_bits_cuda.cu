// Extra bits on the GPU (DESIGN §5): split, merge and the fused optimizer step of a whole
// parameter group in one launch. A warp owns one 32-element packed block at a time (lane j =
// element j), so a block's q words are read and written by that warp alone: each lane reads its
// bits directly, and each packed word is assembled with a warp OR-reduction (no shared memory).
// The element math is cpp/include/lowfp/extra_bits.hpp and optim_math.hpp, as on the CPU.
#include "common.cuh"
#include "extra_bits_cuda.hpp"
#include "extra_bits_dispatch.hpp"
#include "lowfp/philox.hpp"

namespace lowfp {
namespace {

// Lane j's q-bit value of a packed block.
__device__ uint32_t read_packed(const uint32_t* block, uint32_t q, uint32_t lane) {
  return unpack_one(block, q, lane);
}

// Writes the warp's 32 values (lane j: value < 2^q) into the block's q words.
__device__ void write_packed(uint32_t* block, uint32_t q, uint32_t lane, uint32_t value) {
  const uint32_t bit = lane * q, word = bit >> 5, shift = bit & 31;
  const uint32_t low = value << shift;
  const uint32_t high = shift + q > 32 ? value >> (32 - shift) : 0u;
  for (uint32_t i = 0; i < q; ++i) {
    const uint32_t mine = (word == i ? low : 0u) | (word + 1 == i ? high : 0u);
    const uint32_t w = __reduce_or_sync(0xffffffffu, mine);
    if (lane == i) block[i] = w;
  }
}

// The Philox word of element i (a block of 4 per counter; DESIGN §3's scheme).
__device__ uint32_t philox_word(uint64_t seed, uint64_t block_offset, int64_t i) {
  return philox_block(seed, block_offset + uint64_t(i) / 4).w[i % 4];
}

struct SlotTable {
  const ExtraBitsSlot* slots;
  const int64_t* first_block;  // prefix sums of the slots' block counts (n_slots + 1 entries)
  int32_t n_slots;
};

__device__ int32_t slot_of(const SlotTable& t, int64_t block) {
  int32_t lo = 0, hi = t.n_slots - 1;  // last slot whose first_block <= block
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= block) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <class W16, RoundKind K, class Maker>
__global__ void __launch_bounds__(kThreads)
step_kernel(SlotTable table, ExtraBitsParams e, SgdHyper sgd, AdamHyper adam,
            RoundParams<uint32_t> state_round, uint64_t seed, int64_t numel,
            unsigned long long* counts) {
  const uint32_t lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t total = table.first_block[table.n_slots];
  ThreadCounts tc;
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; b < total; b += warps) {
    const int32_t which = slot_of(table, b);
    const ExtraBitsSlot& slot = table.slots[which];
    const int64_t local = b - table.first_block[which];
    const int64_t i = local * 32 + lane;
    uint32_t* block = slot.words + local * e.q;
    const uint32_t value = read_packed(block, e.q, lane);
    uint32_t out = 0;
    if (i < slot.n) {
      W16* w16 = static_cast<W16*>(slot.w16);
      const W16* grad = static_cast<const W16*>(slot.grad);
      const auto update = Maker::make(sgd, adam, state_round, slot);
      const uint32_t w = merge_bits<W16>(truncation_bits(w16[i], value >> e.k), value & ((1u << e.k) - 1u), e);
      const float g = bit_cast<float>(Widen<uint32_t>::from(grad[i]));
      const float w_new = update(bit_cast<float>(w), g, i);
      const uint32_t r = K == RoundKind::Stochastic ? philox_word(seed, slot.rand_offset, i) : 0u;
      uint32_t extra, flag;
      RoundEvents ev;
      w16[i] = Store<W16>::from(split_bits<W16, K, false>(bit_cast<uint32_t>(w_new), e, r, extra, flag, ev));
      out = extra | (flag << e.k);
      tc.add(ev);
    }
    write_packed(block, e.q, lane, out);
  }
  if (counts != nullptr) finish_counts(tc, counts, numel);
}

template <class W16, RoundKind K>
__global__ void __launch_bounds__(kThreads)
split_kernel(const float* w32, W16* w16, uint32_t* words, int64_t n, ExtraBitsParams e,
             uint64_t seed, uint64_t offset, unsigned long long* counts) {
  const uint32_t lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  ThreadCounts tc;
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; b < (n + 31) / 32; b += warps) {
    const int64_t i = b * 32 + lane;
    uint32_t out = 0;
    if (i < n) {
      const uint32_t r = K == RoundKind::Stochastic ? philox_word(seed, offset, i) : 0u;
      uint32_t extra, flag;
      RoundEvents ev;
      w16[i] = Store<W16>::from(split_bits<W16, K, false>(bit_cast<uint32_t>(w32[i]), e, r, extra, flag, ev));
      out = extra | (flag << e.k);
      tc.add(ev);
    }
    write_packed(words + b * e.q, e.q, lane, out);
  }
  if (counts != nullptr) finish_counts(tc, counts, n);
}

template <class W16>
__global__ void __launch_bounds__(kThreads)
merge_kernel(const W16* w16, const uint32_t* words, float* w32, int64_t n, ExtraBitsParams e) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t value = unpack_one(words + (i / 32) * e.q, e.q, uint32_t(i % 32));
    w32[i] = bit_cast<float>(merge_bits<W16>(truncation_bits(w16[i], value >> e.k), value & ((1u << e.k) - 1u), e));
  }
}

}  // namespace

void extra_bits_step_cuda(const ExtraBitsStep& s, int64_t* counts, int device, uintptr_t stream_handle) {
  if (s.slots.empty()) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  // The slot table travels in one device buffer: slots, then the block prefix sums.
  const int32_t n = int32_t(s.slots.size());
  std::vector<int64_t> first(n + 1, 0);
  int64_t numel = 0;
  for (int32_t i = 0; i < n; ++i) {
    first[i + 1] = first[i] + (s.slots[i].n + 31) / 32;
    numel += s.slots[i].n;
  }
  const size_t slot_bytes = n * sizeof(ExtraBitsSlot), prefix_bytes = (n + 1) * sizeof(int64_t);
  void* table = nullptr;
  check(cudaMallocAsync(&table, slot_bytes + prefix_bytes, stream), "cudaMallocAsync");
  check(cudaMemcpyAsync(table, s.slots.data(), slot_bytes, cudaMemcpyHostToDevice, stream), "copy");
  check(cudaMemcpyAsync(static_cast<char*>(table) + slot_bytes, first.data(), prefix_bytes,
                        cudaMemcpyHostToDevice, stream), "copy");
  // The host vectors must outlive the copies from pageable memory: wait for them.
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const SlotTable t{static_cast<const ExtraBitsSlot*>(table),
                    reinterpret_cast<const int64_t*>(static_cast<char*>(table) + slot_bytes), n};
  const int grid = grid_size(device, first[n] * 32);
  dispatch_extra_bits_step(s, [&](auto w16, auto kind, auto maker) {
    step_kernel<typename decltype(w16)::type, decltype(kind)::value, typename decltype(maker)::type>
        <<<grid, kThreads, 0, stream>>>(t, s.e, s.sgd, s.adam, s.state_round, s.seed, numel,
                                        reinterpret_cast<unsigned long long*>(counts));
  });
  check(cudaGetLastError(), "kernel launch");
  check(cudaFreeAsync(table, stream), "cudaFreeAsync");
}

void extra_bits_split_cuda(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a,
                           int64_t* counts, int device, uintptr_t stream_handle) {
  if (a.n == 0) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  dispatch_extra_bits_kind(e, mode, [&](auto w16, auto kind) {
    using W16 = typename decltype(w16)::type;
    split_kernel<W16, decltype(kind)::value><<<grid_size(device, a.n), kThreads, 0, stream>>>(
        a.w32, static_cast<W16*>(a.w16), a.words, a.n, e, a.seed, a.offset,
        reinterpret_cast<unsigned long long*>(counts));
  });
  check(cudaGetLastError(), "kernel launch");
}

void extra_bits_merge_cuda(const ExtraBitsParams& e, const ExtraBitsMerge& a, int device,
                           uintptr_t stream_handle) {
  if (a.n == 0) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto run = [&](auto w16) {
    using W16 = typename decltype(w16)::type;
    merge_kernel<W16><<<grid_size(device, a.n), kThreads, 0, stream>>>(
        static_cast<const W16*>(a.w16), a.words, a.w32, a.n, e);
  };
  if (e.bf16) run(Type<BFloat>{});
  else run(Type<Half>{});
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
