// Extra bits on the GPU (docs/design.md §5): split, merge and the fused optimizer step of a whole
// parameter group in one launch. A warp owns a chunk of consecutive 32-element packed blocks of
// one parameter at a time (lane j = element j of each block), so a block's q words are read and
// written by that warp alone: each lane reads its bits directly, and the words are assembled in
// the warp's own shared scratch (no races with other warps).
// The element math is cpp/include/lowfp/extra_bits.hpp and optim_math.hpp, as on the CPU.
#include "common.cuh"
#include "extra_bits_cuda.hpp"
#include "extra_bits_dispatch.hpp"
#include "lowfp/philox.hpp"

#include <memory>

namespace lowfp {
namespace {

// Writes the warp's 32 values (lane j: value < 2^q) into the block's q words: each lane ORs its
// bits into (at most two of) the words in the warp's shared scratch, then lanes 0..q-1 store them.
// Lane j < q alone clears, reads and stores word j, so its read of one block comes before its
// clearing for the next (program order), and the next block's ORs wait at the first __syncwarp.
__device__ void write_packed(uint32_t* block, uint32_t q, uint32_t lane, uint32_t value,
                             uint32_t* scratch) {
  if (lane < q) scratch[lane] = 0;
  __syncwarp();
  const uint32_t bit = lane * q, word = bit >> 5, shift = bit & 31;
  atomicOr(scratch + word, value << shift);
  if (shift + q > 32) atomicOr(scratch + word + 1, value >> (32 - shift));
  __syncwarp();
  if (lane < q) block[lane] = scratch[lane];
}

// Each warp's scratch for write_packed: a block's q words.
__device__ uint32_t* warp_scratch() {
  __shared__ uint32_t scratch[kThreads / 32][kMaxPackedBits];
  return scratch[threadIdx.x / 32];
}

// The Philox word of element i (a block of 4 per counter; docs/design.md §3's scheme). Selects, not
// .w[i % 4]: a runtime index would put the block in local memory.
__device__ uint32_t philox_word(uint64_t seed, uint64_t block_offset, uint64_t i) {
  const Philox4x32Block b = philox_block(seed, block_offset + i / 4);
  const uint32_t j = uint32_t(i % 4);
  return j == 0 ? b.w[0] : j == 1 ? b.w[1] : j == 2 ? b.w[2] : b.w[3];
}

// Each warp's exchange of a chunk's random words (stochastic steps only).
__device__ uint32_t* warp_random_words() {
  __shared__ uint4 words[kThreads / 32][33];  // 32 blocks, and a 33rd when a chunk starts mid-block
  return reinterpret_cast<uint32_t*>(words[threadIdx.x / 32]);
}

// The parameters of one launch, passed by value as the kernel's argument: CUDA 12.1+ allows
// 32764 bytes of arguments on Volta and newer (lowfp builds with CUDA 13, whose drivers all do).
// So a step needs no device buffer and never waits for the GPU, where copying a table from host
// memory would (each parameter's step, when stepping inside backward, would wait for the whole
// backward pass queued before it). A group with more parameters takes one launch per table.
constexpr int kSlotsPerLaunch = 384;
struct SlotTable {
  ExtraBitsSlot slots[kSlotsPerLaunch];
  int64_t first_chunk[kSlotsPerLaunch + 1];  // prefix sums of the slots' chunk counts
  int32_t n_slots;
};
static_assert(sizeof(SlotTable) + sizeof(ExtraBitsParams) + sizeof(SgdHyper) + sizeof(AdamHyper) + 80
                  <= 32764, "step_kernel's arguments must fit CUDA's 32764-byte limit");

// Packed blocks per chunk: 4 measured fastest of 1, 2 and 4 on an H100 (bench/profile_gpu.py).
constexpr int kBlocksPerChunk = 4;

// A parameter seen from element `first` on (a multiple of 32): the chunk's accesses are then a base
// pointer plus a 32-bit offset, which saves the 64-bit index arithmetic of every load and store.
template <class W16, class Maker>
__device__ ExtraBitsSlot slot_from(const ExtraBitsSlot& s, int64_t first, uint32_t q) {
  auto advance = [&](void* p) {
    return p == nullptr ? p : static_cast<void*>(static_cast<char*>(p) + first * Maker::kStateBytes);
  };
  ExtraBitsSlot at = s;
  at.w16 = static_cast<W16*>(s.w16) + first;
  at.grad = static_cast<const W16*>(s.grad) + first;
  at.words = s.words + (first / 32) * q;
  at.state0 = advance(s.state0);
  at.state1 = advance(s.state1);
  at.state2 = advance(s.state2);
  at.n = s.n - first;
  at.rand_element = s.rand_element + uint64_t(first);
  return at;
}

// One chunk of a parameter: `at` starts at the chunk's first element. kFull: the chunk has all
// kBlocksPerChunk blocks, every element present, so no lane checks bounds (every chunk but a
// parameter's last). The warp first issues every load of the chunk (packed words, weights,
// gradients, optimizer state), then the updates and stores, so that several blocks' bytes are in
// flight per warp rather than one.
template <bool kFull, class W16, RoundKind K, bool kGrid, class Update>
__device__ void step_chunk(const ExtraBitsSlot& at, const Update& update, const ExtraBitsParams& e,
                           uint64_t seed, const float* grad_scale, uint32_t lane,
                           uint32_t* scratch, ThreadCounts& tc) {
  constexpr int U = kBlocksPerChunk;
  const int32_t blocks = kFull ? U : int32_t(min_of<int64_t>((at.n + 31) / 32, U));
  const int32_t n = kFull ? U * 32 : int32_t(min_of<int64_t>(at.n, U * 32));
  const W16* const grad = static_cast<const W16*>(at.grad);
  W16* const w16 = static_cast<W16*>(at.w16);
  const uint32_t bit = lane * e.q, shift = bit & 31;  // this lane's bits in each packed block
  const uint32_t* const lane_words = at.words + (bit >> 5);
  uint32_t value[U];
  W16 w16_old[U], grad_u[U];
  typename Update::State state[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {  // loads
    if (!kFull && u >= blocks) break;
    const int32_t i = u * 32 + int32_t(lane);
    value[u] = unpack_from(lane_words + u * e.q, shift, e.q);
    if (kFull || i < n) {
      w16_old[u] = w16[i];
      grad_u[u] = grad[i];
      state[u] = update.load(i);
    }
  }
  // Stochastic rounding: the chunk's U * 32 = 128 elements take 128 consecutive Philox words,
  // from word rand_element % 4 of block rand_element / 4 on (32 blocks, 33 when that word is not
  // a block's first: a shard of a larger tensor). Lane L computes block L and the warp exchanges
  // the words through shared memory, rather than each lane computing a whole block for one word.
  static_assert(U == 4, "a chunk of 128 elements: one Philox block per lane");
  uint32_t rand[U] = {};
  if constexpr (K == RoundKind::Stochastic) {
    uint32_t* const words = warp_random_words();
    const uint64_t block0 = at.rand_element / 4;
    const uint32_t phase = uint32_t(at.rand_element % 4);
    const Philox4x32Block b = philox_block(seed, block0 + lane);
    reinterpret_cast<uint4*>(words)[lane] = make_uint4(b.w[0], b.w[1], b.w[2], b.w[3]);
    if (phase != 0 && lane == 0) {
      const Philox4x32Block c = philox_block(seed, block0 + 32);
      reinterpret_cast<uint4*>(words)[32] = make_uint4(c.w[0], c.w[1], c.w[2], c.w[3]);
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < U; ++u) rand[u] = words[phase + u * 32 + lane];
    __syncwarp();  // all lanes have read before the next chunk's words overwrite these
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {  // updates and stores
    if (!kFull && u >= blocks) break;
    const int32_t i = u * 32 + int32_t(lane);
    uint32_t out = 0;
    if (kFull || i < n) {
      const uint32_t w = merge_bits<W16, kGrid>(
          grid_or_type_truncation_bits<W16, kGrid>(w16_old[u], value[u] >> e.k, e),
          value[u] & ((1u << e.k) - 1u), e);
      float g = bit_cast<float>(Widen<uint32_t>::from(grad_u[u]));
      if (grad_scale != nullptr) g = unscale_gradient(g, __ldg(grad_scale));
      const float w_new = update.apply(bit_cast<float>(w), g, state[u]);
      update.store(i, state[u]);
      uint32_t extra, flag;
      RoundEvents ev;
      w16[i] = Store<W16>::from(
          split_bits<W16, K, kGrid>(bit_cast<uint32_t>(w_new), e, rand[u], extra, flag, ev));
      out = extra | (flag << e.k);
      tc.add(ev);
    }
    write_packed(at.words + u * e.q, e.q, lane, out, scratch);
  }
}

// Thread blocks of step_kernel that must fit on one SM, which caps its registers per thread
// (4: 64, 3: 80). Left to itself, ptxas gives the full-chunk path 72-100 registers, which would
// leave 2-3 blocks: fewer warps to hide memory latency. With these caps (ptxas -v, sm_90) the
// bfloat16 SGD kernels spill at most 4 bytes (one reload per chunk) and Adam's at most 16
// (amsgrad, stochastic); float16 SGD, whose split takes the general rounding, would spill up to
// 52 bytes at 64 registers, so it gets 80.
template <class Maker> constexpr bool kIsAdam = false;
template <class S, bool kAmsgrad> constexpr bool kIsAdam<MakeAdam<S, kAmsgrad>> = true;
template <class W16, class Maker> constexpr int step_min_blocks() {
  return kIsAdam<Maker> || std::is_same_v<W16, Half> ? 3 : 4;
}

// A warp steps one chunk at a time: kBlocksPerChunk consecutive packed blocks of one parameter,
// whose slot it reads once.
template <class W16, RoundKind K, bool kGrid, class Maker>
__global__ void __launch_bounds__(kThreads, (step_min_blocks<W16, Maker>()))
step_kernel(const SlotTable table, ExtraBitsParams e, SgdHyper sgd, AdamHyper adam, uint64_t seed,
            int64_t numel, const bool* found_inf, const float* grad_scale,
            unsigned long long* counts) {
  if (found_inf != nullptr && *found_inf) return;  // a non-finite gradient: skip the step
  constexpr int U = kBlocksPerChunk;
  const uint32_t lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t total = table.first_chunk[table.n_slots];
  int32_t which = 0;  // the slot of the warp's last chunk: its chunks only move forward
  uint32_t* const scratch = warp_scratch();
  ThreadCounts tc;
  for (int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; c < total; c += warps) {
    while (table.first_chunk[which + 1] <= c) ++which;  // c, and so which, is the warp's
    // a copy, advanced to the chunk: the stores below cannot change it
    const ExtraBitsSlot at =
        slot_from<W16, Maker>(table.slots[which], (c - table.first_chunk[which]) * U * 32, e.q);
    const auto update = Maker::make(sgd, adam, at);
    if (at.n >= U * 32)
      step_chunk<true, W16, K, kGrid>(at, update, e, seed, grad_scale, lane, scratch, tc);
    else
      step_chunk<false, W16, K, kGrid>(at, update, e, seed, grad_scale, lane, scratch, tc);
  }
  if (counts != nullptr) finish_counts(tc, counts, numel);
}

template <class W16, RoundKind K, bool kGrid>
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
      w16[i] = Store<W16>::from(
          split_bits<W16, K, kGrid>(bit_cast<uint32_t>(w32[i]), e, r, extra, flag, ev));
      out = extra | (flag << e.k);
      tc.add(ev);
    }
    write_packed(words + b * e.q, e.q, lane, out, scratch);
  }
  if (counts != nullptr) finish_counts(tc, counts, n);
}

template <class W16, bool kGrid>
__global__ void __launch_bounds__(kThreads)
merge_kernel(const W16* w16, const uint32_t* words, float* w32, int64_t n, ExtraBitsParams e) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t value = unpack_one(words + (i / 32) * e.q, e.q, uint32_t(i % 32));
    w32[i] = bit_cast<float>(merge_bits<W16, kGrid>(
        grid_or_type_truncation_bits<W16, kGrid>(w16[i], value >> e.k, e),
        value & ((1u << e.k) - 1u), e));
  }
}

}  // namespace

