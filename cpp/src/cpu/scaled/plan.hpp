// How the CPU rounds a scaled call's elements (docs/kernels.md): the faster forms a request
// allows, prepared once with it (ScaledCpuForms), and one strategy per call (plan_scaled), each
// strategy a loop of its own in this folder. Every strategy gives the float64 strategy's bits and
// counts; the others are faster where their conditions hold.
#pragma once
#include <cstdint>
#include <type_traits>

#include "dispatch.hpp"
#include "scaled_call.hpp"

namespace lowfp {

enum class ScaledStrategy : int32_t {
  // Every element in the float64 carrier (scaled.hpp's scaled_element): the reference, for
  // every call.
  Float64 = 0,
  // Float32 inputs, scales in a format, nearest or stochastic: the float32 carrier, each quotient
  // checked against E's decision points (stochastic: the element's own, where its random word
  // puts it) and rounded again in float64 where it lies too near.
  Checked = 1,
  // Power-of-two scales and inputs of at most 32 bits: the float32 carrier, where x · 2^-k and
  // s · q are exact; element by element (any rounding mode, the elements q written if asked).
  Narrow = 2,
  // Narrow for float32 inputs rounded to nearest by addition or stochastically, without q:
  // written in 16-lane vectors, counting from the rounding's own masks.
  Lanes = 3,
  // Float32 inputs, nearest, saturating, E of few magnitudes (FP4), blocks of 16 or 32, without
  // q: comparisons of |x| with each block's thresholds, no division.
  Few = 4,
};
constexpr int32_t kScaledStrategies = 5;

// "float64", "checked", "narrow", "lanes", "few"; a name's strategy (false: no such name).
const char* scaled_strategy_name(ScaledStrategy s);
bool scaled_strategy_named(const char* name, ScaledStrategy& s);

// What the CPU strategies may use for one request, prepared with it (prepare_scaled_cpu).
// (The carriers' conditions and parameters common to the CPU and GPU are the call's:
// ScaledCall::narrow, p32, out32, addition_cap, add32, add64, divide_once, checked.)
struct ScaledCpuForms {
  // Nearest with ties to even, and round.hpp's nearest_by_addition in the float32 carrier (p32)
  // of the narrow or checked strategy: E's rounding by addition
  bool add32;
  // Few: float32 inputs, scales in a format, nearest rounding that saturates, E with at most
  // kFewMagnitudes magnitudes and a signed zero, and every mu · s exact in float64 (scaled.hpp)
  bool few;
  FewMagnitudes magnitudes;
  // When few and S has at most kFewKeys values from its smallest to its largest positive one:
  // S = s / t keyed by its float64 bits >> few_key_shift, less few_key0 (S's m mantissa bits and
  // exponent; distinct for S's values, subnormals included), few_keys keys (else 0)
  int32_t few_key_shift;
  int64_t few_key0, few_keys;
  // Float32 inputs, nearest rounding, and every mu · s of E's event points exact in float64
  // (power-of-two scales, or m + 2 + the scale's bits <= 53): the counts may come from
  // comparisons of |x| with the event points times each block's scale
  bool count_by_comparison;
  EventPoints events;
};

// At most this many keys of scale values for Few's cache of thresholds (E4M3: 144).
constexpr int64_t kFewKeys = 1024;

ScaledCpuForms prepare_scaled_cpu(const ScaledRequest& r, const ScaledCall& c);

// One call's choices.
struct ScaledPlan {
  ScaledStrategy strategy;
  // The counts from comparisons of |x| with each block's event points, in a pass over each tile
  // of its own (the rounding loop then counts nothing); Few and Lanes count in their loops.
  bool count_by_comparison;
  // y overlaps x: such a pass runs before the tile's rounding overwrites its inputs (after it
  // otherwise, while they are in cache), and Checked keeps a tile's results aside until the tile
  // is done (a tile that reruns must read its inputs again).
  bool in_place;
};

// The strategies a call allows (bit s: ScaledStrategy s; Float64 always).
uint32_t scaled_strategies(const ScaledCall& c, const ScaledCpuForms& f);

// The call's plan: the forced strategy (force_scaled_strategy) if the call allows it, its counts
// made in its own loop; else the first the call allows of Few, Lanes, Narrow, Checked, Float64,
// its counts by comparison where the forms allow it and the strategy does not count anyway.
ScaledPlan plan_scaled(const ScaledCall& c, const ScaledCpuForms& f);

// The strategy every later call takes where it allows it (tests run each against Float64;
// benchmarks compare them); -1: none. LOWFP_SCALED_STRATEGY (a name above) sets it at the first
// call.
void force_scaled_strategy(int32_t s);
int32_t forced_scaled_strategy();

}  // namespace lowfp
