// Requests for the extra-bits drivers (docs/design.md §5), validated by make_extra_bits_params.
#pragma once
#include <cstdint>
#include <vector>

#include "lowfp/extra_bits.hpp"
#include "lowfp/format.hpp"
#include "lowfp/optim_math.hpp"

namespace lowfp {

// k, the 16-bit type (Float16 or BFloat16), the rounding of w (toward_zero, nearest,
// stochastic) and the weight format (null: the 16-bit type's own grid); throws
// std::invalid_argument otherwise.
ExtraBitsParams make_extra_bits_params(DType weights, int32_t k, Rounding mode,
                                       const FormatSpec* grid = nullptr);

struct ExtraBitsSplit {       // W (float32) -> w (16-bit) + packed words
  const float* w32;
  void* w16;
  uint32_t* words;
  int64_t n;
  uint64_t seed, offset;      // stochastic rounding: Philox block offset + i / 4, word i % 4
};

struct ExtraBitsMerge {       // w + packed words -> W' (float32)
  const void* w16;
  const uint32_t* words;
  float* w32;
  int64_t n;
};

// One parameter of a fused step: its 16-bit weights, gradient (same dtype), packed words and
// optimizer state (momentum buffer, or exp_avg / exp_avg_sq / max_exp_avg_sq; unused: null).
struct ExtraBitsSlot {
  void* w16;
  const void* grad;
  uint32_t* words;
  void* state0;
  void* state1;
  void* state2;
  int64_t n;
  // Stochastic rounding: element i takes word (rand_element + i) % 4 of Philox block
  // (rand_element + i) / 4, so a shard of a larger tensor can draw as that tensor would.
  uint64_t rand_element;
};

enum class OptimKind : int32_t { Sgd = 0, Adam = 1 };

// The float32 square root of a whole array that the CPU Adam step takes its denominators' roots
// from, with the signature of MKL's vmsSqrt (n, in, out, mode). torch's CPU sqrt is that
// routine where torch has MKL, and it is not always correctly rounded, so lowfp's Python layer
// hands over torch's own (after checking it against torch.sqrt) to step as torch.optim steps.
// Unset (null): std::sqrt, correctly rounded.
using VectorSqrt = void (*)(int32_t n, const float* in, float* out, int64_t mode);
struct CpuSqrt {
  VectorSqrt fn;
  int64_t mode;
};
void set_cpu_sqrt(CpuSqrt root);
CpuSqrt cpu_sqrt();

struct ExtraBitsStep {
  ExtraBitsParams e;
  Rounding mode;
  DType weights, state;       // state: Float32 or BFloat16 moments
  OptimKind opt;
  bool has_momentum;          // SGD with momentum != 0
  SgdHyper sgd;
  AdamHyper adam;
  uint64_t seed;
  std::vector<ExtraBitsSlot> slots;
  // One bool on the weights' device, or null: when it holds true the whole step is skipped
  // (nothing written, nothing counted). Stepping inside backward sets it from the gradient's
  // finiteness check on the device, so the host never waits for that check.
  const bool* found_inf;
  // One float32 on the weights' device, or null: the loss scale of torch.amp.GradScaler, by
  // which the step divides every gradient element (unscale_gradient) before the update. It
  // stays on the device, so the host never waits for it.
  const float* grad_scale;
};

}  // namespace lowfp