void extra_bits_step_cuda(const ExtraBitsStep& s, int64_t* counts, int device, uintptr_t stream_handle) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const auto table = std::make_unique<SlotTable>();  // 28 KB: not on the caller's stack
  for (size_t begin = 0; begin < s.slots.size(); begin += kSlotsPerLaunch) {
    const int32_t n = int32_t(min_of<size_t>(s.slots.size() - begin, kSlotsPerLaunch));
    table->n_slots = n;
    table->first_chunk[0] = 0;
    int64_t numel = 0;
    for (int32_t i = 0; i < n; ++i) {
      const ExtraBitsSlot& slot = s.slots[begin + i];
      const int64_t blocks = (slot.n + 31) / 32;
      table->slots[i] = slot;
      table->first_chunk[i + 1] = table->first_chunk[i] + (blocks + kBlocksPerChunk - 1) / kBlocksPerChunk;
      numel += slot.n;
    }
    if (table->first_chunk[n] == 0) continue;  // empty parameters only
    const int grid = grid_size(device, table->first_chunk[n] * 32);
    dispatch_extra_bits_step(s, [&](auto w16, auto kind, auto maker) {
      step_kernel<typename decltype(w16)::type, decltype(kind)::value, decltype(w16)::grid,
                  typename decltype(maker)::type>
          <<<grid, kThreads, 0, stream>>>(*table, s.e, s.sgd, s.adam, s.seed, numel, s.found_inf,
                                          s.grad_scale, reinterpret_cast<unsigned long long*>(counts));
    });
    check(cudaGetLastError(), "kernel launch");
  }
}

void extra_bits_split_cuda(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a,
                           int64_t* counts, int device, uintptr_t stream_handle) {
  if (a.n == 0) return;
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  dispatch_extra_bits_kind(e, mode, [&](auto w16, auto kind) {
    using W16 = typename decltype(w16)::type;
    split_kernel<W16, decltype(kind)::value, decltype(w16)::grid><<<grid_size(device, a.n), kThreads, 0, stream>>>(
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
  dispatch_weights(e, [&](auto w16) {
    using W16 = typename decltype(w16)::type;
    merge_kernel<W16, decltype(w16)::grid><<<grid_size(device, a.n), kThreads, 0, stream>>>(
        static_cast<const W16*>(a.w16), a.words, a.w32, a.n, e);
  });
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace lowfp
