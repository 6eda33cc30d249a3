#include "extra_bits_cpu.hpp"

#include <vector>

#include "driver.hpp"

namespace lowfp {

namespace {

// Contiguous ranges of the blocks of 32 elements of a buffer of n elements, one per thread.
template <class Fn>
void parallel_blocks(int64_t n, Fn&& fn) {
  parallel_items((n + 31) / 32, n, fn);
}

}  // namespace

EventCounts extra_bits_split_cpu(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a) {
  PerThread<EventCounts> parts(threads_for(a.n));
  const auto fn = kernel().extra_bits_split;
  parallel_blocks(a.n, [&](int t, int64_t b0, int64_t b1) { fn(e, mode, a, b0, b1, parts[t].v); });
  return sum(parts);
}

void extra_bits_merge_cpu(const ExtraBitsParams& e, const ExtraBitsMerge& a) {
  const auto fn = kernel().extra_bits_merge;
  parallel_blocks(a.n, [&](int, int64_t b0, int64_t b1) { fn(e, a, b0, b1); });
}

void extra_bits_gather_cpu(const uint32_t* src, const int64_t* index, int64_t n, uint32_t q,
                           uint32_t* dst) {
  parallel_blocks(n, [&](int, int64_t b0, int64_t b1) {
    uint32_t values[32];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < 32; ++j) {
        const int64_t i = b * 32 + j;
        values[j] = i < n ? unpack_one(src + index[i] / 32 * q, q, uint32_t(index[i] % 32)) : 0u;
      }
      pack_block(values, q, dst + b * q);
    }
  });
}

EventCounts extra_bits_step_cpu(const ExtraBitsStep& s) {
  // Work items of up to kChunkBlocks blocks from every parameter, shared out dynamically.
  constexpr int64_t kChunkBlocks = 256;
  struct Chunk { int64_t slot, b0, b1; };
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (size_t i = 0; i < s.slots.size(); ++i) {
    const int64_t blocks = (s.slots[i].n + 31) / 32;
    total += s.slots[i].n;
    for (int64_t b = 0; b < blocks; b += kChunkBlocks)
      chunks.push_back({int64_t(i), b, min_of(b + kChunkBlocks, blocks)});
  }
  const auto fn = kernel().extra_bits_step;
  const int threads = threads_for(total);
  PerThread<EventCounts> parts(threads);
  const int64_t n_chunks = int64_t(chunks.size());
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1)
  for (int64_t c = 0; c < n_chunks; ++c)
    fn(s, chunks[c].slot, chunks[c].b0, chunks[c].b1, parts[omp_get_thread_num()].v);
  return sum(parts);
}

}  // namespace lowfp
