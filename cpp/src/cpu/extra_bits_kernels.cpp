// The extra-bits loops (docs/design.md §5), compiled once per instruction-set level like
// quantize_kernels.cpp: split, merge and the fused optimizer steps over whole 32-element blocks.
// Each tile unpacks its blocks into one value per element, runs a branch-free element loop the
// compiler vectorises (merge, update, split: cpp/include/lowfp/), and packs the blocks back.
#include "isa.hpp"

#include <array>
#include <cmath>
#include <type_traits>
#include <utility>

#include "extra_bits_dispatch.hpp"
#include "pack_lanes.hpp"
#include "half_lanes.hpp"
#include "philox_lanes.hpp"

namespace lowfp {
namespace LOWFP_ISA_NS {
namespace {

// 512 elements a tile: the step's four tile arrays (8 KB) and the streams it reads and writes
// stay in a 32 KB L1 cache (2048-element tiles, 32 KB of arrays alone, measured slower).
constexpr int64_t kTileElements = 512;
constexpr int64_t kTileBlocks = kTileElements / 32;
static_assert(kTileElements % 4 == 0, "tiles start on Philox block boundaries");

// Packing with q known at compile time: with AVX-512BW 16 elements per vector, with AVX2 8
// (pack_lanes.hpp; several times the scalar code, except for q = 1 on AVX-512BW); otherwise, and
// for the blocks the vector code leaves, the 32 elements of a block unroll into constant shifts
// (the run-time-q loop of the header costs more than the whole update). One instance per q.
#if defined(__AVX512BW__)
constexpr uint32_t kVectorPackFrom = 2;
#elif defined(__AVX2__)
constexpr uint32_t kVectorPackFrom = 1;
#else
constexpr uint32_t kVectorPackFrom = 18;  // none
#endif

template <uint32_t Q>
void unpack_tile_q(const uint32_t* words, int64_t blocks, uint32_t* values) {
  int64_t done = 0;  // blocks done by vector code
#if defined(__AVX2__)
  if constexpr (Q >= kVectorPackFrom) done = pack_lanes::unpack_blocks<Q>(words, blocks, values);
#endif
  for (int64_t b = done; b < blocks; ++b) {
    const uint32_t* block = words + b * Q;
#pragma GCC unroll 32
    for (uint32_t j = 0; j < 32; ++j) values[b * 32 + j] = unpack_one(block, Q, j);
  }
}

template <uint32_t Q>
void pack_tile_q(const uint32_t* values, int64_t blocks, uint32_t* words) {
  int64_t done = 0;
#if defined(__AVX2__)
  if constexpr (Q >= kVectorPackFrom) done = pack_lanes::pack_blocks<Q>(values, blocks, words);
#endif
  for (int64_t b = done; b < blocks; ++b) pack_block(values + b * 32, Q, words + b * Q);
}

using UnpackFn = void (*)(const uint32_t*, int64_t, uint32_t*);
using PackFn = void (*)(const uint32_t*, int64_t, uint32_t*);

template <uint32_t... Q>
constexpr std::array<UnpackFn, sizeof...(Q)> unpack_table(std::integer_sequence<uint32_t, Q...>) {
  return {unpack_tile_q<Q + 1>...};
}
template <uint32_t... Q>
constexpr std::array<PackFn, sizeof...(Q)> pack_table(std::integer_sequence<uint32_t, Q...>) {
  return {pack_tile_q<Q + 1>...};
}
constexpr auto kUnpack = unpack_table(std::make_integer_sequence<uint32_t, 17>{});  // q = 1..17
constexpr auto kPack = pack_table(std::make_integer_sequence<uint32_t, 17>{});

void unpack_tile(const uint32_t* words, uint32_t q, int64_t blocks, uint32_t* values) {
  kUnpack[q - 1](words, blocks, values);
}

void pack_tile(const uint32_t* values, uint32_t q, int64_t blocks, uint32_t* words) {
  kPack[q - 1](values, blocks, words);
}

void add_events(EventCounts& c, uint32_t above_max, uint32_t underflow, uint32_t nan) {
  c.overflow += int64_t(above_max) - int64_t(nan);
  c.underflow += underflow;
  c.nan += nan;
}

// float16 tiles go through F16C where it exists (half_tile_to_float, float_tile_to_half); each
// loop then touches 16-bit or 32-bit lanes alone, so that gcc vectorises it. bfloat16 widens by a
// shift and stays in the element loops (a separate pass costs merge 40 %, the step 3 %).

// t_bits[i] = the truncation t of float16 weight i as float32 bits, from the weight and its flag
// (values[i] >> k).
template <class W16>
void truncations_through_f16c(const W16* w16, const uint32_t* values, uint32_t k, int64_t len,
                              uint32_t* t_bits) {
  alignas(64) W16 t[kTileElements];
  for (int64_t i = 0; i < len; ++i) t[i] = truncation(w16[i], values[i] >> k);
  half_tile_to_float(t, t_bits, len);
}

// t_bits[i] = the truncation t of weight i on the grid: on the 16-bit type's own, or a weight
// format's (the weights widened first, then stepped on F's grid).
template <class W16, bool kGrid>
void truncations(const W16* w16, const uint32_t* values, const ExtraBitsParams& e, int64_t len,
                 uint32_t* t_bits) {
  if constexpr (kGrid) {
    if constexpr (kF16cTiles<W16>) {
      half_tile_to_float(w16, t_bits, len);
    } else {
      for (int64_t i = 0; i < len; ++i) t_bits[i] = Widen<uint32_t>::from(w16[i]);
    }
    for (int64_t i = 0; i < len; ++i)
      t_bits[i] = grid_truncation_bits(t_bits[i], values[i] >> e.k, e);
  } else if constexpr (kF16cTiles<W16>) {
    truncations_through_f16c(w16, values, e.k, len, t_bits);
  } else {
    for (int64_t i = 0; i < len; ++i) t_bits[i] = truncation_bits(w16[i], values[i] >> e.k);
  }
}

// w16[i] = w_bits[i], a value of the 16-bit type (or inf, NaN).
template <class W16>
void store_tile(const uint32_t* w_bits, int64_t len, W16* w16) {
  if constexpr (kF16cTiles<W16>)
    float_tile_to_half(w_bits, w16, len);
  else
    for (int64_t i = 0; i < len; ++i) w16[i] = Store<W16>::from(w_bits[i]);
}

// One element of a split: the 16-bit weight's bits of float32 bits w32 into w_bits, its extra
// bits and flag into value, its rounding events added to the tile's counters.
template <class W16, RoundKind K, bool kGrid>
LOWFP_HD void split_element(uint32_t w32, const ExtraBitsParams& e, uint32_t r, uint32_t& w_bits,
                            uint32_t& value, uint32_t& above_max, uint32_t& underflow,
                            uint32_t& nan) {
  uint32_t extra, flag;
  RoundEvents ev;
  w_bits = split_bits<W16, K, kGrid>(w32, e, r, extra, flag, ev);
  value = extra | (flag << e.k);
  above_max += ev.above_max;
  underflow += ev.underflow;
  nan += ev.nan;
}

// The end of a split tile: its 16-bit weights stored, its values (the last block padded with
// zeros) packed into its blocks' words, its events counted.
template <class W16>
void finish_split_tile(const uint32_t* w_bits, uint32_t* values, int64_t len, int64_t blocks,
                       uint32_t q, W16* w16, uint32_t* words, EventCounts& counts,
                       uint32_t above_max, uint32_t underflow, uint32_t nan) {
  store_tile(w_bits, len, w16);
  for (int64_t i = len; i < blocks * 32; ++i) values[i] = 0;
  pack_tile(values, q, blocks, words);
  add_events(counts, above_max, underflow, nan);
}

// root[i] = sqrt(q[i]) for a tile, by the routine set_cpu_sqrt chose.
void sqrt_tile(const CpuSqrt& root, const float* q, int64_t len, float* out) {
  if (root.fn != nullptr) {
    root.fn(int32_t(len), q, out, root.mode);
  } else {
    for (int64_t i = 0; i < len; ++i) out[i] = std::sqrt(q[i]);
  }
}

template <class W16, RoundKind K, bool kGrid, class Update>
void step_blocks(const ExtraBitsStep& s, const ExtraBitsSlot& slot, int64_t b0, int64_t b1,
                 EventCounts& counts, const Update update) {
  const ExtraBitsParams e = s.e;
  const CpuSqrt root = cpu_sqrt();
  W16* w16 = static_cast<W16*>(slot.w16);
  const W16* grad = static_cast<const W16*>(slot.grad);
  const uint32_t k_mask = (1u << e.k) - 1u;
  alignas(64) uint32_t values[kTileElements];
  // Element i takes word (rand_element + i) % 4 of Philox block (rand_element + i) / 4: a tile
  // (i0 a multiple of 4) draws from the block of its first element on and reads from `phase`.
  alignas(64) uint32_t rand[kTileElements + 4];
  const uint32_t phase = uint32_t(slot.rand_element % 4);
  const uint32_t* const rnd = rand + phase;
  alignas(64) uint32_t w_bits[kTileElements];
  alignas(64) float g32[kTileElements];
  const float* const grad_scale = s.grad_scale;
  for (int64_t t = b0; t < b1; t += kTileBlocks) {
    const int64_t blocks = min_of(kTileBlocks, b1 - t);
    const int64_t i0 = t * 32, len = min_of(blocks * 32, slot.n - i0);
    uint32_t* words = slot.words + t * e.q;
    unpack_tile(words, e.q, blocks, values);
    if constexpr (K == RoundKind::Stochastic)
      philox_fill(rand, s.seed, (slot.rand_element + uint64_t(i0)) / 4, (phase + len + 3) / 4);
    if constexpr (!kGrid && !kF16cTiles<W16>) {  // bfloat16: one loop widens both
      for (int64_t i = 0; i < len; ++i) {
        w_bits[i] = truncation_bits(w16[i0 + i], values[i] >> e.k);
        g32[i] = bit_cast<float>(Widen<uint32_t>::from(grad[i0 + i]));
      }
    } else {
      truncations<W16, kGrid>(w16 + i0, values, e, len, w_bits);
      if constexpr (kF16cTiles<W16>) {
        half_tile_to_float(grad + i0, g32, len);
      } else {
        for (int64_t i = 0; i < len; ++i) g32[i] = bit_cast<float>(Widen<uint32_t>::from(grad[i0 + i]));
      }
    }
    if (grad_scale != nullptr) {  // a loop of its own: the update loop stays as it is without
      const GradUnscale unscale(*grad_scale);  // (-O3 unswitches its branch out of the loop)
      for (int64_t i = 0; i < len; ++i) g32[i] = unscale(g32[i]);
    }
    uint32_t above_max = 0, underflow = 0, nan = 0;
    if constexpr (Update::kSquareRootApart) {
      // w32 and g32 (dead after the first part) hold the decayed weights and the new first
      // moments, root the square roots.
      float* w32 = reinterpret_cast<float*>(w_bits);
      alignas(64) float q[kTileElements];
      for (int64_t i = 0; i < len; ++i) {
        float w = bit_cast<float>(merge_bits<W16, kGrid>(w_bits[i], values[i] & k_mask, e));
        q[i] = update.moments(i0 + i, w, g32[i], g32[i]);
        w32[i] = w;
      }
      // torch's CUDA association (a CPU twin of a GPU step) goes with CUDA's correctly rounded root
      sqrt_tile(update.h.cuda_association ? CpuSqrt{nullptr, 0} : root, q, len, q);
      for (int64_t i = 0; i < len; ++i) {
        const float w_new = update.finish(w32[i], g32[i], q[i]);
        const uint32_t r = K == RoundKind::Stochastic ? rnd[i] : 0u;
        split_element<W16, K, kGrid>(bit_cast<uint32_t>(w_new), e, r, w_bits[i], values[i],
                                     above_max, underflow, nan);
      }
    } else {
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t w = merge_bits<W16, kGrid>(w_bits[i], values[i] & k_mask, e);
        const float w_new = update_element(update, bit_cast<float>(w), g32[i], i0 + i);
        const uint32_t r = K == RoundKind::Stochastic ? rnd[i] : 0u;
        split_element<W16, K, kGrid>(bit_cast<uint32_t>(w_new), e, r, w_bits[i], values[i],
                                     above_max, underflow, nan);
      }
    }
    finish_split_tile(w_bits, values, len, blocks, e.q, w16 + i0, words, counts, above_max,
                      underflow, nan);
  }
}

}  // namespace

void extra_bits_step_range(const ExtraBitsStep& s, int64_t slot, int64_t b0, int64_t b1,
                           EventCounts& counts) {
  dispatch_extra_bits_step(s, [&](auto w16, auto kind, auto maker) {
    using Maker = typename decltype(maker)::type;
    const ExtraBitsSlot& sl = s.slots[slot];
    step_blocks<typename decltype(w16)::type, decltype(kind)::value, decltype(w16)::grid>(
        s, sl, b0, b1, counts, Maker::make(s.sgd, s.adam, sl));
  });
}

void extra_bits_split_range(const ExtraBitsParams& e, Rounding mode, const ExtraBitsSplit& a,
                            int64_t b0, int64_t b1, EventCounts& counts) {
  dispatch_extra_bits_kind(e, mode, [&](auto w16_type, auto kind) {
    using W16 = typename decltype(w16_type)::type;
    constexpr bool G = decltype(w16_type)::grid;
    constexpr RoundKind K = decltype(kind)::value;
    W16* w16 = static_cast<W16*>(a.w16);
    alignas(64) uint32_t values[kTileElements];
    alignas(64) uint32_t rand[kTileElements];
    alignas(64) uint32_t w_bits[kTileElements];
    for (int64_t t = b0; t < b1; t += kTileBlocks) {
      const int64_t blocks = min_of(kTileBlocks, b1 - t);
      const int64_t i0 = t * 32, len = min_of(blocks * 32, a.n - i0);
      if constexpr (K == RoundKind::Stochastic)
        philox_fill(rand, a.seed, a.offset + uint64_t(i0) / 4, (len + 3) / 4);
      uint32_t above_max = 0, underflow = 0, nan = 0;
      for (int64_t i = 0; i < len; ++i) {
        const uint32_t r = K == RoundKind::Stochastic ? rand[i] : 0u;
        split_element<W16, K, G>(bit_cast<uint32_t>(a.w32[i0 + i]), e, r, w_bits[i], values[i],
                                 above_max, underflow, nan);
      }
      finish_split_tile(w_bits, values, len, blocks, e.q, w16 + i0, a.words + t * e.q, counts,
                        above_max, underflow, nan);
    }
  });
}

void extra_bits_merge_range(const ExtraBitsParams& e, const ExtraBitsMerge& a, int64_t b0,
                            int64_t b1) {
  dispatch_weights(e, [&](auto w16_type) {
    using W16 = typename decltype(w16_type)::type;
    constexpr bool G = decltype(w16_type)::grid;
    const W16* w16 = static_cast<const W16*>(a.w16);
    const uint32_t k_mask = (1u << e.k) - 1u;
    alignas(64) uint32_t values[kTileElements];
    alignas(64) uint32_t t_bits[kTileElements];
    for (int64_t t = b0; t < b1; t += kTileBlocks) {
      const int64_t blocks = min_of(kTileBlocks, b1 - t);
      const int64_t i0 = t * 32, len = min_of(blocks * 32, a.n - i0);
      unpack_tile(a.words + t * e.q, e.q, blocks, values);
      if constexpr (!G && !kF16cTiles<W16>) {  // bfloat16: one loop
        for (int64_t i = 0; i < len; ++i)
          a.w32[i0 + i] = bit_cast<float>(merge_bits<W16>(
              truncation_bits(w16[i0 + i], values[i] >> e.k), values[i] & k_mask, e));
        continue;
      }
      truncations<W16, G>(w16 + i0, values, e, len, t_bits);
      for (int64_t i = 0; i < len; ++i)
        a.w32[i0 + i] = bit_cast<float>(merge_bits<W16, G>(t_bits[i], values[i] & k_mask, e));
    }
  });
}

}  // namespace LOWFP_ISA_NS
}  // namespace lowfp
