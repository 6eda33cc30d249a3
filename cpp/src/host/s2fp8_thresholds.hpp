// Building the per-call forms of an S2FP8 call's element transform: the threshold form
// (S2fp8Thresholds, deterministic modes) and the fast stochastic form (S2fp8StochasticForm).
#pragma once
#include <vector>

#include "s2fp8_forms.hpp"

namespace lowfp {

// Whether a per-call form's tables of x' (raw bits) for the two signs mirror each other, so that
// one sign's table and x's sign bit suffice: at each index i < n that used(i) accepts, the
// positive entry has no sign bit and the negative one is it with sign_bit set.
template <class Used>
bool mirrored_tables(const uint32_t* pos, const uint32_t* neg, size_t n, uint32_t sign_bit,
                     Used&& used) {
  for (size_t i = 0; i < n; ++i)
    if (used(i) && ((pos[i] & sign_bit) != 0 || neg[i] != (pos[i] | sign_bit))) return false;
  return true;
}

// LOWFP_S2FP8_FLOAT64=1 keeps every element on the float64 path (tests compare the forms with it).
bool s2fp8_float64_forced();

// Whether the call may take the threshold form at all: a deterministic mode, 16- or 32-bit x,
// and the float64 path not forced. Checked before waiting for statistics that would then go unused.
bool s2fp8_threshold_form_allowed(const S2fp8Call& call);

// Whether a call may take the fast stochastic form at all: stochastic rounding, 16- or 32-bit x,
// and the float64 path not forced.
bool s2fp8_stochastic_form_allowed(const S2fp8Call& call);

// Fills t (its arrays in storage) for call with statistics s; false when the call has no
// threshold form (not allowed above, a format finer than 4096 grid points, more than 2^16
// buckets) or is too small to pay for building it: the float64 path then runs.
bool s2fp8_build_thresholds(const S2fp8Call& call, const S2fp8Stats& s, S2fp8Thresholds& t,
                            std::vector<uint32_t>& storage);

// Fills form (its table in storage) for a stochastic call with statistics s; false when the form
// does not apply (not stochastic, float64 x, the float64 path forced, fewer than 1024 elements, a
// format finer than m = 10 or with more than 2048 values per sign, alpha above 1024, or bands too wide)
// and the float64 path runs.
bool s2fp8_build_stochastic(const S2fp8Call& call, const S2fp8Stats& s, S2fp8StochasticForm& form,
                            std::vector<uint32_t>& storage);

}  // namespace lowfp
