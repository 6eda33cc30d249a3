// Extra bits on the GPU (DESIGN §5): split, merge and the fused optimizer step of a whole
// parameter group in one launch. A warp owns a chunk of consecutive 32-element packed blocks of
// one parameter at a time (lane j = element j of each block), so a block's q words are read and
// written by that warp alone: each lane reads its bits directly, and the words are assembled in
// the warp's own shared scratch (no races with other warps).
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

// Writes the warp's 32 values (lane j: value < 2^q) into the block's q words: each lane ORs its
// bits into (at most two of) the words in the warp's shared scratch, then lanes 0..q-1 store them.
__device__ void write_packed(uint32_t* block, uint32_t q, uint32_t lane, uint32_t value,
                             uint32_t* scratch) {
  if (lane < q) scratch[lane] = 0;
  __syncwarp();
  const uint32_t bit = lane * q, word = bit >> 5, shift = bit & 31;
  atomicOr(scratch + word, value << shift);
  if (shift + q > 32) atomicOr(scratch + word + 1, value >> (32 - shift));
  __syncwarp();
  if (lane < q) block[lane] = scratch[lane];
  __syncwarp();  // the scratch is reused by the warp's next block
}

// Each warp's scratch for write_packed: a block's q words.
__device__ uint32_t* warp_scratch() {
  __shared__ uint32_t scratch[kThreads / 32][kMaxPackedBits];
  return scratch[threadIdx.x / 32];
}

// The Philox word of element i (a block of 4 per counter; DESIGN §3's scheme).
__device__ uint32_t philox_word(uint64_t seed, uint64_t block_offset, int64_t i) {
  return philox_block(seed, block_offset + uint64_t(i) / 4).w[i % 4];
}

struct SlotTable {
  const ExtraBitsSlot* slots;
  const int64_t* first_chunk;  // prefix sums of the slots' chunk counts (n_slots + 1 entries)
  int32_t n_slots;
};

// Packed blocks per chunk. H100, 1.04e8 bfloat16 parameters, k = 8: SGD(momentum) 1.13 / 1.03 /
// 0.88 ms and AdamW 1.48 / 1.35 / 1.34 ms for 1 / 2 / 4 blocks (bench/profile_gpu.py).
constexpr int kBlocksPerChunk = 4;

// A warp steps one chunk at a time: kBlocksPerChunk consecutive packed blocks of one parameter,
// whose slot it reads once. It first issues every load of the chunk (packed words, weights,
// gradients, optimizer state), then the updates and stores, so that several blocks' bytes are
// in flight per warp rather than one.
template <class W16, RoundKind K, class Maker>
__global__ void __launch_bounds__(kThreads)
step_kernel(SlotTable table, ExtraBitsParams e, SgdHyper sgd, AdamHyper adam, uint64_t seed,
            int64_t numel, unsigned long long* counts) {
  using Update = decltype(Maker::make(sgd, adam, table.slots[0]));
  constexpr int U = kBlocksPerChunk;
  const uint32_t lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t total = table.first_chunk[table.n_slots];
  int32_t which = 0;  // the slot of the warp's last chunk: its chunks only move forward
  uint32_t* const scratch = warp_scratch();
  ThreadCounts tc;
  for (int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; c < total; c += warps) {
    while (table.first_chunk[which + 1] <= c) ++which;  // c, and so which, is the warp's
    const ExtraBitsSlot slot = table.slots[which];  // a copy: the stores below cannot change it
    const Update update = Maker::make(sgd, adam, slot);
    const int64_t b0 = (c - table.first_chunk[which]) * U, blocks = (slot.n + 31) / 32;
    uint32_t value[U];
    W16 w16_old[U], grad[U];
    typename Update::State state[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // loads
      if (b0 + u >= blocks) break;
      const int64_t i = (b0 + u) * 32 + lane;
      value[u] = read_packed(slot.words + (b0 + u) * e.q, e.q, lane);
      if (i < slot.n) {
        w16_old[u] = static_cast<const W16*>(slot.w16)[i];
        grad[u] = static_cast<const W16*>(slot.grad)[i];
        state[u] = update.load(i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {  // updates and stores
      if (b0 + u >= blocks) break;
      const int64_t i = (b0 + u) * 32 + lane;
      uint32_t out = 0;
      if (i < slot.n) {
        const uint32_t w = merge_bits<W16>(truncation_bits(w16_old[u], value[u] >> e.k),
                                           value[u] & ((1u << e.k) - 1u), e);
        const float g = bit_cast<float>(Widen<uint32_t>::from(grad[u]));
        const float w_new = update.apply(bit_cast<float>(w), g, state[u]);
        update.store(i, state[u]);
        const uint32_t r = K == RoundKind::Stochastic ? philox_word(seed, slot.rand_offset, i) : 0u;
        uint32_t extra, flag;
        RoundEvents ev;
        static_cast<W16*>(slot.w16)[i] =
            Store<W16>::from(split_bits<W16, K, false>(bit_cast<uint32_t>(w_new), e, r, extra, flag, ev));
        out = extra | (flag << e.k);
        tc.add(ev);
      }
      write_packed(slot.words + (b0 + u) * e.q, e.q, lane, out, scratch);
    }
  }
  if (counts != nullptr) finish_counts(tc, counts, numel);
}

template <class W16, RoundKind K>
__global__ void __launch_bounds__(kThreads)
split_kernel(const float* w32, W16* w16, uint32_t* words, int64_t n, ExtraBitsParams e,
             uint64_t seed, uint64_t offset, unsigned long long* counts) {
  const uint32_t lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  uint32_t* const scratch = warp_scratch();
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
    write_packed(words + b * e.q, e.q, lane, out, scratch);
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
  // The slot table travels in one device buffer: slots, then the chunk prefix sums.
  const int32_t n = int32_t(s.slots.size());
  std::vector<int64_t> first(n + 1, 0);
  int64_t numel = 0;
  for (int32_t i = 0; i < n; ++i) {
    const int64_t blocks = (s.slots[i].n + 31) / 32;
    first[i + 1] = first[i] + (blocks + kBlocksPerChunk - 1) / kBlocksPerChunk;
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
        <<<grid, kThreads, 0, stream>>>(t, s.e, s.sgd, s.adam, s.seed, numel,
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
